"""Python's garbage collector is not set off by the store's own short-lived objects.

A restore of a state of many tensors makes tens of thousands of objects that die with it,
and a sweep used to decode every manifest a tier holds, each of them thousands of entries:
their allocations set off the collector's passes, and a full pass walks every object of the
trainer's process while it holds the GIL (measured: 94 ms in a process of 200k objects,
over 400 ms in one of 4 million). A restore pauses automatic collection and puts it back
as it was; a sweep decodes a manifest once and keeps its chunks while a tier holds it.
"""

from __future__ import annotations

import gc
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck.store.fetch as fetch_mod
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import StateError
from tiercheck.runtime.gcpause import gc_paused


class _Probe:
    """A stateful object that notes whether automatic collection is on as it is loaded."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[bool] = []
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen.append(gc.isenabled())
        if self.fail:
            raise ValueError("refused")


def _store(tmp_path: Path) -> Checkpointer:
    tag = uuid.uuid4().hex[:8]
    return Checkpointer(
        tmp_path / "s",
        tiers=[TierSpec("mem", f"memory://gc-churn-{tag}")],
        policy=Policy(base_every=1, gc_grace_seconds=0, tiers={"mem": TierPolicy(keep_bases=2)}),
    )


def test_a_restore_pauses_automatic_collection_and_puts_it_back(tmp_path: Path) -> None:
    """Inside a restore automatic collection is off; after it, as it was before: on, or
    off where the caller turned it off, and on again after a restore that failed."""
    assert gc.isenabled()
    with _store(tmp_path) as ckpt:
        probe = _Probe()
        ckpt.save(0, {"p": probe, "w": torch.arange(10.0)}).wait()
        ckpt.restore({"p": probe, "w": torch.zeros(10)})
        assert probe.seen == [False] and gc.isenabled()
        gc.disable()
        try:
            ckpt.restore({"p": probe, "w": torch.zeros(10)})
            assert probe.seen == [False, False] and not gc.isenabled()
        finally:
            gc.enable()
        failing = _Probe(fail=True)
        with pytest.raises(StateError):
            ckpt.restore({"p": failing, "w": torch.zeros(10)})
        assert failing.seen == [False] and gc.isenabled()


def test_pauses_nest_across_threads() -> None:
    """Collection resumes when the last of overlapping pauses ends, whichever thread's."""
    inner_in, inner_out = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inner_in.set()
            inner_out.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inner_in.wait(10)
    assert not gc.isenabled()  # the other thread's pause still runs
    inner_out.set()
    t.join(10)
    assert gc.isenabled()


def test_sweeps_decode_each_held_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every save sweeps the tier, and each sweep marks what every held version names; a
    manifest is decoded for that once (its chunks kept), not at every sweep, and what no
    held version names any more is let go."""
    decoded: list[int] = []
    unpack = fetch_mod.unpack_manifest

    def counted(raw: Any) -> Any:
        if threading.current_thread().name.startswith("tiercheck-maint"):
            decoded.append(id(raw))
        return unpack(raw)

    monkeypatch.setattr(fetch_mod, "unpack_manifest", counted)
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(200)}
    with _store(tmp_path) as ckpt:
        for step in range(8):
            for t in state.values():
                t.add_(1)
            ckpt.save(step, state).wait()
            ckpt.flush()
            ckpt.gc()
        # 8 versions, 2 held at a time: one decoding each, not one per held one per sweep
        assert len(decoded) <= 8, len(decoded)
        kept = ckpt._engine.maintenance._chunk_lists
        held = ckpt.refresh().logs["mem"].held()
        assert 1 <= len(kept) <= len(held) + 1, (len(kept), held)
