"""Latest wins (issue 31 item 2): a tier that cannot keep up never holds the trainer back.

With ``guard``, ``optimizer.step()`` waits only for the copy of its own state: a save
queued behind an earlier one that still holds the staging buffer (its fastest tier does
not hold the bytes yet) gives way instead, ends *skipped* (not failed) on its handle, and
the next save is staged once the buffer is free. Real shm tier; the earlier save's shm
write is held with a fault-injection hook that forwards everything else.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import torch

from tiercheck import Checkpointer
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
