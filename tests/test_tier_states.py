"""One vocabulary for a tier's state of a version: the save handle, history and the CLI
name the same thing alike (docs/concepts.md, "A tier's state of a version")."""

from __future__ import annotations

import json
import typing
import uuid
from pathlib import Path

import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.cli.main import main as cli
from tiercheck.runtime.handles import TierState


def test_the_vocabulary_is_one_list() -> None:
    assert typing.get_args(TierState) == (
        "pending",
        "committed",
        "migrating",
        "missing",
        "failed",
        "dropped",
        "unreachable",
    )


def test_handle_history_and_cli_say_the_same_state(tmp_path: Path, capsys: object) -> None:
    """A diff in a tier of bases is ``missing`` for the handle, history and ``tiercheck ls``
    alike (the handle once said ``skipped``); a tier that cannot be opened is
    ``unreachable`` for all three (the handle once said ``failed``)."""
    unset = f"TIERCHECK_TEST_UNSET_{uuid.uuid4().hex}"  # a secret that is nowhere
    tiers = [
        TierSpec("fast", f"memory://{uuid.uuid4().hex}"),
        TierSpec("bases", f"lmdb://{tmp_path / 'lmdb'}"),
        TierSpec("gone", "peer://127.0.0.1:9", {"token": {"env": unset}}),
    ]
    policy = Policy(base_every=2, tiers={"bases": TierPolicy(versions="base")})
    root = tmp_path / "store"
    with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
        results = [ckpt.save(s, {"w": torch.full((256,), float(s))}).wait() for s in (1, 2)]
        history = {v.id: v.tiers for v in ckpt.history()}
    assert [r.role for r in results] == ["base", "diff"]
    assert results[0].tiers == {"fast": "committed", "bases": "committed", "gone": "unreachable"}
    assert results[1].tiers == {"fast": "committed", "bases": "missing", "gone": "unreachable"}
    for r in results:
        assert r.version is not None
        assert history[r.version] == r.tiers
    # the CLI reads the store from its own process: gone is still unreachable
    capsys.readouterr()  # type: ignore[attr-defined]
    assert cli(["ls", str(root), "--json"]) in (0, 1)
    rows = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    rows = rows["versions"] if isinstance(rows, dict) else rows
    by_id = {row["id"]: row["tiers"] for row in rows}
    for r in results:
        assert by_id[r.version] == dict(r.tiers)
