"""TiercheckCallback resumes only the state its checkpoint names.

Two runs of a tiny transformers.Trainer (GPT-2 from a config, CPU, no downloads) share one
store; the second is SIGKILLed after the Trainer wrote ``checkpoint-2`` but before tiercheck
saved its state, so ``checkpoint-2`` has no ``tiercheck.json`` while the store holds the
first run's version of step 2. Resuming the second run from ``checkpoint-2`` must raise
CheckpointError, never load the first run's state.

The runs are this file as a script, in fresh processes: ``python test_hf_mends.py MODE WORK``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _snippets import destroy_stores

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}
KILL_STEP = 2


def _train(work: Path, run: str, seed: int, *, kill: bool = False, resume: bool = False) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tiercheck.integrations.hf import TiercheckCallback

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(i, i + 16) * 7) % 64
            return {"input_ids": ids, "labels": ids}

    class Killed(TiercheckCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if kill and state.global_step == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)  # checkpoint-2 is written, tiercheck not
            super().on_save(args, state, control, **kw)

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    args = TrainingArguments(
        output_dir=str(work / run),
        num_train_epochs=1,
        per_device_train_batch_size=4,
        save_steps=2,
        save_only_model=True,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = Killed(work / "store")
    trainer = Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    print(f"{run}: done at step {trainer.state.global_step}, resumed {callback.restored}")


def main() -> None:
    mode, work = sys.argv[1], Path(sys.argv[2])
    if mode == "runs":
        _train(work, "run1", seed=1)
        _train(work, "run2", seed=2, kill=True)
    else:
        _train(work, "run2", seed=2, resume=True)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, __file__, *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_resume_without_tiercheck_pointer_raises_and_loads_no_other_run(tmp_path: Path) -> None:
    try:
        runs = _run("runs", str(tmp_path))
        assert runs.returncode == -signal.SIGKILL, runs.stdout[-3000:] + runs.stderr[-5000:]
        assert "run1: done at step 4" in runs.stdout
        ckpt = tmp_path / "run2" / "checkpoint-2"
        assert ckpt.is_dir() and not (ckpt / "tiercheck.json").exists()
        resumed = _run("resume", str(tmp_path))
        out = resumed.stdout + resumed.stderr
        assert resumed.returncode == 1, out[-5000:]
        assert "run2: done" not in out
        assert "CheckpointError" in out and f"{ckpt / 'tiercheck.json'} does not exist" in out
    finally:
        destroy_stores(tmp_path)


if __name__ == "__main__":
    main()
