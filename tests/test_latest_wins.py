"""Latest wins (issue 31 item 2): a tier that cannot keep up never holds the trainer back.

With ``guard``, ``optimizer.step()`` waits only for the copy of its own state: a save
queued behind an earlier one that still holds the staging buffer (its fastest tier does
not hold the bytes yet) gives way instead, ends *skipped* (not failed) on its handle, and
the next save is staged once the buffer is free. A save waiting for room in the fastest
tier behind a slower tier's write of an earlier version gives way to a newer queued save
in the same way. Real shm and LMDB tiers; the write held is held with a fault-injection
hook that forwards everything else.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import torch

from tiercheck import Checkpointer
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import Policy, TierPolicy
from tiercheck.testing.faults import FaultEvent, inject


def test_guard_gives_way_to_an_earlier_save_that_holds_the_staging_buffer(
    tmp_path: Path,
) -> None:
    w = torch.zeros(1 << 16)
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones_like(w)
    gate, entered = threading.Event(), threading.Event()

    def stall(_: FaultEvent) -> None:
        entered.set()
        gate.wait(60)

    with Checkpointer(tmp_path / "s", tiers=[f"shm://tc-lw-{uuid.uuid4().hex[:12]}"]) as ckpt:
        ckpt.guard(opt, log=False)
        inject(ckpt, "shm").hook(stall, "put", count=1)
        try:
            first = ckpt.save(0, {"w": w})
            assert entered.wait(30), "the first save never reached the shm tier"
            second = ckpt.save(1, {"w": w})  # queued: the buffer is the first save's
            stepping = threading.Thread(target=opt.step)
            stepping.start()
            stepping.join(20)
            assert not stepping.is_alive(), "optimizer.step() waited for the first save's tier"
            assert not gate.is_set()
        finally:
            gate.set()
        stepping.join()
        first.wait()
        second.wait()  # skipped is not failed
        assert not first.skipped and first.result().tiers == {"shm": "committed"}
        assert second.skipped
        assert second.result().tiers == {}  # never placed
        assert "latest wins" in second.result().why_skipped

        third = ckpt.save(2, {"w": w})
        third.wait()
        assert [v.step for v in ckpt.history()] == [0, 2]
        out = {"w": torch.empty_like(w)}
        info = ckpt.restore(out)
        assert info.step == 2
        assert torch.equal(out["w"], torch.full_like(w, -1.0))
        ckpt.destroy()


def test_a_save_waiting_for_room_behind_a_slower_tier_gives_way_to_a_newer_save(
    tmp_path: Path,
) -> None:
    """shm (room for one version) keeps base 0 until LMDB holds it too; LMDB's write of
    base 0 is held. Save 1 then waits for room in shm behind LMDB's write; once save 2 is
    queued behind it, save 1 gives way (skipped, not failed) while LMDB is still held, and
    save 2 takes the staging buffer. Before the give-way, save 1 waited for the whole LMDB
    write (here: until the test let it go), and save 2 behind it."""
    n = 1 << 18  # 1 MiB of fp32
    gate, entered = threading.Event(), threading.Event()

    def stall(_: FaultEvent) -> None:
        entered.set()
        gate.wait(60)

    tiers = [
        TierSpec("shm", f"shm://tc-lw-{uuid.uuid4().hex[:12]}", {"budget": "1.5MiB"}),
        TierSpec("lmdb", f"lmdb://{tmp_path}/lmdb"),
    ]
    policy = Policy(
        base_every=1,
        tiers={
            "shm": TierPolicy(versions="all", mode="sync"),
            "lmdb": TierPolicy(versions="base", mode="sync", keep_bases=2),
        },
    )
    states = [{"w": torch.randn(n, generator=torch.Generator().manual_seed(s))} for s in range(3)]
    with Checkpointer(tmp_path / "s", tiers=tiers, policy=policy) as ckpt:
        try:
            inject(ckpt, "lmdb").hook(stall, "append", count=1)  # its commit record
            try:
                first = ckpt.save(0, states[0])
                assert entered.wait(30), "base 0 never reached LMDB's commit"
                second = ckpt.save(1, states[1])
                third = ckpt.save(2, states[2])
                second.wait(30)  # skipped while LMDB still holds base 0's write
                assert not gate.is_set()
            finally:
                gate.set()
            assert second.skipped, second.result()
            assert "latest wins" in second.result().errors["shm"]
            # committed, on LMDB: shm keeps base 0, its newest version, until a newer one is
            # restorable (a memory tier always keeps something to restore fast)
            assert third.wait(30).tiers["lmdb"] == "committed"
            assert first.wait(30).tiers["lmdb"] == "committed"
            ckpt.flush()
            assert [v.step for v in ckpt.history() if v.restorable] == [0, 2]
            out = {"w": torch.empty(n)}
            assert ckpt.restore(out).step == 2 and torch.equal(out["w"], states[2]["w"])
        finally:
            ckpt.destroy()


def test_guard_gives_way_to_a_save_whose_buffer_was_an_earlier_saves_when_asked_for(
    tmp_path: Path,
) -> None:
    """Save 1 is asked for while save 0 still holds the staging buffer (shm, its fastest
    tier, is held writing it). shm then holds save 0 and the buffer is offered to save 1,
    but LMDB is still reading save 0 from the buffer (held inside its read), so save 1's
    copy cannot start. ``optimizer.step()`` must not wait for it: save 1 gives way. Before,
    a save queued behind an offered buffer was waited for, so the step waited for LMDB's
    write of save 0 (with saves every step, the copy of every third save ran inside the
    step: issue 31's 1.16-1.27x)."""
    w = torch.zeros(1 << 16)
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones_like(w)
    shm_gate, lmdb_gate = threading.Event(), threading.Event()
    shm_entered, lmdb_entered = threading.Event(), threading.Event()

    def stall_shm(_: FaultEvent) -> None:
        shm_entered.set()
        shm_gate.wait(60)

    def stall_lmdb(_: FaultEvent) -> None:  # inside the stream writer's read of the buffer
        stream = threading.current_thread().name.startswith("tiercheck-stream")
        if stream and not lmdb_entered.is_set():
            lmdb_entered.set()
            lmdb_gate.wait(60)

    tiers = [
        TierSpec("shm", f"shm://tc-lw-{uuid.uuid4().hex[:12]}"),
        TierSpec("lmdb", f"lmdb://{tmp_path}/lmdb"),
    ]
    with Checkpointer(tmp_path / "s", tiers=tiers) as ckpt:
        ckpt.guard(opt, log=False)
        inject(ckpt, "shm").hook(stall_shm, "put", count=1)
        inject(ckpt, "lmdb").hook(stall_lmdb, "has")
        try:
            first = ckpt.save(0, {"w": w})
            assert shm_entered.wait(30), "save 0 never reached the shm tier"
            assert lmdb_entered.wait(30), "save 0 never reached LMDB"
            second = ckpt.save(1, {"w": w})  # the buffer is save 0's: shm does not hold it
            shm_gate.set()
            for _ in range(3000):  # shm holds save 0: the buffer is offered
                if first.result_now().tiers.get("shm") == "committed":
                    break
                threading.Event().wait(0.01)
            assert first.result_now().tiers.get("shm") == "committed"
            stepping = threading.Thread(target=opt.step)
            stepping.start()
            stepping.join(20)
            assert not stepping.is_alive(), "optimizer.step() waited for LMDB's write"
            assert not lmdb_gate.is_set()
        finally:
            shm_gate.set()
            lmdb_gate.set()
        stepping.join()
        assert first.wait(30).tiers == {"shm": "committed", "lmdb": "committed"}
        second.wait(30)  # skipped is not failed
        assert second.skipped, second.result()
        assert "latest wins" in second.result().why_skipped
        third = ckpt.save(2, {"w": w})
        third.wait(30)
        ckpt.flush()
        assert [v.step for v in ckpt.history() if v.restorable][-1] == 2
        out = {"w": torch.empty_like(w)}
        assert ckpt.restore(out).step == 2
        assert torch.equal(out["w"], torch.full_like(w, -1.0))
        ckpt.destroy()
