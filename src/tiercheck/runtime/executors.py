"""The thread pools of one open store, made when it opens and shut down when it closes.

Every parallel step of a save, a migration and history's reads runs on one of these (a
restore's reads, verification and copies into the caller's tensors get lanes of the
caller's priority for the call: ``tiercheck-restore``, :mod:`tiercheck.restore.loading`;
the save service keeps its ``tiercheck-tier`` pool):

- ``io`` (``tiercheck-io``): reads, verifies and encodes chunks (restore, the reads of
  history and verify) and places a save's shard in its tiers;
- ``migrating`` (``tiercheck-migrate-io``): a migration's reads, verification and encoding.
  Apart from ``io`` because a migration's threads wait for room in its write window, as
  long as the target (a remote) takes to write: on a shared pool a slow remote held a
  save's placement in shm and LMDB behind it. A quarter of the cores (at least one), at
  the lowest priority (:data:`MIGRATION_NICE`): a migration is the least urgent work of a
  store (its tier takes a base every ``remote_every``), and it moves every byte of a base
  several times (read, verify, pack, write); on two threads at ``nice`` +10 the first
  base's migration slowed a memory-bound trainer's steps by up to 1.4x, on one at +19 by
  1.1x (``benchmarks/trainer_overhead.py``);
- ``writes`` (``tiercheck-write``, :data:`WRITE_WINDOW` threads):
  a migration's writes to its target, overlapped with the encoding of the next chunks;
- ``hashing`` (``tiercheck-hash``): slices of a save's small chunks hashed in parallel
  (:func:`tiercheck.formats.ids.chunk_ids`; blake3 releases the GIL);
- ``logs`` (``tiercheck-log``): every tier's log read at once (:func:`read_catalog
  <tiercheck.store.catalog.read_catalog>`), at open and at each refresh.

The single-threaded services keep their own thread, since they order work: the save
pipeline (:class:`~tiercheck.engine.saving.SaveService`), the migration thread and the
maintenance threads (one per tier: ``tiercheck-maint-<tier>``).

The trainer keeps its CPU: the pools are sized to the cores (at most ``cores`` I/O
threads, ``cores - 1`` hashing threads, at least one each) and every one of their threads
runs at a lower scheduling priority (:func:`lower_priority`, ``nice`` +:data:`NICE`: on
Linux a thread's own). Only the staging copy, which the trainer waits for, keeps the
trainer's priority.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["MIGRATION_NICE", "NICE", "WRITE_WINDOW", "Executors", "lower_priority"]

WRITE_WINDOW = 16  # blobs in flight to a target tier at once, per migration
LOG_READERS = 8  # tiers whose logs are read at once
NICE = 10  # how much lower the background threads run than the trainer
MIGRATION_NICE = 19  # migrations: the lowest priority there is


def lower_priority(steps: int = NICE) -> None:
    """Run the calling thread at a lower priority (``nice`` +``steps``); on Linux
    ``nice`` applies to the calling thread only. Where it cannot, nothing changes."""
    try:
        os.nice(steps)
    except (AttributeError, OSError):
        pass


def lowest_priority() -> None:
    """:func:`lower_priority` by :data:`MIGRATION_NICE`."""
    lower_priority(MIGRATION_NICE)


class _Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose ``shutdown(cancel_futures=True)`` also notifies the
    futures it cancels. CPython's leaves them ``CANCELLED`` without notifying waiters, and
    ``concurrent.futures.wait`` on such a future never returns: a migration waiting for its
    queued writes at close hung forever."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            while True:
                try:
                    item = self._work_queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item.future.cancel():
                    item.future.set_running_or_notify_cancel()
        super().shutdown(wait=wait, cancel_futures=cancel_futures)


@dataclass(frozen=True)
class Executors:
    """The store's pools (module docstring)."""

    io: ThreadPoolExecutor
    migrating: ThreadPoolExecutor
    writes: ThreadPoolExecutor
    hashing: ThreadPoolExecutor
    logs: ThreadPoolExecutor

    @classmethod
    def start(cls, threads: int | None = None) -> Executors:
        """Pools sized for this machine, at a lower priority: ``threads`` I/O threads
        (default one per core, at least 2) and as many for migrations (default a quarter
        of the cores, at least 1, at the lowest priority), a hashing thread per core but
        one (at least 1), :data:`WRITE_WINDOW` writers (a migration's window; they wait on
        I/O)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        cores = cores or os.cpu_count() or 2
        low = lower_priority
        return cls(
            io=_Pool(threads or max(2, cores), "tiercheck-io", low),
            migrating=_Pool(threads or max(1, cores // 4), "tiercheck-migrate-io", lowest_priority),
            writes=_Pool(WRITE_WINDOW, "tiercheck-write", low),
            hashing=_Pool(max(1, cores - 1), "tiercheck-hash", low),
            logs=_Pool(LOG_READERS, "tiercheck-log", low),
        )

    def shutdown(self, *, wait: bool, cancel_futures: bool = False) -> None:
        """Shut every pool down (work not started is cancelled with ``cancel_futures``)."""
        for pool in (self.io, self.migrating, self.writes, self.hashing, self.logs):
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)
