"""Typed errors.

Every error tiercheck raises on purpose derives from :class:`TiercheckError`. Callers
classify failures by type, never by message: :class:`TierUnavailable` is the only one
worth retrying. Messages say what was wrong (the tier URL, the blob id, the state key)
and what to do about it.
"""

from __future__ import annotations

from tiercheck.core.urls import without_userinfo

__all__ = [
    "AlreadyExists",
    "BlobCorrupt",
    "CheckpointError",
    "CommitAborted",
    "ConfigError",
    "DurabilityError",
    "EmptyStore",
    "ForeignTier",
    "FormatVersionError",
    "Halted",
    "InvalidURL",
    "NoRestorableVersion",
    "NotFound",
    "NotSupported",
    "OverBudget",
    "ReadOnlyTier",
    "ReplayError",
    "ReplayMismatch",
    "ReplayRefused",
    "ReplayRequired",
    "StateError",
    "StoreCopied",
    "StoreLocked",
    "TierError",
    "TierFull",
    "TierLost",
    "TierUnavailable",
    "TiercheckError",
    "UnfinishedWork",
    "UnknownScheme",
    "UnsupportedValue",
    "WaitTimeout",
]


class TiercheckError(Exception):
    """Base class of every error tiercheck raises on purpose."""


# --- tier errors -------------------------------------------------------------------


class TierError(TiercheckError):
    """A tier operation failed. ``url`` names the tier, ``key`` the blob or record."""

    def __init__(self, message: str, *, url: str = "", key: str = "") -> None:
        url = without_userinfo(url)  # an error is shown: never the URL's credentials
        parts = [message]
        if url:
            parts.append(f"tier={url}")
        if key:
            parts.append(f"id={key}")
        super().__init__(" | ".join(parts) if len(parts) > 1 else message)
        self.url = url
        self.key = key


class NotFound(TierError, KeyError):
    """The blob or record does not exist in this tier."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(TierError):
    """A create-if-absent write found the key taken (e.g. two writers on one log)."""


class BlobCorrupt(TierError):
    """Stored bytes are damaged: bad header, truncated payload, or a hash mismatch."""


class TierUnavailable(TierError):
    """The tier cannot be reached right now (dead peer, endpoint down). Retryable."""


class TierLost(TierError):
    """The tier's content is missing or damaged where it should be: an shm segment lost in a
    reboot (opened read-only), an LMDB ``data.mdb`` shorter than its last page or with bad
    meta pages. Not retryable. A store open goes on without the tier (it is listed
    unreachable for this open); nothing re-initialises it silently."""


class NotSupported(TierError):
    """The tier does not support this operation."""


class ReadOnlyTier(NotSupported):
    """A write was asked of a tier opened read-only."""


class TierFull(TierError):
    """The tier has no space left (disk full, memory limit, map size limit)."""


class OverBudget(TierFull):
    """A write would take a memory tier past its byte budget (the tier option ``budget``)
    or past the free space of the memory behind it (/dev/shm, the peer daemon's limit).

    Nothing was written. ``needed`` is the bytes the write asked for, ``held`` the bytes
    the tier holds, ``budget`` its budget (None when the free memory was the limit).
    What to do: drop old versions from the tier (retention ``keep_bases``/``keep_diffs``),
    raise its ``budget``, or free memory on the node.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        key: str = "",
        needed: int = 0,
        held: int = 0,
        budget: int | None = None,
    ) -> None:
        super().__init__(message, url=url, key=key)
        self.needed = needed
        self.held = held
        self.budget = budget


class InvalidURL(TierError, ValueError):
    """A tier URL is malformed or names a location that cannot be used."""


class UnknownScheme(InvalidURL):
    """No tier is registered for the URL's scheme."""


# --- format errors -----------------------------------------------------------------


class FormatVersionError(TiercheckError):
    """Data was written by a newer (or unknown) major format version than this reader."""


# --- state / engine errors ---------------------------------------------------------


class StateError(TiercheckError, ValueError):
    """A state dict is malformed or does not match what is being restored into.

    ``key`` is the flattened path of the offending entry, when there is one.
    """

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


class UnsupportedValue(StateError, TypeError):
    """A leaf of the state dict cannot be stored (e.g. a lambda, an open file)."""


class ConfigError(TiercheckError, ValueError):
    """A store configuration or policy is invalid."""


class StoreLocked(TiercheckError):
    """Another process holds the store root open for writing."""


class ForeignTier(ConfigError):
    """A tier is owned by another store (its owner record names another store id).

    ``tier`` is the tier's URL, ``owner_root`` the root its owner record names and ``root``
    the store that tried to open it. Give the store a tier of its own, or declare the tier
    shared by stores (option ``shared_by_stores = true``: each store keeps its own namespace
    in it).
    """

    def __init__(self, message: str, *, tier: str = "", owner_root: str = "", root: str = ""):
        super().__init__(message)
        self.tier = tier
        self.owner_root = owner_root
        self.root = root


class StoreCopied(ForeignTier):
    """The store at ``root`` is a copy of the store at ``owner_root`` (same store id, and the
    original is still there): it opens read-only until ``tiercheck adopt ROOT`` makes it a
    store of its own."""


class CheckpointError(TiercheckError):
    """A save failed in the background; raised by the handle the save returned."""


class CommitAborted(CheckpointError):
    """The version was aborted (a rank failed to prepare, or a vote said no)."""


class DurabilityError(CheckpointError):
    """A version was committed, but not as durably as the store requires: a ``required``
    tier failed to take it, or no tier that took it survives the failure domain the store
    asks for (``Policy.durability``, ``Policy.migrated_durability``).

    The version stays committed and restorable from ``committed``; ``failed`` maps each
    tier that should have taken it to the cause. ``version`` and ``step`` name the save.
    """

    def __init__(
        self,
        message: str,
        *,
        version: int | None = None,
        step: int | None = None,
        committed: tuple[str, ...] = (),
        failed: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.version = version
        self.step = step
        self.committed = committed
        self.failed = dict(failed or {})


class Halted(CheckpointError):
    """Background work (a save, a migration, maintenance) was stopped by ``close()`` before
    it started its next call to a tier. Nothing it had not committed is committed; a save
    or migration stopped so is listed by the ``UnfinishedWork`` that ``close()`` raises."""


class UnfinishedWork(CheckpointError):
    """``close()`` found work it could not finish: migrations still pending, saves that
    failed without anyone having seen their error, a background failure, or a background
    thread still inside a tier call at its timeout.

    ``migrations`` lists ``(version, tier, why)``, ``saves`` ``(step, version, error)``,
    ``background`` other failures, ``running`` the work still in a tier call (halted: it
    starts no other; the tiers are closed and the store lock released when it ends, see
    ``Checkpointer.wait_closed``). The store is closed all the same; what was committed
    stays committed. ``close(abandon=True)`` logs these instead of raising.
    """

    def __init__(
        self,
        message: str,
        *,
        migrations: tuple[tuple[int, str, str], ...] = (),
        saves: tuple[tuple[int, int | None, str], ...] = (),
        background: tuple[str, ...] = (),
        running: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.migrations = migrations
        self.saves = saves
        self.background = background
        self.running = running


class WaitTimeout(CheckpointError, TimeoutError):
    """A wait on a save (``wait_staged``, ``wait``, ``wait_migrated``) ran out of time.
    The save goes on; wait again, or let ``close()`` report it."""


class NoRestorableVersion(TiercheckError, LookupError):
    """No version (or not the one asked for) can be restored from the surviving tiers."""


class EmptyStore(NoRestorableVersion):
    """The store holds no version at all (none committed in any tier read): a first
    launch. ``restore(state, missing_ok=True)`` returns None instead of raising it."""


# --- update-log replay ---------------------------------------------------------------


class ReplayError(TiercheckError):
    """A log version could not be replayed into the state it must reproduce."""


class ReplayRequired(ReplayError):
    """The version asked for is a log version, and what was asked (a read of a replayed
    entry, a diff, an export) needs its replay, which cannot be done here without the
    training script: the logged optimizer cannot be rebuilt here (not ``torch.optim``,
    another torch version or device type), or replaying it here does not reproduce the
    fingerprints recorded at save. Restore the version into the guarded optimizer of the
    training script (``ckpt.guard(optimizer); ckpt.restore(state)``), or read its base.
    ``version`` is the log version, ``base`` the full version it replays from."""

    def __init__(self, message: str, *, version: int, base: int | None) -> None:
        super().__init__(message)
        self.version = version
        self.base = base


class ReplayRefused(ReplayError):
    """The optimizer differs from the one that wrote the log (class, implementation flags
    such as foreach/fused/capturable, device type, torch version, parameters): replaying
    would not be exact, so nothing was changed. ``differences`` lists what differs."""

    def __init__(self, message: str, *, differences: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.differences = differences


class ReplayMismatch(ReplayError):
    """The replay ran but did not reproduce the saved state: the fingerprints of
    ``tensors`` differ (a parameter edited outside ``optimizer.step()``, an EMA, a
    different kernel). The optimizer's state is then not the saved one: restore a full
    version into it."""

    def __init__(self, message: str, *, tensors: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tensors = tensors
