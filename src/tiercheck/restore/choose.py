"""Restore's first step: which version to restore, and what to do when there is none.

:func:`choose_version` picks the newest committed version every needed tier can serve (a
diff only if its base is restorable too), or the one asked for;
:func:`nothing_restorable` says what a restore that found nothing does (None or a typed
error). :class:`~tiercheck.restore.service.RestoreService` runs the restore around them.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercheck.errors import EmptyStore, NoRestorableVersion
from tiercheck.formats.manifest import VersionInfo
from tiercheck.store.catalog import Catalog

__all__ = ["choose_version", "nothing_restorable"]


def nothing_restorable(
    *,
    empty: bool,
    missing_ok: bool,
    last_error: Exception | None,
    world_size: int,
    tiers: Sequence[str] | None = None,
) -> None:
    """What a restore that found no version to load does: return None (nothing restored)
    when the store is ``empty`` (no rank sees any committed version) and the caller said
    ``missing_ok``; raise otherwise. An empty store raises :class:`EmptyStore`, which says
    so and how to start from scratch; a store with versions none of which can be restored
    raises :class:`NoRestorableVersion` with the last error."""
    if empty:
        if missing_ok:
            return
        where = f" in tiers {', '.join(tiers)}" if tiers is not None else ""
        raise EmptyStore(
            f"the store is empty: no version was ever committed{where}, so there is nothing "
            "to restore; on a first launch call restore(state, missing_ok=True), which "
            "returns None when there is nothing to resume from"
        )
    if isinstance(last_error, NoRestorableVersion) and world_size == 1:
        raise last_error
    raise NoRestorableVersion(
        "no version can be restored"
        + (" by every rank" if world_size > 1 else "")
        + (f" (last error: {last_error})" if last_error else "")
    )


def choose_version(
    catalog: Catalog, *, version: int | None = None, step: int | None = None
) -> VersionInfo:
    """The version to restore: the one asked for, or the newest restorable one."""
    versions = catalog.versions
    if version is not None or step is not None:
        if version is not None:
            info = versions.get(version)
            label = f"version {version}"
        else:
            matches = [i for i in versions.values() if i.step == step]
            info = matches[-1] if matches else None
            label = f"step {step}"
        if info is None:
            raise NoRestorableVersion(f"{label} is not a committed version of this store")
        if not catalog.restorable(info.id):
            raise NoRestorableVersion(
                f"{label} is committed but cannot be restored from the reachable tiers "
                f"(held by: {catalog.holders(info.id) or 'none'}; "
                f"unreachable: {sorted(catalog.unreachable) or 'none'})"
            )
        return info
    for vid in sorted(versions, reverse=True):
        if catalog.restorable(vid):
            return versions[vid]
    raise NoRestorableVersion(
        "no restorable version: "
        + (
            "the store has no committed version"
            if not versions
            else f"{len(versions)} committed version(s), none held by a reachable tier"
        )
    )
