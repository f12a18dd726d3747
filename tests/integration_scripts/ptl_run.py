"""A tiny Lightning run checkpointed by TiercheckIO (tests/test_integrations.py).

``run``: train to the end; ``crash``: SIGKILL itself in the middle of epoch 3 (after the
checkpoints of epochs 0-2), with ``--ref-dir`` after an uninterrupted run; ``resume``:
``fit(ckpt_path="last")`` in a new process. ``run`` and ``resume`` write the final weights
and optimizer state to ``--out`` (torch.save).
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tiercheck.integrations.lightning import TiercheckIO

EPOCHS = 5
CRASH_EPOCH, CRASH_BATCH = 3, 2


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> object:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)]


class Crash(Callback):
    """Every rank SIGKILLs itself at batch ``batch`` of epoch ``epoch``."""

    def __init__(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if (
            trainer.current_epoch == self.epoch
            and trainer.fit_loop.epoch_loop.batch_idx == self.batch
        ):
            trainer.strategy.barrier()  # every rank is here (one rank: no wait): kill them all
            os.kill(os.getpid(), signal.SIGKILL)


class FirstEpoch(Callback):
    first: int | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, *_: object) -> None:
        if self.first is None:
            self.first = trainer.current_epoch


def job(mode: str, work: Path, out: str | None, async_save: bool) -> None:
    L.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
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
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
        callbacks=callbacks,
    )
    model = Net()
    trainer.fit(model, loader, ckpt_path="last" if mode == "resume" else None)
    opt = trainer.optimizers[0].state_dict()
    torch.save(
        {"model": model.state_dict(), "optim": opt["state"], "first_epoch": first.first}, out
    )


def main(job: Callable[[str, Path, str | None, bool], None]) -> None:
    """Run ``job`` as the command line says (the reference run first, with ``--ref-dir``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "crash", "resume"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out")
    ap.add_argument("--ref-dir", help="crash: first do an uninterrupted run here")
    ap.add_argument("--ref-out")
    ap.add_argument("--async-save", action="store_true")
    args = ap.parse_args()
    if args.ref_dir:
        # the reference, in this process (it saves an import); a side effect on the crash run
        # below could only make the resumed result differ from it, never hide a difference
        job("run", Path(args.ref_dir), args.ref_out, args.async_save)
    job(args.mode, Path(args.dir), args.out, args.async_save)


if __name__ == "__main__":
    main(job)
