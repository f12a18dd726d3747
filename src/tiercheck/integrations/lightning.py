"""tiercheck under PyTorch Lightning: :class:`TiercheckIO`.

One line adopts it::

    trainer = L.Trainer(callbacks=[TiercheckIO("./ckpt"), ModelCheckpoint(save_last=True)])
    trainer.fit(model, ckpt_path="last")      # resumes where the last run stopped

``TiercheckIO`` is a Lightning ``CheckpointIO`` and a ``Callback``. As a callback it installs
itself as the strategy's checkpoint IO when the trainer sets up, and learns the model, so
that a restore writes the saved weights into the model's own tensors (no second copy of
the model in memory). Passed as ``plugins=[TiercheckIO(...)]`` instead it works the same,
loading into fresh tensors that Lightning then copies.

What happens where:

- ``save_checkpoint(checkpoint, path)``: the checkpoint dict Lightning built (weights,
  optimizer and scheduler states, loops, callbacks, hyperparameters) becomes one tiercheck
  version of the store at ``root`` (no pickle: tensors as raw bytes, the rest as msgpack),
  plus the state of every random generator (:func:`tiercheck.rng_state`), so that a resumed
  run draws the same numbers as an uninterrupted one. At ``path`` a small pointer file names
  the version (:mod:`tiercheck.integrations._pointer`): Lightning lists, picks
  (``ckpt_path="last"``, ``"best"``) and deletes its checkpoints by those paths as usual.
- sync (default): returns once the version is committed in the store's synchronous tiers.
  ``async_save=True``: returns once the state is copied into tiercheck's staging buffer (a
  consistent snapshot: training may change the weights right after); the commit and then
  the pointer file follow in the background, in order. A background failure is raised by
  the next save and by ``teardown``. A pointer exists only for a committed version, so a
  crash mid-save leaves ``last.ckpt`` naming the previous checkpoint.
- ``load_checkpoint(path)``: reads the pointer, restores that version (in place when the
  model is known) and the random generators, and returns the checkpoint dict. A path that
  is a regular Lightning/torch file is loaded by Lightning's ``TorchCheckpointIO``.
- ``remove_checkpoint(path)``: removes the pointer (the version goes by the store's
  retention policy, see docs/configuration.md).

Lightning saves on global rank 0 only; other ranks open the store read-only to load.

**Sharded strategies.** ``ModelParallelStrategy`` (FSDP2, tensor parallel) saves through
``torch.distributed.checkpoint`` and never calls the checkpoint IO. As a callback,
``TiercheckIO`` routes such a strategy's ``save_checkpoint`` and ``load_checkpoint``
through tiercheck (no other line changes): every rank's shard of the weights and
optimizer states is saved with DCP through :class:`~tiercheck.integrations.dcp.TierWriter`
(one store per rank under ``sharded_root``, default ``ROOT-sharded``; DCP's planner, so a
resume may use another number of ranks), then the rest of Lightning's checkpoint (loops,
callbacks, schedulers, rank 0's random generators) is saved by rank 0 in the store at
``root`` with the key ``tiercheck_dcp`` naming the DCP version, and the pointer is
written. A pointer thus exists only once every rank's shard is committed. Loading reads
the pointer, loads the shards into the strategy's model and optimizers
(:class:`~tiercheck.integrations.dcp.TierReader`), and returns the rest.

``LightningModule.load_from_checkpoint(path)`` reads files with ``torch.load`` itself, not
through the checkpoint IO: use :func:`load` for a pointer file there.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from tiercheck.checkpointer import Checkpointer
from tiercheck.core.rng import rng_state, set_rng_state
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.errors import CheckpointError, ConfigError, NoRestorableVersion
from tiercheck.integrations._pointer import Pointer, read_pointer, write_pointer
from tiercheck.runtime.background import reporting
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import Policy

__all__ = [
    "DCP_KEY",
    "RNG_KEY",
    "TiercheckIO",
    "escape_keys",
    "load",
    "read_pointer",
    "unescape_keys",
]

RNG_KEY = "tiercheck_rng"
"""Key of the random generators' state in a saved checkpoint (removed again on load)."""

DCP_KEY = "tiercheck_dcp"
"""Key, in the checkpoint of a sharded strategy, of the DCP version holding its shards."""


# --- keys ----------------------------------------------------------------------------------
# tiercheck joins keys with "/" and refuses "/" inside one; Lightning's keys may have it
# (a callback's state key holds its monitor, e.g. "val/loss"). Escaping is reversible and
# leaves every key without "%" or "/" as it is.


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F") if key else "%_"


def _unescape(key: str) -> str:
    return "" if key == "%_" else key.replace("%2F", "/").replace("%25", "%")


def escape_keys(obj: Any) -> Any:
    """``obj`` with every str dict key escaped for tiercheck (values are the same objects)."""
    if isinstance(obj, Mapping):
        return {(_escape(k) if isinstance(k, str) else k): escape_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [escape_keys(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(escape_keys(v) for v in obj)
    return obj


def unescape_keys(obj: Any) -> Any:
    """Undo :func:`escape_keys`."""
    if isinstance(obj, Mapping):
        return {
            (_unescape(k) if isinstance(k, str) else k): unescape_keys(v) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [unescape_keys(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(unescape_keys(v) for v in obj)
    return obj


def _saving_rank() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def load(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> dict[str, Any]:
    """The Lightning checkpoint dict that the pointer file at ``path`` names.

    For APIs that read a checkpoint themselves, e.g.
    ``Model.load_from_checkpoint(io.BytesIO(...))`` needs a file: prefer
    ``trainer.fit/validate/test(ckpt_path=path)``, which go through :class:`TiercheckIO`.
    """
    pointer = read_pointer(path)
    if pointer is None:
        raise CheckpointError(f"{path} is not a tiercheck pointer file")
    with Checkpointer(
        pointer.root, read_only=True, allow_pickle=allow_pickle, coordinator=LocalCoordinator()
    ) as store:
        info = store.restore(None, version=pointer.version)
    state: dict[str, Any] = unescape_keys(info.state)
    state.pop(RNG_KEY, None)
    return state


class TiercheckIO(CheckpointIO, Callback):
    """Lightning checkpoints stored by tiercheck (see the module docstring).

    ``root`` is the tiercheck store (created with ``tiers``/``policy`` if new, else as
    configured). ``async_save`` returns after staging instead of after the commit.
    ``rng`` saves and restores every random generator with the checkpoint (needed for a
    bit-identical resume). ``allow_pickle`` lets values msgpack cannot hold (custom objects
    in hyperparameters) be stored with pickle. ``sharded_root`` holds the per-rank stores of
    a sharded strategy's checkpoints (see the module docstring).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        tiers: Sequence[str | TierSpec | tuple[str, str]] | None = None,
        policy: Policy | None = None,
        async_save: bool = False,
        rng: bool = True,
        allow_pickle: bool = False,
        sharded_root: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.root = Path(root).expanduser().resolve()
        self.sharded_root = (
            Path(sharded_root).expanduser().resolve()
            if sharded_root is not None
            else self.root.with_name(f"{self.root.name}-sharded")
        )
        self.async_save = async_save
        self.rng = rng
        self.allow_pickle = allow_pickle
        self._tiers = tiers
        self._policy = policy
        self._store: Checkpointer | None = None
        self._module: Callable[[], Any] | None = None
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._error: BaseException | None = None
        self._sharded: _ShardedRoute | None = None

    # --- the store ---------------------------------------------------------------------

    @property
    def checkpointer(self) -> Checkpointer:
        """The tiercheck store (opened on first use: writable on the saving rank)."""
        with self._lock:
            if self._store is None:
                writable = _saving_rank()
                self._store = Checkpointer(
                    self.root,
                    tiers=self._tiers if writable else None,
                    policy=self._policy if writable else None,
                    read_only=not writable,
                    allow_pickle=self.allow_pickle,
                    coordinator=LocalCoordinator(),
                )
            return self._store

    # --- background pointer writes, in save order -------------------------------------

    def _submit(self, fn: Callable[[], None], what: str) -> None:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercheck-ptl")
        # recorded in the store's failures too: close() raises it if no save or teardown did
        run = reporting(self.checkpointer.failures, what, fn, then=self._failed)
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._writer.submit(run))

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc

    def _raise_failure(self) -> None:
        """Raise the first background failure not raised yet (then close() does not)."""
        with self._lock:
            err, self._error = self._error, None
            store = self._store
        if err is None:
            return
        if store is not None:
            store.failures.take(err)
        raise CheckpointError(f"a background checkpoint save failed: {err}") from err

    def _drain(self) -> None:
        """Wait for queued commits and pointer writes; raise the first failure."""
        for f in self._pending:
            f.exception()
        self._pending = []
        self._raise_failure()

    # --- CheckpointIO ------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"TiercheckIO does not take storage_options (got {storage_options!r}); "
                "configure the store's tiers instead"
            )
        self._raise_failure()
        state = escape_keys(checkpoint)
        if self.rng:
            state[RNG_KEY] = rng_state()
        step = int(checkpoint.get("global_step", 0))
        store = self.checkpointer
        handle = store.save(
            step,
            state,
            metadata={"lightning": {"path": os.fspath(path), "epoch": checkpoint.get("epoch")}},
        )
        assert handle.version is not None
        pointer = Pointer(str(store.root), handle.version, step)
        if not self.async_save:
            handle.wait()
            write_pointer(path, pointer, guard=True)
            return
        handle.wait_staged()

        def commit_then_point() -> None:
            handle.wait()
            write_pointer(path, pointer, guard=True)

        self._submit(commit_then_point, f"the checkpoint of step {step} ({path})")

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        pointer = read_pointer(path)
        if pointer is None:  # a checkpoint Lightning wrote itself
            loaded: dict[str, Any] = TorchCheckpointIO().load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
            return loaded
        self._drain()
        store = self.checkpointer
        other = Path(pointer.root).resolve() != store.root
        if other:
            store = Checkpointer(
                pointer.root,
                read_only=True,
                allow_pickle=self.allow_pickle,
                coordinator=LocalCoordinator(),
            )
        module = self._module() if self._module is not None else None
        target: dict[str, Any] = {}
        if module is not None:
            target["state_dict"] = escape_keys(module.state_dict())
        try:
            info = store.restore(target, version=pointer.version, strict=False)
        except NoRestorableVersion as exc:
            raise NoRestorableVersion(
                f"{path} names version {pointer.version} (step {pointer.step}) of {pointer.root}, "
                f"which cannot be restored: {exc}. Retention may have dropped it: keep more "
                "versions (docs/configuration.md) or resume from a newer checkpoint"
            ) from exc
        finally:
            if other:
                store.close()
        state: dict[str, Any] = unescape_keys(info.state)
        saved_rng = state.pop(RNG_KEY, None)
        if self.rng and saved_rng is not None:
            set_rng_state(saved_rng)
        return state

    def remove_checkpoint(self, path: Any) -> None:
        def remove() -> None:
            fs, fs_path = fsspec.core.url_to_fs(os.fspath(path))
            if fs.exists(fs_path):
                fs.rm(fs_path)

        if self.async_save:
            self._submit(remove, f"removing {path}")  # after the pointer writes queued before it
        else:
            remove()

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """Finish background saves, close the store (also Lightning's Callback.teardown)."""
        try:
            self._drain()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            with self._lock:
                store, self._store = self._store, None
                sharded, self._sharded = self._sharded, None
            if sharded is not None:
                sharded.close()
            if store is not None:
                store.close()

    # --- Callback ------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Install this IO on the trainer's strategy; remember the module to load into. A
        strategy that saves through DCP has its saves and loads routed here too."""
        strategy = trainer.strategy
        strategy.checkpoint_io = self
        self._module = weakref.ref(pl_module)
        if _saves_through_dcp(strategy) and self._sharded is None:
            self._sharded = _ShardedRoute(self, strategy)


def _saves_through_dcp(strategy: Any) -> bool:
    """Whether Lightning's ``strategy`` writes its checkpoints with DCP itself (raises
    :class:`ConfigError` for one tiercheck does not route)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "sharded":
        raise ConfigError(
            "TiercheckIO does not store the sharded checkpoints of FSDPStrategy (FSDP1), "
            "which Lightning writes with DCP itself: use FSDPStrategy(state_dict_type='full') "
            "(saved through TiercheckIO on rank 0) or ModelParallelStrategy (FSDP2, routed "
            "through tiercheck)"
        )
    return isinstance(strategy, ModelParallelStrategy) and bool(
        getattr(strategy, "_save_distributed_checkpoint", False)
    )


class _ShardedRoute:
    """A DCP-saving strategy's ``save_checkpoint`` / ``load_checkpoint``, on tiercheck.

    Installed on the strategy object (the methods Lightning's trainer calls); ``close``
    puts the strategy's own methods back.
    """

    def __init__(self, io: TiercheckIO, strategy: Any) -> None:
        from tiercheck.integrations.dcp import TierWriter

        self.io = io
        self.strategy = strategy
        self.writer = TierWriter(io.sharded_root, tiers=io._tiers, policy=io._policy)
        strategy.save_checkpoint = self.save_checkpoint
        strategy.load_checkpoint = self.load_checkpoint

    def close(self) -> None:
        for name in ("save_checkpoint", "load_checkpoint"):
            vars(self.strategy).pop(name, None)
        self.writer.close()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        if storage_options is not None:
            raise TypeError(
                f"TiercheckIO does not take storage_options (got {storage_options!r}); "
                "configure the store's tiers instead"
            )
        path = self.strategy.broadcast(filepath)
        shards = {"state_dict": checkpoint.pop("state_dict")}
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            shards[f"optimizer_{i}"] = optim_state
        step = int(checkpoint.get("global_step", 0))
        save(shards, storage_writer=self.writer, checkpoint_id=f"step:{step}")
        if self.strategy.is_global_zero:
            assert self.writer.last_version is not None  # DCP's coordinator is rank 0
            checkpoint[DCP_KEY] = {
                "root": str(self.io.sharded_root),
                "version": self.writer.last_version,
            }
            self.io.save_checkpoint(checkpoint, path)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_loader import load

        from tiercheck.integrations.dcp import TierReader

        path = self.strategy.broadcast(checkpoint_path)
        checkpoint = self.io.load_checkpoint(path, weights_only=weights_only)
        where = checkpoint.pop(DCP_KEY, None)
        if not isinstance(where, dict) or not isinstance(where.get("version"), int):
            raise CheckpointError(
                f"{path} is not a checkpoint of a sharded strategy saved by TiercheckIO "
                f"(no {DCP_KEY!r} naming its shards)"
            )
        module = self.strategy.model
        version = f"version:{where['version']}"
        reader = TierReader(str(where["root"]))
        model_state = {"state_dict": get_model_state_dict(module)}
        load(model_state, storage_reader=reader, checkpoint_id=version)
        strict = self.strategy.lightning_module.strict_loading
        module.load_state_dict(model_state["state_dict"], strict=strict)
        for i, optim in enumerate(self.strategy.optimizers):
            key = f"optimizer_{i}"
            optim_state = {key: get_optimizer_state_dict(module, optim)}
            load(optim_state, storage_reader=reader, checkpoint_id=version)
            set_optimizer_state_dict(
                module, optim, optim_state_dict=optim_state[key], options=StateDictOptions()
            )
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        return checkpoint
