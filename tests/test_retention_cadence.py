"""A store left running stays bounded (issue 25, items 1 and 2): the remote tier receives a
base at most every ``remote_every``, every tier's default retention keeps the last few
versions (plus optional milestones), and what retention drops leaves the disk.

The footprint test is ``benchmarks/retention.py`` made small: guarded saves of a real
model + AdamW in two trainer processes on the default store, then ``tiercheck gc --grace
0``, and the footprint checked against the formula in docs/configuration.md ("Footprint").
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import _fresh
import lmdb
import pytest
import torch

from tiercheck import Checkpointer, Policy, TierPolicy
from tiercheck.core.sizes import tree_bytes
from tiercheck.errors import ConfigError
from tiercheck.formats.manifest import Role, VersionInfo
from tiercheck.store.cadence import Cadence, parse_cadence
from tiercheck.store.catalog import TierLog
from tiercheck.store.config import (
    CONFIG_NAME,
    TierSpec,
    default_config,
    expand_root,
    load_config,
    save_config,
)
from tiercheck.store.policy import default_tier_policy
from tiercheck.upkeep.retention import Protection, milestones, plan_drops

# --- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (500, Cadence(steps=500)),
        ("500 steps", Cadence(steps=500)),
        ("1step", Cadence(steps=1)),
        ("90s", Cadence(seconds=90.0)),
        ("30min", Cadence(seconds=1800.0)),
        ("1.5h", Cadence(seconds=5400.0)),
        ("2 hours", Cadence(seconds=7200.0)),
        ("7d", Cadence(seconds=7 * 86400.0)),
        (0, None),
        ("0", None),
        (None, None),
    ],
)
def test_cadences_parse(value: object, expected: Cadence | None) -> None:
    assert parse_cadence(value, "remote_every") == expected


@pytest.mark.parametrize(
    "value", [-1, True, 1.5, "soon", "30 fortnights", "1.5 steps", "", "-5min", [30]]
)
def test_a_bad_cadence_is_a_config_error_that_says_what_is_accepted(value: object) -> None:
    with pytest.raises(ConfigError, match=r"remote_every must be a number of steps .*'30min'"):
        Policy(remote_every=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"milestones must be"):
        TierPolicy(milestones=value)  # type: ignore[arg-type]


def test_remote_every_none_is_refused_for_0() -> None:
    with pytest.raises(ConfigError, match="0 sends every base"):
        Policy(remote_every=None)  # type: ignore[arg-type]
    assert parse_cadence(Policy(remote_every=0).remote_every, "remote_every") is None


def test_every_is_refused_on_a_synchronous_tier() -> None:
    with pytest.raises(ConfigError, match=r"every='1h' applies to an asynchronous tier"):
        TierPolicy(mode="sync", every="1h")
    assert TierPolicy(mode="async", every="1h").cadence == Cadence(seconds=3600.0)
    assert TierPolicy(mode="sync", every=0).cadence is None


def _expanded(spec: TierSpec, root: Path) -> dict[str, Any]:
    spec = expand_root(spec, root)
    return {"url": spec.url, **spec.options}


def test_the_default_remote_placement_is_bounded_and_follows_remote_every(tmp_path: Path) -> None:
    config = default_config(tmp_path / "store")
    remote = next(s for s in config.tiers if s.name == "remote")
    from tiercheck.backends import open_tier

    tier = open_tier(**_expanded(remote, tmp_path / "store"))
    try:
        tp = Policy().for_tier("remote", tier.capabilities)
        assert (tp.mode, tp.keep_bases, tp.cadence) == ("async", 2, Cadence(seconds=1800.0))
        tp = Policy(remote_every="2 steps").for_tier("remote", tier.capabilities)
        assert tp.cadence == Cadence(steps=2)
    finally:
        tier.close()
    # every tier's default keeps a bounded number of versions
    from tiercheck.backends.base import Capabilities, FailureDomain

    for caps in [
        Capabilities(FailureDomain.PROCESS, shared=False, persistent=False, speed_rank=10),
        Capabilities(FailureDomain.NODE, shared=False, persistent=False, speed_rank=20),
        Capabilities(FailureDomain.PROCESS, shared=False, persistent=True, speed_rank=30),
        Capabilities(FailureDomain.CLUSTER, shared=True, persistent=True, speed_rank=50),
    ]:
        assert default_tier_policy(caps).keep_bases is not None


def test_remote_every_and_milestones_round_trip_through_tiercheck_toml(tmp_path: Path) -> None:
    path = tmp_path / CONFIG_NAME
    path.write_text(
        textwrap.dedent(
            """
            format = 1
            [policy]
            remote_every = "2h"
            [[tier]]
            name = "lmdb"
            url = "lmdb:///tmp/x"
            versions = "base"
            milestones = 1000
            [[tier]]
            name = "remote"
            url = "file:///tmp/y"
            mode = "async"
            versions = "base"
            keep_bases = 3
            every = "500 steps"
            milestones = "1d"
            """
        )
    )
    config = load_config(path)
    assert config.policy.remote_every == "2h"
    assert config.policy.tiers["lmdb"].milestone_cadence == Cadence(steps=1000)
    remote = config.policy.tiers["remote"]
    assert remote.cadence == Cadence(steps=500)
    assert remote.milestone_cadence == Cadence(seconds=86400.0)
    copy = tmp_path / "copy.toml"
    save_config(copy, config)
    again = load_config(copy)  # (saving gives the file a store id; the policy is the point)
    assert (again.tiers, again.policy) == (config.tiers, config.policy)
    path.write_text('format = 1\n[policy]\nremote_every = "often"\n')
    with pytest.raises(ConfigError, match=r"tiercheck.toml: \[policy\]: remote_every must be"):
        load_config(path)
    path.write_text(
        'format = 1\n[[tier]]\nname = "remote"\nurl = "file:///tmp/y"\nmode = "async"\n'
        'milestones = "weekly"\n'
    )
    with pytest.raises(ConfigError, match=r"tier 'remote': milestones must be .*'weekly'"):
        load_config(path)


# --- retention on hand-written catalogs -------------------------------------------------


def _log(*versions: tuple[int, Role, int | None, float]) -> TierLog:
    """A tier log holding ``(step, role, base, time)`` versions, ids = steps."""
    tl = TierLog("t")
    for step, role, base, t in versions:
        tl.committed[step] = VersionInfo(step, step, role, base, 1, (f"m{step}",), t, 1)
    return tl


def test_milestones_by_steps_keep_the_oldest_base_of_each_window() -> None:
    # bases every 4 steps from 1 to 37, logs between
    tl = _log(*((s, "base", None, float(s)) for s in range(1, 40, 4)))
    tl.committed[38] = VersionInfo(38, 38, "log", 37, 1, ("m38",), 38.0, 1)
    policy = TierPolicy(versions="all", keep_bases=2, milestones=10)
    # windows of 10 steps: 1 (0-9), 13 (10-19), 21 (20-29), 33 (30-39); the newest 2: 33, 37
    kept = set(tl.held()) - set(plan_drops(tl, policy))
    assert kept == {1, 13, 21, 33, 37, 38}
    assert milestones(policy, [tl.committed[v] for v in tl.held()]) == {1, 13, 21, 33}
    # a milestone stays one as newer bases come
    tl.committed[41] = VersionInfo(41, 41, "base", None, 1, ("m41",), 41.0, 1)
    kept = set(tl.held()) - set(plan_drops(tl, policy))
    assert kept == {1, 13, 21, 33, 37, 38, 41}  # log 38 follows base 37, which is kept
    # without milestones: the newest two bases (and the log of one), nothing else
    assert set(tl.held()) - set(plan_drops(tl, TierPolicy(keep_bases=2))) == {37, 38, 41}


def test_milestones_by_time_use_the_versions_clock() -> None:
    hour = 3600.0
    tl = _log(*((s, "base", None, s * 0.25 * hour) for s in range(0, 13)))  # every 15 min
    kept = set(tl.held()) - set(plan_drops(tl, TierPolicy(keep_bases=1, milestones="1h")))
    assert kept == {0, 4, 8, 12}


def test_retention_never_drops_what_the_protection_keeps() -> None:
    tl = _log(*((s, "base", None, float(s)) for s in range(1, 6)))
    # the tier's newest restorable version, and an old base a newer version needs elsewhere
    protect = Protection(keep=frozenset({2, 5}))
    assert plan_drops(tl, TierPolicy(keep_bases=1), (), protect) == [1, 3, 4]
    # milestones every 2 steps: 1, 2 and 4 (the oldest of windows 0, 1, 2)
    assert plan_drops(tl, TierPolicy(keep_bases=1, milestones=2), (), protect) == [3]


def test_cadence_is_due_by_steps_or_time_and_restarts_when_going_back() -> None:
    c = Cadence(steps=5)
    assert not c.due(14, 0.0, 10, 0.0) and c.due(15, 0.0, 10, 0.0)
    assert c.due(3, 0.0, 10, 0.0)  # a run restarted from an older version
    t = Cadence(seconds=60.0)
    assert not t.due(0, 159.0, 0, 100.0) and t.due(0, 160.0, 0, 100.0)
    assert t.due(0, 50.0, 0, 100.0)


# --- the cadence in a store -------------------------------------------------------------


def _held(ckpt: Checkpointer, tier: str) -> list[int]:
    return [v.step for v in ckpt.history() if v.tiers.get(tier) == "committed"]


def test_the_remote_tier_receives_a_base_every_remote_every_steps(tmp_path: Path) -> None:
    """Every version a base: the remote gets steps 1, 4, 7 and keeps the newest two; the
    handles of the others say why it was skipped; a reopened store counts from the tier's
    newest version."""
    root = tmp_path / "store"
    state = {"w": torch.zeros(1024)}
    ckpt = Checkpointer(root, policy=Policy(base_every=1, remote_every=3))
    failed = True
    try:
        results = {}
        for step in range(1, 8):
            state["w"] += 1
            results[step] = ckpt.save(step, state).wait_migrated()
        ckpt.flush()
        for step, res in results.items():
            if step in (1, 4, 7):
                assert res.tiers["remote"] == "committed", res.errors
            else:
                assert res.tiers["remote"] == "missing"
                assert "every 3 steps" in res.errors["remote"]
        assert _held(ckpt, "remote") == [4, 7]
        failed = False
    finally:
        if failed:
            ckpt.destroy()
        else:
            ckpt.close()
    ckpt = Checkpointer(root)  # remote_every = 3 was written to tiercheck.toml
    try:
        for step in range(8, 11):
            state["w"] += 1
            res = ckpt.save(step, state).wait_migrated()
            assert res.tiers["remote"] == ("committed" if step == 10 else "missing")
        ckpt.flush()
        assert _held(ckpt, "remote") == [7, 10]
        # whatever the remote skipped is in the faster tiers: the newest restores from LMDB
        out = {"w": torch.empty(1024)}
        assert ckpt.restore(out).step == 10 and torch.equal(out["w"], state["w"])
    finally:
        ckpt.destroy()


# --- the footprint --------------------------------------------------------------------

_TRAINER = textwrap.dedent(
    """
    import sys
    import torch
    import tiercheck

    root, steps, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(seed)
    with tiercheck.Checkpointer(root) as ckpt:
        ckpt.guard(optimizer)
        start = 0
        if ckpt.history():
            start = ckpt.restore({"model": model, "optim": optimizer}).step
        for step in range(start + 1, start + steps + 1):
            model(torch.randn(16, 1024, generator=data)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ckpt.save(step, {"model": model, "optim": optimizer})
    """
)


@pytest.mark.slow
def test_guarded_saves_on_the_default_store_stay_within_the_documented_footprint(
    tmp_path: Path,
) -> None:
    """Two trainer processes of 30 guarded saves each (a base every few steps), then
    ``tiercheck gc --grace 0``: LMDB holds 2 bases in at most (2 + 2) states of pages plus
    its reservation, the remote the one base its cadence let through (30 minutes), and the
    store's pages take under 8 states. Before: every base in both (about 15 each)."""
    root = tmp_path / "store"
    try:
        _footprint_within_formula(root)
    finally:
        if root.exists():
            Checkpointer(root).destroy()


def _footprint_within_formula(root: Path) -> None:
    for seed in range(2):
        proc = _fresh.run(
            ["-c", _TRAINER, str(root), "30", str(seed)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr
    gc = _fresh.run(
        ["-m", "tiercheck", "gc", str(root), "--grace", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gc.returncode == 0, gc.stderr
    state = 3 * 4 * (1024 * 1024 + 1024)  # weights and AdamW's two moments, fp32
    ckpt = Checkpointer(root, read_only=True)
    try:
        history = ckpt.history()
        assert max(v.step for v in history) == 60
        bases = {
            t: [v.step for v in history if v.tiers.get(t) == "committed" and v.role == "base"]
            for t in ("lmdb", "remote")
        }
        assert len(bases["lmdb"]) == 2, bases
        assert bases["remote"] == [1], bases  # 30 minutes have not passed
        lmdb_tier = ckpt.tierset.get("lmdb").tier
        assert lmdb_tier is not None
        assert lmdb_tier.usage() <= 2 * state * 1.02
    finally:
        ckpt.close()
    env = lmdb.open(str(root / "lmdb"), readonly=True, lock=False, max_dbs=8)
    try:
        pages = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()
    # docs/configuration.md, "Footprint": LMDB's pages <= (keep_bases + 2) x V; its blocks
    # add a reservation of at most the largest write (V) + V/16 + 32 MiB
    assert pages <= 4 * state * 1.05 + (1 << 20)
    assert tree_bytes(root / "lmdb") <= pages + state * 17 / 16 + (32 << 20)
    remote = tree_bytes(root / "remote")
    assert remote <= 1 * state * 1.05 + (1 << 20)
    assert (pages + remote) / state < 8


def test_another_process_reads_a_base_the_cadence_deferred_as_missing(tmp_path: Path) -> None:
    """Seen from a read-only open (the writer's queue is not visible), a base the remote's
    cadence did not send reads ``missing``, as the writer's handle said: not
    ``migrating``, which it would read for ever since the writer will never send it."""
    root = tmp_path / "store"
    state = {"w": torch.zeros(1024)}
    with Checkpointer(root, policy=Policy(base_every=1, remote_every=3)) as ckpt:
        for step in range(1, 6):
            state["w"] += 1
            ckpt.save(step, state).wait_migrated()
    view = Checkpointer(root, read_only=True)
    try:
        seen = {v.step: v.tiers["remote"] for v in view.history()}
        assert seen == {1: "committed", 2: "missing", 3: "missing", 4: "committed", 5: "missing"}
    finally:
        view.close()
        Checkpointer(root).destroy()
