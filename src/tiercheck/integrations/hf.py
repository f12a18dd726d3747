"""Exact resume for ``transformers.Trainer`` with tiercheck: :class:`TiercheckCallback`.

The lines a user adds::

    args = TrainingArguments("out", save_steps=500, save_only_model=True)   # HF: weights only
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TiercheckCallback("./ckpt")])
    trainer.train(resume_from_checkpoint=True)      # the usual Trainer way to resume

How it works, through public Trainer hooks only:

- Saving: each time the Trainer saves ``checkpoint-N`` (``on_save``), the callback saves the
  whole training state as one tiercheck version of step ``N``: the model, the optimizer and
  the LR scheduler (through their ``state_dict``, no pickle), and every random generator
  (:func:`tiercheck.rng_state`). Once it is committed, ``checkpoint-N/tiercheck.json``
  names the version. With ``save_only_model=True`` the Trainer itself writes only the
  weights and ``trainer_state.json`` there, so the optimizer state (twice the weights, for
  Adam) is written once, by tiercheck, into its tiers, deduplicated.
- Resuming: ``train(resume_from_checkpoint=...)`` does what it always does: picks
  ``checkpoint-N``, loads its weights and ``trainer_state.json`` (step, epoch, the batches
  to skip). The Trainer cannot find an optimizer, scheduler or RNG file there, so at
  ``on_train_begin`` the callback restores the model, optimizer and scheduler from version
  ``N`` in place, and it sets the random generators exactly where the Trainer would have
  loaded its own RNG file: before the resumed epoch's data iterator is created when ``N``
  ends an epoch, else right after the skipped batches (``on_epoch_begin`` /
  ``on_step_begin``). The resumed run is then bit-identical to one that never stopped.
  Only ``checkpoint-N/tiercheck.json`` says which version is this run's checkpoint (a store
  may hold other runs' versions of step ``N``): without it (the job was killed after the
  Trainer wrote ``checkpoint-N``, before tiercheck committed), resuming raises
  :class:`~tiercheck.errors.CheckpointError`.

Why ``save_only_model=True`` and not no Trainer save at all: ``train(resume_from_checkpoint)``
only accepts a directory holding model weights, and no public hook runs before it looks.
Without it, the Trainer also writes ``optimizer.pt`` and ``rng_state.pth``, which works but
writes the optimizer state twice (a warning says so).

Several processes (DDP): each process saves its own state to ``root/rank{i}`` (random
generators differ per process).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tiercheck.checkpointer import Checkpointer
from tiercheck.core.rng import rng_state, set_rng_state
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.errors import CheckpointError
from tiercheck.integrations._pointer import Pointer, read_pointer, write_pointer
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import Policy

__all__ = ["POINTER_NAME", "TiercheckCallback"]

POINTER_NAME = "tiercheck.json"
"""The file in ``checkpoint-N/`` that names the tiercheck version of step ``N``."""

log = logging.getLogger(__name__)


class TiercheckCallback(TrainerCallback):
    """Save every Trainer checkpoint's full state in the tiercheck store at ``root`` and
    restore it exactly on resume (see the module docstring). ``tiers``/``policy`` configure
    a new store; ``allow_pickle`` lets values msgpack cannot hold be stored with pickle."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        tiers: Sequence[str | TierSpec | tuple[str, str]] | None = None,
        policy: Policy | None = None,
        allow_pickle: bool = False,
    ) -> None:
        self.root = Path(root).expanduser().resolve()
        self.allow_pickle = allow_pickle
        self._tiers = tiers
        self._policy = policy
        self._store: Checkpointer | None = None
        self._rng: dict[str, Any] | None = None
        self._rng_at: Literal["epoch", "step"] | None = None
        self.restored: Pointer | None = None
        """The version the last ``train()`` resumed from, if it resumed."""

    def checkpointer(self, args: TrainingArguments) -> Checkpointer:
        """This process's store (opened on first use)."""
        if self._store is None:
            root = self.root if args.world_size <= 1 else self.root / f"rank{args.process_index}"
            self._store = Checkpointer(
                root,
                tiers=self._tiers,
                policy=self._policy,
                allow_pickle=self.allow_pickle,
                coordinator=LocalCoordinator(),
            )
        return self._store

    @staticmethod
    def _state(kwargs: dict[str, Any]) -> dict[str, Any]:
        missing = [k for k in ("model", "optimizer", "lr_scheduler") if kwargs.get(k) is None]
        if missing:
            raise CheckpointError(f"the Trainer passed no {', '.join(missing)} to the callback")
        return {
            "model": kwargs["model"],
            "optimizer": kwargs["optimizer"],
            "scheduler": kwargs["lr_scheduler"],
        }

    # --- events ---------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not args.save_only_model:
            log.warning(
                "TiercheckCallback saves the optimizer, scheduler and RNG states; pass "
                "save_only_model=True to TrainingArguments so the Trainer does not write "
                "them a second time"
            )
        if state.global_step == 0:
            return  # a fresh start: nothing to restore
        step = state.global_step
        store = self.checkpointer(args)
        folder = Path(args.output_dir) / f"checkpoint-{step}"
        pointer = read_pointer(folder / POINTER_NAME) if (folder / POINTER_NAME).exists() else None
        if pointer is None:
            # a version of this step in the store may be another run's (a store shared by
            # runs, or by a run restarted from scratch): only the pointer names this one's
            raise CheckpointError(
                f"the Trainer resumed from step {step}, but {folder / POINTER_NAME} does not "
                "exist: tiercheck never committed that checkpoint's state (the job was likely "
                f"killed while saving it), or {folder} is not a checkpoint TiercheckCallback "
                "saved; resume from an earlier checkpoint that has one "
                "(train(resume_from_checkpoint='.../checkpoint-M')), or delete "
                f"{folder} to let resume_from_checkpoint=True pick the one before it"
            )
        target = {**self._state(kwargs), "rng": None}
        info = store.restore(target, version=pointer.version)
        self._rng = info.state["rng"]
        # where Trainer._load_rng_state would run: before the epoch's data iterator when
        # the checkpoint ends an epoch, after the skipped batches otherwise
        at_boundary = args.ignore_data_skip or float(state.epoch or 0).is_integer()
        self._rng_at = "epoch" if at_boundary else "step"
        self.restored = pointer

    def _apply_rng(self, when: str) -> None:
        if self._rng_at == when and self._rng is not None:
            set_rng_state(self._rng)
            self._rng, self._rng_at = None, None

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._apply_rng("epoch")

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._apply_rng("step")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step = state.global_step
        store = self.checkpointer(args)
        saved = {**self._state(kwargs), "rng": rng_state()}
        meta = {"hf": {"checkpoint": f"checkpoint-{step}", "epoch": state.epoch}}
        handle = store.save(step, saved, metadata=meta)
        handle.wait()
        assert handle.version is not None
        folder = Path(args.output_dir) / f"checkpoint-{step}"
        if folder.is_dir():  # gone if the Trainer's rotation removed it at once
            write_pointer(folder / POINTER_NAME, Pointer(str(store.root), handle.version, step))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
