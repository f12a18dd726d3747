"""The lazy history API: versions from the logs, one-tensor reads, to_state_dict, diff,
verify/repair and migrate (in process; tests/test_cli.py drives the same through the CLI).

Tier reads are counted by a ``counting://NAME`` tier: a memory tier that records every
``get``, registered through ``tiercheck.register_tier`` and configured like any other.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from _blobs import newer_major

import tiercheck
from tiercheck import Checkpointer, Policy, TierPolicy
from tiercheck.backends._memory import MemoryTier
from tiercheck.errors import NoRestorableVersion
from tiercheck.formats.codecs import FORMAT_MAJOR, Codec, encode_blob
from tiercheck.history.manage import migrate
from tiercheck.history.verify import verify
from tiercheck.history.versions import Version

CHUNK = 16 * 1024


class CountingTier(MemoryTier):
    """``counting://NAME``: the named memory store NAME, counting every read (``get``,
    ``get_parts``) by id."""

    gets: ClassVar[dict[str, Counter[str]]] = {}
    _lock = threading.Lock()

    def __init__(self, url: str, **options: Any) -> None:
        self.counter_name = url.removeprefix("counting://")
        super().__init__("memory://" + self.counter_name, **options)
        self.url = url
        with self._lock:
            self.gets.setdefault(self.counter_name, Counter())

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        with self._lock:
            self.gets[self.counter_name][blob_id] += 1
        return super().get(blob_id, out)

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        with self._lock:  # a raw blob is read this way, straight into its destination
            self.gets[self.counter_name][blob_id] += 1
        return super().get_parts(blob_id, parts)


tiercheck.register_tier("counting", CountingTier, replace=True)


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[tuple[Checkpointer, Counter[str]]]:
    """A store whose fastest tier is a fresh counting tier, plus a file:// tier."""
    name = f"hist-{uuid.uuid4().hex[:12]}"
    policy = Policy(
        chunk_size=CHUNK,
        base_every=4,
        tiers={
            "fast": TierPolicy(versions="all", keep_bases=None),
            "disk": TierPolicy(versions="all", keep_bases=None),
        },
    )
    ckpt = Checkpointer(
        tmp_path / "store",
        tiers=[("fast", f"counting://{name}"), ("disk", f"file://{tmp_path / 'disk'}")],
        policy=policy,
    )
    try:
        yield ckpt, CountingTier.gets[name]
    finally:
        ckpt.close()
        MemoryTier.discard(name)
        CountingTier.gets.pop(name, None)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    layers = {f"layers.{i}.weight": torch.randn(128, 128, generator=g) for i in range(16)}
    return {
        "model": {**layers, "bias": torch.zeros(7), "ids": torch.arange(9)},
        "step": 0,
        "note": {"lr": 0.1},
    }


def _save(ckpt: Checkpointer, step: int, state: dict[str, Any], **kw: Any) -> int:
    """Save and wait until the background work after the commit (retention, GC) is done,
    so that it does not add reads to the counts."""
    version = ckpt.save(step, state, **kw).wait().version
    ckpt.flush()
    assert version is not None
    return version


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state["model"].items():
        out[f"model/{k}"] = v
    out["step"] = state["step"]
    out["note"] = state["note"]
    return out


def test_history_rows_come_from_the_logs(counted: tuple[Checkpointer, Counter[str]]) -> None:
    ckpt, gets = counted
    state = _state()
    for step in (0, 10, 20):
        state["model"]["bias"] += 1
        _save(ckpt, step, state, metadata={"loss": 1.0 / (step + 1)})
    gets.clear()
    rows = ckpt.history()
    assert not gets  # history reads no blob
    assert [v.step for v in rows] == [0, 10, 20]
    assert [v.role for v in rows] == ["base", "diff", "diff"]
    assert rows[1].base == rows[0].id
    assert all(isinstance(v, Version) and isinstance(v, tiercheck.VersionSummary) for v in rows)
    assert rows[2].tiers == {"fast": "committed", "disk": "committed"}
    assert rows[2].holders == ("fast", "disk")
    assert all(v.restorable for v in rows)
    assert rows[0].metadata == {"loss": 1.0}
    assert rows[0].logical_bytes > 16 * 128 * 128 * 4
    assert rows[0].stored_bytes > rows[1].stored_bytes > 0  # a diff writes only what changed
    assert ckpt.version(step=10).id == rows[1].id
    assert ckpt.version("latest").id == rows[2].id
    assert ckpt.version(f"step:{20}").id == rows[2].id
    assert ckpt.version(rows[0].id).base_version is None
    base = ckpt.version(rows[2].id).base_version
    assert base is not None and base.id == rows[0].id
    with pytest.raises(NoRestorableVersion):
        ckpt.version(999)
    with pytest.raises(NoRestorableVersion):
        ckpt.version(step=7)


def test_reading_one_tensor_reads_only_its_chunks(
    counted: tuple[Checkpointer, Counter[str]],
) -> None:
    ckpt, gets = counted
    state = _state()
    _save(ckpt, 0, state)
    v = ckpt.version("latest")
    gets.clear()
    entries = v.entries
    assert list(gets) == [v.info.shards[0]]  # the manifest, nothing else
    e = entries["model/layers.5.weight"]
    assert (e.kind, e.dtype, e.shape, e.size) == ("tensor", "float32", (128, 128), 65536)
    assert len(e.chunks) == 4
    assert len(v.manifest.chunks) > 16 * 4
    gets.clear()
    t = v["model/layers.5.weight"]
    assert torch.equal(t, state["model"]["layers.5.weight"])
    assert set(gets) == set(e.chunks)
    assert sum(gets.values()) == 4
    # the manifest and the 4 chunks, all from the fastest tier
    assert dict(v.read_stats.chunks_from) == {"fast": 5}
    gets.clear()
    assert v["step"] == 0 and v["note"] == {"lr": 0.1}
    small = {c for k in ("step", "note") for c in entries[k].chunks}
    assert set(gets) == small


def test_to_state_dict_and_prefix(counted: tuple[Checkpointer, Counter[str]]) -> None:
    ckpt, gets = counted
    state = _state(3)
    state["step"] = 5
    _save(ckpt, 5, state)
    v = ckpt.version(step=5)
    flat = v.to_state_dict()
    want = _flat(state)
    assert list(flat) == list(want)
    for k, value in want.items():
        if isinstance(value, torch.Tensor):
            assert flat[k].dtype == value.dtype and torch.equal(flat[k], value), k
        else:
            assert flat[k] == value
    # every chunk was fetched exactly once, even those shared by several small entries
    assert all(n == 1 for c, n in gets.items() if c != v.info.shards[0])
    only = v.to_state_dict("model/layers.1")
    assert set(only) == {"model/layers.1.weight"} | {
        f"model/layers.{i}.weight" for i in range(10, 16)
    }


def test_diff_reads_only_changed_entries(counted: tuple[Checkpointer, Counter[str]]) -> None:
    ckpt, gets = counted
    state = _state(1)
    a = _save(ckpt, 0, state)
    before = state["model"]["layers.3.weight"].clone()
    state["model"]["layers.3.weight"][7, 9] += 0.5
    state["model"]["layers.3.weight"] *= 1.01
    state["step"] = 1
    b = _save(ckpt, 1, state)
    gets.clear()
    d = ckpt.diff(a, b)
    assert (d.a, d.b) == (a, b)
    assert [c.key for c in d.changed] == ["model/layers.3.weight", "step"]
    ch = d.changed[0]
    after = state["model"]["layers.3.weight"]
    delta = after.double() - before.double()
    assert ch.reason == "data"
    assert ch.max_abs_diff == pytest.approx(delta.abs().max().item())
    assert ch.rel_l2 == pytest.approx((delta.norm() / before.double().norm()).item())
    step_change = d.changed[1]
    assert step_change.max_abs_diff == 1.0
    assert not d.added and not d.removed
    assert "model/layers.4.weight" in d.unchanged and "note" in d.unchanged
    assert d.unchanged_by_id == 15  # the 15 untouched big tensors: decided by chunk id
    # data was read only for the changed tensor and the small entries sharing a chunk
    va, vb = ckpt.version(a), ckpt.version(b)
    expected = set(va.entries["model/layers.3.weight"].chunks)
    expected |= set(vb.entries["model/layers.3.weight"].chunks)
    for k in ("model/bias", "model/ids", "step", "note"):
        expected |= set(va.entries[k].chunks) | set(vb.entries[k].chunks)
    read = {c for c in gets if c not in (va.info.shards[0], vb.info.shards[0])}
    assert read <= expected
    assert not (read & set(va.entries["model/layers.4.weight"].chunks))


def test_diff_added_removed_and_shape(counted: tuple[Checkpointer, Counter[str]]) -> None:
    ckpt, _ = counted
    state = _state(2)
    _save(ckpt, 0, state)
    del state["model"]["layers.0.weight"]
    state["model"]["new"] = torch.ones(3)
    state["model"]["bias"] = torch.zeros(8)
    state["model"]["ids"] = state["model"]["ids"].to(torch.int32)
    _save(ckpt, 1, state)
    d = ckpt.diff("step:0", "step:1")
    assert [e.key for e in d.added] == ["model/new"]
    assert [e.key for e in d.removed] == ["model/layers.0.weight"]
    reasons = {c.key: c.reason for c in d.changed}
    assert reasons == {"model/bias": "shape", "model/ids": "dtype"}
    assert "model/layers.1.weight" in d.unchanged
    assert d.to_json()["added"][0]["shape"] == [3]


def test_read_only_store_reads_and_verifies(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    policy = Policy(chunk_size=CHUNK, tiers={"disk": TierPolicy(versions="all")})
    with Checkpointer(root, tiers=[("disk", f"file://{tmp_path / 'disk'}")], policy=policy) as w:
        state = _state(4)
        w.save(3, state).wait()
        # a reader next to the open writer: no lock needed
        with Checkpointer(root, read_only=True) as r:
            (v,) = r.history()
            assert v.step == 3
            assert torch.equal(v["model/bias"], state["model"]["bias"])
            report = verify(r)
            assert report.ok and report.tiers[0].blobs == len(set(v.manifest.chunks)) + 1


def test_verify_finds_and_repairs_corruption(
    counted: tuple[Checkpointer, Counter[str]],
) -> None:
    ckpt, _ = counted
    _save(ckpt, 0, _state(5))
    v = ckpt.version("latest")
    victim = v.entries["model/layers.2.weight"].chunks[1]
    disk = ckpt.tierset.get("disk").tier
    assert disk is not None
    disk.put(victim, encode_blob(b"not the chunk", Codec.RAW), overwrite=True)
    report = verify(ckpt, tiers=["disk"])
    assert not report.ok
    assert [(p.tier, p.id, p.kind) for p in report.problems] == [("disk", victim, "corrupt")]
    assert report.problems[0].versions == (v.id,)
    repaired = verify(ckpt, repair=True)
    assert repaired.ok and repaired.repaired == 1
    assert verify(ckpt).ok and not verify(ckpt).problems


def _relabel(ckpt: Checkpointer, tier: str, blob_id: str) -> None:
    slot = ckpt.tierset.get(tier).tier
    assert slot is not None
    slot.put(blob_id, newer_major(bytes(slot.get(blob_id))), overwrite=True)


def test_verify_reports_a_newer_format_blob_and_checks_the_rest(
    counted: tuple[Checkpointer, Counter[str]],
) -> None:
    ckpt, _ = counted
    _save(ckpt, 0, _state(7))
    v = ckpt.version("latest")
    intact = verify(ckpt)
    newer = v.entries["model/layers.1.weight"].chunks[0]
    damaged = v.entries["model/layers.9.weight"].chunks[2]
    _relabel(ckpt, "disk", newer)
    disk = ckpt.tierset.get("disk").tier
    assert disk is not None
    disk.put(damaged, encode_blob(b"not the chunk", Codec.RAW), overwrite=True)

    report = verify(ckpt)
    assert not report.ok
    kinds = {(p.tier, p.id): p.kind for p in report.problems}
    assert kinds == {("disk", newer): "newer-format", ("disk", damaged): "corrupt"}
    problem = next(p for p in report.problems if p.kind == "newer-format")
    assert "upgrade tiercheck" in problem.detail and problem.versions == (v.id,)
    assert problem.to_json()["kind"] == "newer-format"
    # the pass went on: every blob of every tier was still read
    assert [(t.tier, t.blobs) for t in report.tiers] == [(t.tier, t.blobs) for t in intact.tiers]
    # a restore reads the other tier's copy
    assert torch.equal(v["model/layers.1.weight"], _state(7)["model"]["layers.1.weight"])

    repaired = verify(ckpt, repair=True)
    by_kind = {p.kind: p for p in repaired.problems}
    assert by_kind["corrupt"].repaired
    assert not by_kind["newer-format"].repaired and "not repaired" in by_kind["newer-format"].detail
    assert not repaired.ok  # a newer writer's copy is never overwritten with an older format
    assert bytes(disk.get(newer))[4] == FORMAT_MAJOR + 1


def test_verify_goes_on_past_a_newer_format_manifest(
    counted: tuple[Checkpointer, Counter[str]],
) -> None:
    ckpt, _ = counted
    state = _state(8)
    old = _save(ckpt, 0, state)
    state["model"]["bias"] += 1
    new = _save(ckpt, 1, state)
    manifest = ckpt.version(new).info.shards[0]
    for tier in ("fast", "disk"):
        _relabel(ckpt, tier, manifest)
    damaged = ckpt.version(old).entries["model/layers.4.weight"].chunks[0]
    disk = ckpt.tierset.get("disk").tier
    assert disk is not None
    disk.put(damaged, encode_blob(b"not the chunk", Codec.RAW), overwrite=True)

    report = verify(ckpt)
    got = sorted((p.tier, p.id, p.kind) for p in report.problems)
    assert got == sorted(
        [
            ("fast", manifest, "newer-format"),
            ("disk", manifest, "newer-format"),
            ("disk", damaged, "corrupt"),
        ]
    )
    for p in report.problems:
        if p.id == manifest:
            assert p.versions == (new,) and "chunks not checked" in p.detail
    assert all(t.versions == 2 and t.blobs > 1 for t in report.tiers)


def test_migrate_a_diff_takes_its_base(counted: tuple[Checkpointer, Counter[str]]) -> None:
    ckpt, _ = counted
    state = _state(6)
    _save(ckpt, 0, state)
    state["model"]["bias"] += 2
    v = ckpt.version(_save(ckpt, 1, state))
    assert v.role == "diff"
    target = ckpt.root.parent / "elsewhere"
    report = migrate(ckpt, v, f"file://{target}")
    assert report.versions == [v.base, v.id] and not report.configured
    again = migrate(ckpt, v, f"file://{target}")
    assert again.versions == [] and again.already == [v.base, v.id]
    with Checkpointer(ckpt.root.parent / "copy", tiers=[f"file://{target}"]) as other:
        out = other.version(v.id).to_state_dict()
        assert torch.equal(out["model/bias"], state["model"]["bias"])
