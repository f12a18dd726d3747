"""Reading versions next to a writer: resolve them on one view of the history, and read
them again when retention dropped one (or its base) meanwhile (``tiercheck show``,
``diff`` and ``verify`` beside a training job)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from tiercheck.errors import NoRestorableVersion, ReplayError, TierError
from tiercheck.history.versions import Version, parse_version_spec, resolve_version
from tiercheck.history.view import StoreView

__all__ = ["read_versions"]

T = TypeVar("T")


def read_versions(
    store: StoreView[Version],
    specs: Sequence[int | str],
    read: Callable[[list[Version]], T],
    *,
    rank: int | None = None,
    opened: tuple[Sequence[Version], Sequence[Version]] | None = None,
    tries: int = 5,
) -> T:
    """``read(versions)`` of the versions ``specs`` name (see :func:`resolve_version`), for
    ``rank``, all resolved on one view of the history (``opened``: that view and the
    versions of the first try, resolved on it already by the caller).

    Next to a writer (a store open read-only beside a training job), retention may drop a
    version, or the base it needs, while it is read. When ``read`` fails, the logs are
    read again: if a version it read (or its base) was held when it was resolved and no
    tier holds it now, ``latest`` is resolved again on the newer view and read again (up
    to ``tries`` times); a version named by id or step raises
    :class:`~tiercheck.errors.NoRestorableVersion` saying that it was dropped. A failure
    of versions still held is raised as it is: that is damage, not a drop.
    """
    error: Exception | None = None
    for _ in range(tries):
        if opened is None:
            rows = store.history()
            versions = [resolve_version(rows, spec, rank=rank) for spec in specs]
        else:
            (rows, first), opened = opened, None
            versions = list(first)
        try:
            return read(versions)
        except (TierError, NoRestorableVersion, ReplayError) as exc:
            gone = _dropped_since(rows, store.history(), versions)
            if not gone:
                raise
            for v, spec in zip(versions, specs):
                if v.id in gone and parse_version_spec(spec)[0] != "latest":
                    raise NoRestorableVersion(
                        f"version {v.id} (step {v.step}) was dropped by retention while it "
                        "was read (a writer saving to the store keeps only its newest "
                        "versions): pick one `tiercheck ls` lists now"
                    ) from exc
            error = exc
    raise NoRestorableVersion(
        f"the newest version was dropped by retention while it was read, {tries} times in a "
        "row (a writer saving to the store keeps only its newest versions): try again, or "
        "name a version a durable tier keeps (`tiercheck ls`)"
    ) from error


def _dropped_since(
    before: Sequence[Version], after: Sequence[Version], versions: Sequence[Version]
) -> set[int]:
    """The ids among ``versions`` and their bases that some tier held in ``before`` and no
    tier holds in ``after`` (a newer view of the history)."""
    by_id = {v.id: v for v in before}
    needed: set[int] = set()
    for v in versions:
        cur: int | None = v.id
        while cur is not None and cur not in needed:
            needed.add(cur)
            row = by_id.get(cur)
            cur = row.base if row is not None else None
    held_after = {v.id for v in after if v.holders}
    return {i for i in needed if i in by_id and by_id[i].holders and i not in held_after}
