"""The rank stores :class:`~tiercheck.integrations.dcp.TierWriter` writes to, shared within a
process.

DCP's storage protocol has no close, and its idiom is a new writer per save
(``dcp.save(sd, storage_writer=TierWriter(root))``). A store root can be open for writing
once at a time (:class:`~tiercheck.store.leases.StoreLock`), so every writer of this process
on one rank root uses the same open :class:`~tiercheck.Checkpointer`: a later writer
continues where the earlier one left off (its versions are diffs against the same base, its
chunks deduplicated), and whether an earlier writer was garbage-collected does not matter.

A store stays open after a save, for the next one, until:

- a writer on its root is closed (:meth:`TierWriter.close`), or its root is sent to
  another process (``async_save``'s process executor): it is closed, and the next save of
  this process opens it again;
- its directory was removed, moved or replaced: the next save opens a new store at the path
  (the old one is closed without waiting for anything, its files being gone);
- more than :data:`MAX_IDLE` stores are open: the least recently used are closed;
- the interpreter exits (every open :class:`~tiercheck.Checkpointer` is closed then).

This registry is the only process-wide state of the DCP integration; it exists because DCP
gives the writer no other place to keep a store between saves.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tiercheck.checkpointer import Checkpointer

__all__ = ["MAX_IDLE", "close_under", "open_stores", "peek", "shared_store"]

log = logging.getLogger(__name__)

MAX_IDLE = 8
"""Open stores this process keeps for later saves; the least recently used beyond are closed."""


@dataclass
class _Open:
    ckpt: Checkpointer
    fd: int  # the root directory, held open so that its inode cannot be reused

    def current(self, root: Path) -> bool:
        """Whether ``root`` still is the directory this store was opened in."""
        if self.ckpt.closed:
            return False
        try:
            here, now = os.fstat(self.fd), os.stat(root)
        except OSError:
            return False
        return here.st_nlink > 0 and (here.st_dev, here.st_ino) == (now.st_dev, now.st_ino)


_lock = threading.RLock()  # held while a store is opened: two writers never open one twice
_stores: OrderedDict[Path, _Open] = OrderedDict()


def shared_store(root: Path, opener: Callable[[], Checkpointer]) -> Checkpointer:
    """This process's open store at ``root``, opened with ``opener`` if there is none (or
    the one there was opened in a directory since removed or replaced)."""
    dropped: list[_Open] = []
    with _lock:
        entry = _stores.get(root)
        if entry is not None and entry.current(root):
            _stores.move_to_end(root)
            return entry.ckpt
        if entry is not None:
            # closed before the new one opens: a tier may keep one handle per path in a
            # process (LMDB), which must not be the removed directory's
            _close(_stores.pop(root), gone=True)
        ckpt = opener()
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except BaseException:
            ckpt.close()
            raise
        _stores[root] = _Open(ckpt, fd)
        while len(_stores) > MAX_IDLE:
            dropped.append(_stores.popitem(last=False)[1])
    for old in dropped:
        _close(old, gone=not old.current(old.ckpt.root))
    return ckpt


def peek(root: Path) -> Checkpointer | None:
    """This process's open store at ``root``, if it has one."""
    with _lock:
        entry = _stores.get(root)
        return entry.ckpt if entry is not None and not entry.ckpt.closed else None


def open_stores(under: Path) -> list[Checkpointer]:
    """This process's open stores whose root is ``under`` or inside it."""
    with _lock:
        return [
            e.ckpt
            for r, e in _stores.items()
            if (r == under or under in r.parents) and not e.ckpt.closed
        ]


def close_under(under: Path) -> None:
    """Close this process's stores whose root is ``under`` or inside it, waiting for their
    saves and migrations (:meth:`Checkpointer.close`)."""
    with _lock:
        roots = [r for r in _stores if r == under or under in r.parents]
        entries = [_stores.pop(r) for r in roots]
    errors: list[BaseException] = []
    for entry in entries:
        try:
            _close(entry, gone=not entry.current(entry.ckpt.root))
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _close(entry: _Open, *, gone: bool) -> None:
    try:
        if gone:
            # its files were removed or moved away: nothing left to finish there
            try:
                entry.ckpt.close(abandon=True)
            except Exception as exc:
                log.warning("closing the store of a removed DCP root %s: %s", entry.ckpt.root, exc)
        else:
            entry.ckpt.close()
    finally:
        os.close(entry.fd)
