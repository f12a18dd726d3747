"""TierWriter: DCP's StorageWriter on tiercheck (see the package docstring)."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiercheck.checkpointer import Checkpointer
from tiercheck.errors import (
    CheckpointError,
    ConfigError,
    UnsupportedValue,
)
from tiercheck.integrations.dcp import stores
from tiercheck.integrations.dcp.hold import (
    HoldingCoordinator,
    finished_shards,
    previous_shard,
    recorded_hold,
)
from tiercheck.integrations.dcp.ids import (
    ITEMS,
    METADATA,
    METADATA_VERSION,
    CheckpointRef,
    Location,
    _done,
    _valid_id,
    bytes_entry,
    item_key,
    parse_checkpoint_id,
    rank_root,
)
from tiercheck.integrations.dcp.metadata import encode_metadata
from tiercheck.store.catalog import Catalog
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import Policy

TiersArg = (
    Sequence[str | TierSpec | tuple[str, str]]
    | Callable[[Path], Sequence[str | TierSpec | tuple[str, str]]]
    | None
)


# --- the writer -------------------------------------------------------------------------


def _dist_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass(frozen=True)
class _PlanInfo:
    """What the writer attaches to each rank's SavePlan (``SavePlan.storage_data``)."""

    rank: int
    root: str
    step: int | None = None
    save: str = ""
    """The save the plan was made for (a plan cached at an earlier save carries that one)."""
    hold: tuple[int, ...] | None = None
    """The rank's version in the newest finished checkpoint, which it holds while it saves
    (:mod:`~tiercheck.integrations.dcp.hold`); None: the coordinator could not say."""


class TierWriter(StorageWriter):
    """A DCP :class:`StorageWriter` that saves each checkpoint as a tiercheck version.

    ``target`` is a root directory (rank ``r`` uses the store ``root/rank{r}``, created with
    ``tiers``/``policy`` if new; ``tiers`` may be a function of that store root) or an open
    :class:`Checkpointer` for this rank. ``checkpoint_id`` is as described in the package
    docstring.

    A writer per save and one writer for every save are the same: the writers of a process
    share its open store at a root (:mod:`~tiercheck.integrations.dcp.stores`), which stays
    open between saves, so unchanged chunks are deduplicated and most versions are diffs.
    When a save returns, its version is committed in the synchronous tiers, and the
    retention it triggered and its migrations to the store's asynchronous tiers are done:
    nothing goes on writing. ``background=True`` lets the migrations run on after the save
    instead (:meth:`wait_migrations` waits for them; :meth:`close` too). ``close()`` closes
    this process's stores under the root (waiting for their migrations); a later save opens
    them again. A store given as a :class:`Checkpointer` is the caller's to close.

    Each rank's store holds its shard of the newest finished checkpoint until a newer one is
    finished (:mod:`~tiercheck.integrations.dcp.hold`): every save of another rank than the
    coordinator sets :meth:`Checkpointer.hold` of its store, a given one's too.
    """

    def __init__(
        self,
        target: Checkpointer | str | os.PathLike[str],
        *,
        tiers: TiersArg = None,
        policy: Policy | None = None,
        checkpoint_id: str | int | None = None,
        background: bool = False,
    ) -> None:
        super().__init__()
        self._root: Path | None = None
        self._ckpt: Checkpointer | None = None
        self._given: Checkpointer | None = None
        self._ephemeral = False
        self.background = background
        if isinstance(target, Checkpointer):
            self._ckpt = self._given = target
        else:
            self._root = Path(target).expanduser().resolve()
        self._tiers = tiers
        self._policy = policy
        self._ref = parse_checkpoint_id(checkpoint_id)
        self.checkpoint_id: str | int | None = checkpoint_id
        self._named = checkpoint_id is not None  # the next save's id was given (reset)
        self._lock = threading.Lock()
        self._rank = 0
        self._is_coordinator = True
        self._step: int | None = None
        self._planned: int | None = None  # the step prepare_global_plan chose for this save
        self._save = ""  # this save's id in the plans (prepare_local_plan)
        self._ranks: dict[int, str] = {}
        self._pending: dict[str, Any] | None = None
        # the version id of the last checkpoint this writer committed as DCP's coordinator
        self.last_version: int | None = None

    # pickling (the process executor of dcp.async_save sends the writer to another process)
    def __getstate__(self) -> dict[str, Any]:
        if self._root is None:
            raise CheckpointError(
                "a TierWriter built on a Checkpointer cannot be sent to another process; "
                "build it from the store root to use async_save's process executor"
            )
        if callable(self._tiers):
            raise CheckpointError(
                "a TierWriter with a tiers function cannot be sent to another process; "
                "create the stores first (their tiercheck.toml is then reused)"
            )
        # handed over: the other process opens the stores this one may hold open
        stores.close_under(self._root)
        state = dict(self.__dict__)
        state["_ckpt"] = None
        state["_ephemeral"] = True
        state["_lock"] = None
        state["_pending"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def checkpointer(self) -> Checkpointer | None:
        """This rank's store: the one given, or this process's open store at the rank root
        (None before the first save and after :meth:`close`)."""
        if self._given is not None or self._root is None:
            return self._given
        return stores.peek(rank_root(self._root, self._rank))

    def wait_migrations(self, timeout: float | None = None) -> bool:
        """Block until the migrations of this writer's store(s) in this process have
        settled (see :meth:`Checkpointer.wait_migrations`); True if none is pending."""
        if self._given is not None:
            return self._given.wait_migrations(timeout)
        if self._root is None:
            return True
        return all(c.wait_migrations(timeout) for c in stores.open_stores(self._root))

    def close(self) -> None:
        """Close this process's stores under the root (every writer's of this process on
        it), once their saves and migrations are done; a later save opens them again. A
        store given as a :class:`Checkpointer` is left open."""
        if self._given is None and self._root is not None:
            self._ckpt = None
            stores.close_under(self._root)

    def __enter__(self) -> TierWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, rank: int, *, fresh: bool = False) -> Checkpointer:
        """This rank's store for the save in progress (looked up again when ``fresh``: at
        the start of each save)."""
        if self._ckpt is not None and not fresh:
            return self._ckpt
        if self._given is not None:
            self._ckpt = self._given
            return self._given
        assert self._root is not None
        root = rank_root(self._root, rank)

        def opener() -> Checkpointer:
            tiers = self._tiers(root) if callable(self._tiers) else self._tiers
            if tiers is not None and (root / "tiercheck.toml").exists():
                tiers = None  # an existing store keeps its configuration
            # the coordinator's own versions are the finished checkpoints: it holds none
            held = None if self._is_coordinator else recorded_hold(root)
            root.mkdir(parents=True, exist_ok=True)
            # a one-rank store: DCP's own collectives order the ranks (package docstring)
            return Checkpointer(
                root, tiers=tiers, policy=self._policy, coordinator=HoldingCoordinator(held)
            )

        self._ckpt = stores.shared_store(root, opener)
        return self._ckpt

    def _settle(self, ckpt: Checkpointer) -> None:
        """After a commit: wait for the retention it triggered and, unless ``background``,
        for its migrations, so that nothing writes in the store once the save returns."""
        ckpt.flush()
        if not self.background:
            ckpt.wait_migrations()

    def _end(self) -> None:
        self._pending = None
        self._ref = CheckpointRef()
        self.checkpoint_id = None
        self._step = None
        self._planned = None
        if self._given is None:
            self._ckpt = None
        if self._ephemeral:
            self.close()

    # --- StorageWriter ------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if isinstance(checkpoint_id, os.PathLike):
            raise ConfigError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} is a path; tiercheck names "
                "checkpoints by step ('step:N') - pass the root to TierWriter instead"
            )
        self._ref = parse_checkpoint_id(checkpoint_id)
        if self._ref.version is not None:
            raise ConfigError(
                "a checkpoint cannot be saved as 'version:N': the store assigns version ids; "
                "name it by step ('step:N')"
            )
        self.checkpoint_id = checkpoint_id
        self._named = True  # for the save set up next (set_up_storage_writer)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "TierWriter needs DCP's collectives (use_collectives=True): the coordinator "
                "records every rank's shard in one checkpoint"
            )
        rank = kwargs.get("rank")
        self._rank = int(rank) if isinstance(rank, int) else _dist_rank()
        self._is_coordinator = is_coordinator
        self._pending = None
        self._step = self._planned = None
        if not self._named:  # DCP resets only for a save given a checkpoint_id: this one
            self._ref = CheckpointRef()  # was not, whatever an earlier failed save named
            self.checkpoint_id = None
        self._named = False
        self._open(self._rank, fresh=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        ckpt = self._open(self._rank)
        self._save = uuid.uuid4().hex
        info = _PlanInfo(self._rank, str(ckpt.root), save=self._save)
        return dataclasses.replace(plan, storage_data=info)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        ckpt = self._open(self._rank)
        catalog = ckpt.refresh()
        if self._ref.step is not None:
            step = self._ref.step
        else:
            steps = [i.step for i in catalog.versions.values()]
            step = max(steps) + 1 if steps else 0
        finished = finished_shards(catalog)
        out = []
        self._ranks = {}
        self._planned = step
        for i, plan in enumerate(plans):
            info = plan.storage_data
            if isinstance(info, _PlanInfo):
                self._ranks[info.rank] = info.root
                hold = None
                if finished is not None:
                    hold = (finished[info.rank],) if info.rank in finished else ()
                info = dataclasses.replace(info, step=step, hold=hold)
            elif not plan.usable:
                # enable_plan_caching: the rank's plan did not change, and it writes with the
                # plan it cached at an earlier save (its own TierWriter data included)
                info = _PlanInfo(i, "", step)
            else:
                raise CheckpointError(
                    f"rank {i}'s save plan carries no TierWriter data; every rank must "
                    "save with a TierWriter"
                )
            out.append(dataclasses.replace(plan, storage_data=info))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo) or info.step is None:
            raise CheckpointError("write_data got a plan that prepare_global_plan did not see")
        ckpt = self._open(self._rank)
        root = str(ckpt.root)
        items: dict[str, Any] = {}
        results: list[WriteResult] = []
        for item in sorted(plan.items, key=lambda it: item_key(it.index)):
            key, value, nbytes = self._resolve(item, planner)
            items[key] = value
            loc = Location(self._rank, None, key, nbytes, root)
            results.append(WriteResult(item.index, nbytes, loc))
        # a plan cached at an earlier save (enable_plan_caching) carries that save's step:
        # the coordinator's own planning, or the checkpoint_id given, names this one; the
        # coordinator's choice does not reach another rank then, which takes the step after
        # its store's newest (the coordinator's, as long as every save reached every rank)
        fresh = info.save == self._save
        catalog: Catalog | None = None
        if self._ref.step is not None:
            step = self._ref.step
        elif fresh or self._is_coordinator:
            step = info.step
        else:
            catalog = ckpt.refresh()
            steps = [i.step for i in catalog.versions.values()]
            step = max(steps) + 1 if steps else 0
        if self._is_coordinator:
            # saved in finish(), together with the metadata: that version is the checkpoint
            self._pending = items
            self._step = self._planned if self._planned is not None else step
            return _done(results)
        try:
            version = None
            # until a newer checkpoint is finished, this rank's shard of the newest one
            # stays, whatever this save lets retention drop (module hold)
            hold = info.hold if fresh else None
            if hold is None:  # the coordinator's word did not reach this rank
                hold = previous_shard(ckpt.refresh() if catalog is None else catalog)
            ckpt.hold(hold)
            if items:
                mark = {**self._mark(False), "hold": list(hold)}
                handle = ckpt.save(step, {ITEMS: items}, metadata={"dcp": mark})
                version = handle.wait().version
                self._settle(ckpt)
        except BaseException:
            self._end()
            raise
        self._end()
        return _done(
            [
                dataclasses.replace(
                    r, storage_data=dataclasses.replace(r.storage_data, version=version)
                )
                for r in results
            ]
        )

    def _mark(self, coordinator: bool) -> dict[str, Any]:
        return {"format": METADATA_VERSION, "rank": self._rank, "coordinator": coordinator}

    @staticmethod
    def _resolve(item: WriteItem, planner: SavePlanner) -> tuple[str, Any, int]:
        key = item_key(item.index)
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise UnsupportedValue(
                    f"DCP resolved a BYTE_IO item to {type(data).__qualname__}", key=item.index.fqn
                )
            raw = data.getvalue()
            return key, bytes_entry(raw), len(raw)
        if not isinstance(data, torch.Tensor):
            raise UnsupportedValue(
                f"DCP resolved a tensor item to {type(data).__qualname__}", key=item.index.fqn
            )
        t = data.detach()
        if type(t) is not torch.Tensor:
            raise UnsupportedValue(
                f"DCP resolved a tensor item to a {type(t).__qualname__}; the planner must "
                "resolve to plain (local) tensors",
                key=item.index.fqn,
            )
        return key, t, t.numel() * t.element_size()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            ckpt = self._open(self._rank)
            storage: dict[MetadataIndex, Location] = {}
            versions: dict[int, int | None] = {}
            roots = {r: root for r, root in self._ranks.items() if root}
            for rank_results in results:
                for wr in rank_results:
                    loc = wr.storage_data
                    if not isinstance(loc, Location):
                        raise CheckpointError(
                            f"a rank reported a write of {wr.index} without a location"
                        )
                    storage[wr.index] = loc
                    if loc.root:
                        roots[loc.rank] = loc.root
                    if loc.rank != self._rank:
                        versions[loc.rank] = loc.version
            metadata.storage_data = storage
            roots[self._rank] = str(ckpt.root)
            ranks = {r: (versions.get(r), root) for r, root in roots.items()}
            encoded = encode_metadata(metadata, ranks=ranks)
            if self._step is None or self._pending is None:
                raise CheckpointError("finish was called before this coordinator's write_data")
            state: dict[str, Any] = {METADATA: bytes_entry(encoded)}
            if self._pending:
                state[ITEMS] = self._pending
            # each rank's version, which the ranks hold from the next save on (module hold)
            shards = [[r, v] for r, v in sorted(versions.items()) if v is not None]
            mark = {**self._mark(True), "shards": shards}
            handle = ckpt.save(self._step, state, metadata={"dcp": mark})
            handle.wait()
            self.last_version = handle.version
            self._settle(ckpt)
        finally:
            self._end()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return not isinstance(checkpoint_id, os.PathLike) and _valid_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        cid = None if self.checkpoint_id is None else str(self.checkpoint_id)
        return StorageMeta(checkpoint_id=cid, save_id=uuid.uuid4().hex)
