"""A Lightning run with ``ModelParallelStrategy`` (FSDP2) on 2 CPU ranks, checkpointed by
TiercheckIO (tests/test_integrations.py).

The strategy saves through DCP, never through a checkpoint IO; the only tiercheck line is
the ``TiercheckIO`` callback, which routes the strategy's saves and loads to tiercheck.
Lightning launches the second rank itself. ``run``: train to the end; ``crash``: every rank
SIGKILLs itself in the middle of epoch 2 (after the checkpoints of epochs 0 and 1), with
``--ref-dir`` after an uninterrupted run; ``resume``: ``fit(ckpt_path="last")`` in new
processes. ``run`` and ``resume`` write the final global weights and optimizer state
(``full_tensor()`` of every DTensor) to ``--out`` from rank 0. The callbacks and the
command line are ``ptl_run.py``'s. Each rank ends as the torchrun workers do
(``tests/dist_scripts/_leave.py``): gloo's teardown at interpreter exit can abort a
process whose work is done.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from ptl_run import Crash, FirstEpoch, main
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from tiercheck.integrations.lightning import TiercheckIO

sys.path.insert(0, str(Path(__file__).parents[1] / "dist_scripts"))
from _leave import leave

EPOCHS = 4
CRASH_EPOCH, CRASH_BATCH = 2, 1


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # odd sizes: uneven pieces over 2 ranks
        self.net = nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 3))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> object:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)]


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def job(mode: str, work: Path, out: str | None, async_save: bool) -> None:
    L.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 3, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    first = FirstEpoch()
    callbacks: list[Callback] = [
        TiercheckIO(work / "store", async_save=async_save),
        ModelCheckpoint(dirpath=work / "ckpts", save_last=True, every_n_epochs=1),
        first,
    ]
    if mode == "crash":
        callbacks.append(Crash(CRASH_EPOCH, CRASH_BATCH))
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
        callbacks=callbacks,
    )
    model = Net()
    trainer.fit(model, loader, ckpt_path="last" if mode == "resume" else None)
    weights = {k: _full(v) for k, v in model.state_dict().items()}
    opt = trainer.optimizers[0]
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {i: {k: _full(v) for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    if trainer.global_rank == 0 and out is not None:
        torch.save({"model": weights, "optim": state, "first_epoch": first.first}, out)


if __name__ == "__main__":
    main(job)
    leave(0)
