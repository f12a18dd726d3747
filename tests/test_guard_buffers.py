"""A guarded loop's module buffers (issue: a new user's BatchNorm resumed wrong).

``guard(optimizer)`` makes ``optimizer.step()`` wait for the last save's staging copy, so
the loop never calls ``wait_staged()``. But ``forward()`` runs before the step, and it
changes the buffers of the modules it runs (a batch norm's running statistics): they are
copied when ``save()`` is called, so each version holds the buffers of its own step, not
the next step's. Real default store (shm + LMDB + ``file://`` remote).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiercheck import Checkpointer
from tiercheck.store.lifecycle import destroy_store


@pytest.mark.parametrize("log", [True, False], ids=["log", "no-log"])
def test_every_version_holds_the_buffers_of_its_own_step(tmp_path: Path, log: bool) -> None:
    root = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    opt = torch.optim.AdamW(model.parameters())
    expected: dict[int, dict[str, torch.Tensor]] = {}
    try:
        with Checkpointer(root) as ckpt:
            ckpt.guard(opt, log=log)
            for step in range(1, 13):
                model(torch.randn(16, 32)).square().mean().backward()  # changes the buffers
                opt.step()
                opt.zero_grad()
                ckpt.save(step, {"model": model, "optim": opt})
                expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.flush()
            checked = 0
            for v in ckpt.history():
                if not v.restorable:
                    continue
                for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
                    saved, want = v[f"model/{key}"], expected[v.step][key]
                    assert torch.equal(saved, want), (v.id, v.step, v.role, key)
                checked += 1
            assert checked >= 2
            # and the newest version restores the model as it was at its save
            fresh = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
            info = ckpt.restore({"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())})
            for key, want in expected[info.step].items():
                assert torch.equal(fresh.state_dict()[key], want), key
    finally:
        destroy_store(root)
