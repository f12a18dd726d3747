"""The opened tiers of a store, with their names, specs and placement, in restore order.

Each tier is opened inside the wrappers its options ask for (retry with backoff, a
connection limit: :mod:`tiercheck.backends.resilience`), so every caller (save, migration,
restore, GC, the CLI) goes through them."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiercheck.backends.base import StoreOwner, Tier
from tiercheck.backends.registry import open_tier
from tiercheck.backends.resilience import open_wrapped, split_options, wrapping
from tiercheck.core.sizes import format_size
from tiercheck.errors import (
    ConfigError,
    ForeignTier,
    InvalidURL,
    TierError,
    TierLost,
    TierUnavailable,
)
from tiercheck.store import identity
from tiercheck.store.config import StoreConfig, TierSpec, resolve_references, without_userinfo
from tiercheck.store.policy import Policy, TierPolicy

__all__ = ["TierSet", "TierSlot"]

log = logging.getLogger(__name__)


@dataclass
class TierSlot:
    """One configured tier. ``tier`` is None when it could not be opened (``error`` says
    why; ``unreachable``: because it could not be reached, ``TierUnavailable``: it may
    hold what it held; ``lost``: because its content is gone, ``TierLost``, as a shm
    segment after a reboot: it holds nothing)."""

    spec: TierSpec
    tier: Tier | None
    policy: TierPolicy | None
    error: str | None = None
    unreachable: bool = False
    lost: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def speed_rank(self) -> int:
        return self.tier.capabilities.speed_rank if self.tier is not None else 1 << 30


class TierSet:
    """Opens every tier of a store; a tier that fails to open is kept as unavailable,
    except that a malformed URL or unknown scheme is a configuration error and raises."""

    def __init__(
        self,
        specs: Sequence[TierSpec],
        policy: Policy,
        *,
        read_only: bool = False,
        owner: str | os.PathLike[str] | None = None,
        created: bool = False,
    ):
        """``owner``: the root of the store these tiers belong to. ``{root}`` in a spec
        stands for it; each tier's owner record is checked against the store
        (:mod:`tiercheck.store.identity`: a tier of another store raises ``ForeignTier``
        when writing, and is unavailable when reading) and, when writing, records it, so
        that its node memory can be reclaimed once the store is deleted; orphans of
        deleted stores on this node are warned about. ``created``: this open made the
        store's file, and with it the store's id."""
        self.slots: list[TierSlot] = []
        root = Path(owner) if owner is not None else None
        self._root = root
        self._policy = policy
        self._read_only = read_only
        self._lock = threading.Lock()  # a tier opened again (reopen) against close()
        self._closed = False
        #: the store's id (None: no owner, or an older store opened read-only)
        self.store_id = (
            identity.open_identity(root, read_only=read_only) if root is not None else None
        )
        #: the store's id was drawn by this open: no tier this open could not read holds
        #: a version of it (False once a tier gave the store back an id it had before)
        self.created = created and self.store_id is not None
        try:
            resolved = [identity.resolve_spec(s, root, self.store_id) for s in specs]
            self._open_all(resolved, policy)
            owners: dict[str, StoreOwner | None] = {}
            if root is not None and self.store_id is not None and not read_only:
                owners = self._owners()
                old = identity.recreated_id(owners.values(), self.store_id, root)
                if old is not None:
                    self.store_id = identity.take_back_id(root, old, self.store_id)
                    self.created = False
                    # a tier shared by stores is opened in a namespace named by the id
                    again = [identity.resolve_spec(s, root, self.store_id) for s in specs]
                    if again != resolved:
                        self._close_tiers()
                        self.slots, resolved, owners = [], again, {}
                        self._open_all(resolved, policy)
            if root is not None and self.store_id is not None:
                self._claim(root, self.store_id, read_only, owners)
        except BaseException:
            self.close(unmake=created)  # the tiers opened before the one that failed
            raise
        specs = resolved
        self._ensure_a_sync_tier(policy, writing=not read_only)
        if owner is not None and not read_only:
            self._bind(os.fspath(owner), specs)

    def _open_all(self, specs: Sequence[TierSpec], policy: Policy) -> None:
        for spec in specs:
            try:
                # secrets referenced as {env = NAME} / {file = PATH} are read now
                options = resolve_references(spec.options, tier=spec.name)
            except ConfigError as exc:
                log.warning(
                    "tier %s (%s) is unavailable: %s", spec.name, without_userinfo(spec.url), exc
                )
                self.slots.append(TierSlot(spec, None, None, str(exc)))
                continue
            try:
                tier = self._open_one(spec, options)
            except InvalidURL:
                raise
            except (TierError, OSError) as exc:
                log.warning(
                    "tier %s (%s) is unavailable: %s", spec.name, without_userinfo(spec.url), exc
                )
                down, gone = isinstance(exc, TierUnavailable), isinstance(exc, TierLost)
                self.slots.append(TierSlot(spec, None, None, str(exc), down, gone))
                continue
            self.slots.append(TierSlot(spec, tier, policy.for_tier(spec.name, tier.capabilities)))

    def _open_one(self, spec: TierSpec, options: dict[str, Any]) -> Tier:
        """Open ``spec``'s tier with ``options`` (its secrets read) inside the wrappers they
        ask for; bad wrapper options are a ``ConfigError`` before anything opens."""
        options, wrappers = split_options(options)
        shown = without_userinfo(spec.url)  # the wrappers name it in their errors
        wrapping(shown, wrappers)
        if self._read_only:
            options["read_only"] = True
        return open_wrapped(shown, wrappers, functools.partial(open_tier, spec.url, **options))

    def reopen(self, slot: TierSlot) -> bool:
        """Open ``slot``'s tier, which could not be reached when the store was opened, as
        the open would have: its owner record checked and, writing, this store recorded in
        it. True if the slot holds it now; False if it still cannot be opened (``error``
        says why). A tier of another store stays out (``ForeignTier`` is logged)."""
        spec = slot.spec
        try:
            tier = self._open_one(spec, resolve_references(spec.options, tier=spec.name))
        except (TierError, OSError, ConfigError) as exc:
            slot.error = str(exc)
            return False
        try:
            if self._root is not None and self.store_id is not None:
                identity.claim(
                    tier, spec, self.store_id, self._root, read_only=self._read_only, owner="unread"
                )
                if not self._read_only:
                    tier.bind_store(os.fspath(self._root))
        except (TierError, ConfigError) as exc:
            tier.close()
            slot.error = f"owner record: {exc}"
            if isinstance(exc, ForeignTier):
                log.error("tier %s is not opened again: %s", slot.name, exc)
                slot.unreachable = False  # not down: another store's, for good
            return False
        with self._lock:
            if self._closed:
                tier.close()
                return False
            slot.policy = self._policy.for_tier(spec.name, tier.capabilities)
            slot.tier, slot.error, slot.unreachable = tier, None, False
        return True

    def _owners(self) -> dict[str, StoreOwner | None]:
        """The owner record of every open tier that can be read now, by tier name
        (:meth:`_claim` reads the others again, and reports them)."""
        out: dict[str, StoreOwner | None] = {}
        for slot in self.open():
            assert slot.tier is not None
            try:
                out[slot.name] = slot.tier.read_owner()
            except TierError:
                continue
        return out

    def _claim(
        self, root: Path, store_id: str, read_only: bool, owners: dict[str, StoreOwner | None]
    ) -> None:
        """Check every open tier's owner record (``owners``: those read already) and,
        writing, record this store."""
        for slot in self.open():
            assert slot.tier is not None
            try:
                identity.claim(
                    slot.tier,
                    slot.spec,
                    store_id,
                    root,
                    read_only=read_only,
                    owner=owners.get(slot.name, "unread"),
                )
            except ForeignTier as exc:
                if not read_only:
                    raise
                # reading: that store's versions are not this one's; the others still are
                log.warning("tier %s is unavailable: %s", slot.name, exc)
                slot.tier.close()
                slot.tier, slot.policy, slot.error = None, None, str(exc)
            except TierError as exc:
                # whose it is cannot be told now: neither written nor read this open
                log.warning("tier %s is unavailable: its owner record: %s", slot.name, exc)
                slot.tier.close()
                slot.tier, slot.policy, slot.error = None, None, f"owner record: {exc}"
                slot.unreachable = isinstance(exc, TierUnavailable)

    def _bind(self, owner: str, specs: Sequence[TierSpec]) -> None:
        from tiercheck.store import lifecycle

        for slot in self.open():
            assert slot.tier is not None
            try:
                slot.tier.bind_store(owner)
            except TierError as exc:  # ownership helps cleanup; it must not stop a save
                log.warning("tier %s could not record its owner: %s", slot.name, exc)
        lifecycle.warn_orphans(lifecycle.store_shm_roots(StoreConfig(tuple(specs), Policy())))

    def _ensure_a_sync_tier(self, policy: Policy, *, writing: bool) -> None:
        """A save commits at its synchronous tiers: if the defaults left none (a store of
        remote tiers only), the fastest tier without an explicit policy becomes one; if
        every tier is explicitly asynchronous, no save could ever commit (ConfigError when
        opened for writing)."""
        open_ = self.by_speed()
        if any(s.policy is not None and s.policy.mode == "sync" for s in open_):
            return
        for slot in open_:
            if slot.policy is not None and slot.name not in policy.tiers:
                slot.policy = replace(slot.policy, mode="sync", every=None)
                log.info("no synchronous tier by default: %s is made one", slot.name)
                return
        if writing and self.slots and all(s.policy is not None for s in self.slots):
            self.close()
            raise ConfigError(
                "every tier is asynchronous, so no save could ever commit: give one tier "
                "mode='sync' (asynchronous tiers receive committed versions by migration)"
            )

    def __iter__(self) -> Iterator[TierSlot]:
        return iter(self.slots)

    def open(self) -> list[TierSlot]:
        """Slots whose tier is open."""
        return [s for s in self.slots if s.tier is not None]

    def by_speed(self) -> list[TierSlot]:
        return sorted(self.open(), key=lambda s: s.speed_rank)

    def get(self, name: str) -> TierSlot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(name)

    def tiers(self) -> dict[str, Tier]:
        return {s.name: s.tier for s in self.slots if s.tier is not None}

    def preallocate(self, sizes: Sequence[int], skip: Sequence[Tier] = ()) -> None:
        """Ready every writable tier of this process for blobs of ``sizes``
        (``Tier.preallocate``: shm writes their pages into its pool within its budget,
        LMDB brings the pages it will write into the page cache). Called at
        ``Checkpointer.prepare`` with the blobs of the first two versions, so that
        neither writes into fresh pages while the trainer runs. A tier that fails is
        logged: a save never depends on it."""
        for slot in self.open():
            tier = slot.tier
            if tier is None or tier.read_only or tier.capabilities.shared:
                continue
            if any(tier is other for other in skip):  # its pages are ready otherwise
                continue
            try:
                ready = tier.preallocate(sizes)
            except TierError as exc:
                log.warning("could not preallocate pages in tier %s: %s", slot.name, exc)
                continue
            if ready:
                log.info(
                    "tier %s: %s of pages ready for the first saves", slot.name, format_size(ready)
                )

    def close(self, *, unmake: bool = False) -> None:
        """Close every tier; ``unmake``: the open of a new store failed, so each tier also
        removes the storage its open created (:meth:`~tiercheck.backends.base.Tier.unmake`:
        an shm segment nothing would ever free)."""
        with self._lock:
            self._closed = True
        self._close_tiers(unmake=unmake)

    def _close_tiers(self, *, unmake: bool = False) -> None:
        for s in self.slots:
            if s.tier is not None:
                try:
                    s.tier.close()
                    if unmake:
                        s.tier.unmake(self.store_id)
                except Exception as exc:  # closing must not mask the caller's outcome
                    log.warning("closing tier %s failed: %s", s.name, exc)
