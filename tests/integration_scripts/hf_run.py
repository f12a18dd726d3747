"""A tiny transformers.Trainer run (GPT-2 from a config, CPU) with TiercheckCallback
(tests/test_integrations.py).

``run``: train to the end; ``crash``: SIGKILL itself at global step CRASH_STEP (mid-epoch,
after the checkpoint of step 6), with ``--ref-dir`` after an uninterrupted run; ``resume``:
``train(resume_from_checkpoint=True)`` in a new process. ``run`` and ``resume`` write the
final weights and optimizer state to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)

from tiercheck.integrations.hf import TiercheckCallback

CRASH_STEP = 8


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (40, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Crash(TrainerCallback):
    def on_step_begin(
        self, args: object, state: TrainerState, control: object, **kw: object
    ) -> None:
        if state.global_step == CRASH_STEP:
            os.kill(os.getpid(), signal.SIGKILL)


def job(mode: str, work: Path, out: str | None) -> None:
    args = TrainingArguments(
        output_dir=str(work / "out"),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-3,
        save_steps=3,
        save_only_model=True,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    tc = TiercheckCallback(work / "store")
    callbacks: list[TrainerCallback] = [tc]
    if mode == "crash":
        callbacks.append(Crash())
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=mode == "resume")
    opt = trainer.optimizer.state_dict()
    torch.save(
        {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": opt["state"],
            "resumed": None if tc.restored is None else tc.restored.step,
        },
        out,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "crash", "resume"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out")
    ap.add_argument("--ref-dir", help="crash: first do an uninterrupted run here")
    ap.add_argument("--ref-out")
    a = ap.parse_args()
    if a.ref_dir:
        # the reference, in this process (it saves an import); a side effect on the crash run
        # below could only make the resumed result differ from it, never hide a difference
        job("run", Path(a.ref_dir), a.ref_out)
    job(a.mode, Path(a.dir), a.out)


if __name__ == "__main__":
    main()
