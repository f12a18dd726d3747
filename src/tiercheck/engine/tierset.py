"""The opened tiers of a store, with their names, specs and placement, in restore order."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.engine.config import StoreConfig, TierSpec, resolve_references
from tiercheck.engine.placement import Policy, TierPolicy
from tiercheck.errors import ConfigError, InvalidURL, TierError

__all__ = ["TierSet", "TierSlot"]

log = logging.getLogger("tiercheck")


@dataclass
class TierSlot:
    """One configured tier. ``tier`` is None when it could not be opened (``error`` says why)."""

    spec: TierSpec
    tier: Tier | None
    policy: TierPolicy | None
    error: str | None = None

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
    ):
        """``owner``: the root of the store these tiers belong to; each writable tier is
        told (``Tier.bind_store``) so that its node memory can be reclaimed once the store
        is deleted, and orphans of deleted stores on this node are warned about."""
        self.slots: list[TierSlot] = []
        try:
            self._open_all(specs, policy, read_only)
        except BaseException:
            self.close()  # the tiers opened before the one that failed
            raise
        self._ensure_a_sync_tier(policy, writing=not read_only)
        if owner is not None and not read_only:
            self._bind(os.fspath(owner), specs)

    def _open_all(self, specs: Sequence[TierSpec], policy: Policy, read_only: bool) -> None:
        for spec in specs:
            try:
                # secrets referenced as {env = NAME} / {file = PATH} are read now
                options = resolve_references(spec.options, tier=spec.name)
            except ConfigError as exc:
                log.warning("tier %s (%s) is unavailable: %s", spec.name, spec.url, exc)
                self.slots.append(TierSlot(spec, None, None, str(exc)))
                continue
            if read_only:
                options["read_only"] = True
            try:
                tier = open_tier(spec.url, **options)
            except InvalidURL:
                raise
            except (TierError, OSError) as exc:
                log.warning("tier %s (%s) is unavailable: %s", spec.name, spec.url, exc)
                self.slots.append(TierSlot(spec, None, None, str(exc)))
                continue
            self.slots.append(TierSlot(spec, tier, policy.for_tier(spec.name, tier.capabilities)))

    def _bind(self, owner: str, specs: Sequence[TierSpec]) -> None:
        from tiercheck.engine import lifecycle

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

    def close(self) -> None:
        for s in self.slots:
            if s.tier is not None:
                try:
                    s.tier.close()
                except Exception as exc:  # closing must not mask the caller's outcome
                    log.warning("closing tier %s failed: %s", s.name, exc)
