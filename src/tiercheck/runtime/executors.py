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
runs at a lower scheduling priority (:class:`Priority`, the ``background`` argument of
``Checkpointer``), set on the thread itself. ``"low"``, the default: ``nice``
+:data:`NICE` (a migration's +:data:`MIGRATION_NICE`). ``"idle"``: Linux's ``SCHED_IDLE``
as well, which the kernel preempts the moment a thread of any other policy wakes on its
core (with ``nice`` alone a background thread runs out its time slice first). On the CPU
proxy of ``benchmarks/trainer_overhead.py``, three batches of alternating runs, the mean
step went 1.061x -> 1.044x, 1.047x -> 1.026x and 1.062x -> 1.068x; it is no default:
an unprivileged thread cannot leave ``SCHED_IDLE``, and where other processes keep every
core busy an idle thread gets almost no CPU, while the trainer may wait for it (a save's
staging buffer is free only once the fastest tier holds the save before): with two
busy-looping processes on two cores, 40 steps took over 300 s idle, 41 s with ``nice``.
The levels are absolute, counted from the ``nice`` of the thread that opened the store
(:attr:`Priority.base`): a pool's threads are started by whichever thread first submits
to it, and inherit its level, so a relative +10 put the pools the (already lowered) save
thread started at +19, not +10 (stops 46-47 measured them so). A thread already lower than
its level stays there: a pool a migration's thread started keeps the migration's level.
Threads a background thread starts inherit its priority (blake3's worker pool, which
hashes a save's large chunks, takes that of whichever thread first started it: the save
pipeline's, unless something else in the process hashed first). Only the staging copy,
which the trainer waits for, keeps the trainer's priority.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, get_args

from tiercheck.errors import ConfigError

__all__ = [
    "MIGRATION_NICE",
    "NICE",
    "WRITE_WINDOW",
    "Background",
    "Executors",
    "Priority",
    "lower_priority",
    "own_nice",
]

WRITE_WINDOW = 16  # blobs in flight to a target tier at once, per migration
LOG_READERS = 8  # tiers whose logs are read at once
NICE = 10  # how much lower the background threads run than the trainer
MIGRATION_NICE = 19  # how much lower a migration's threads run (at most MAX_NICE)
MAX_NICE = 19  # the lowest priority there is


Background = Literal["idle", "low"]  # Checkpointer(background=...): see the module docstring


def own_nice() -> int:
    """The calling thread's ``nice`` (Linux schedules threads one by one; 0 where the
    system has no such thing)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return 0


def lower_priority(nice: int = NICE, *, idle: bool = False) -> None:
    """Run the calling thread at ``nice`` (an absolute level, at most 19) and, with
    ``idle``, the ``SCHED_IDLE`` policy; on Linux both apply to the calling thread only.
    A thread already lower stays as it is: only the opener's privileges could raise it,
    and a thread made by a lower one (a migration's) inherits its maker's level. Where
    the system has no such thing (``SCHED_IDLE`` is Linux's), that part is left out."""
    try:
        if own_nice() < nice:
            os.setpriority(os.PRIO_PROCESS, 0, min(nice, MAX_NICE))
    except (AttributeError, OSError):
        pass
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


@dataclass(frozen=True)
class Priority:
    """The priority of one store's background threads (``Checkpointer(background=)``; see
    the module docstring), relative to the thread that opened the store (``base``, its
    ``nice`` when this was made): :meth:`lower` for the save's and the pools' threads,
    :meth:`lowest` for a migration's. The levels are absolute: a pool thread made by the
    save thread runs at the save thread's level, not +:data:`NICE` below it again."""

    background: Background = "low"
    base: int = field(default_factory=own_nice)

    def __post_init__(self) -> None:
        if self.background not in get_args(Background):
            raise ConfigError(
                f"background must be one of {', '.join(map(repr, get_args(Background)))}, "
                f"got {self.background!r}"
            )

    @property
    def lower(self) -> Callable[[], None]:
        """The initializer of a background thread (the opener's ``nice`` +:data:`NICE`)."""
        return partial(lower_priority, self.base + NICE, idle=self.background == "idle")

    @property
    def lowest(self) -> Callable[[], None]:
        """The initializer of a migration's thread (``nice`` +:data:`MIGRATION_NICE`)."""
        return partial(lower_priority, self.base + MIGRATION_NICE, idle=self.background == "idle")


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
    def start(cls, threads: int | None = None, priority: Priority | None = None) -> Executors:
        """Pools sized for this machine, at ``priority`` (default: low): ``threads`` I/O
        threads (default one per core, at least 2) and as many for migrations (default a
        quarter of the cores, at least 1, at the lowest priority), a hashing thread per
        core but one (at least 1), :data:`WRITE_WINDOW` writers (a migration's window;
        they wait on I/O)."""
        priority = priority or Priority()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        cores = cores or os.cpu_count() or 2
        low = priority.lower
        return cls(
            io=_Pool(threads or max(2, cores), "tiercheck-io", low),
            migrating=_Pool(threads or max(1, cores // 4), "tiercheck-migrate-io", priority.lowest),
            writes=_Pool(WRITE_WINDOW, "tiercheck-write", low),
            hashing=_Pool(max(1, cores - 1), "tiercheck-hash", low),
            logs=_Pool(LOG_READERS, "tiercheck-log", low),
        )

    def shutdown(self, *, wait: bool, cancel_futures: bool = False) -> None:
        """Shut every pool down (work not started is cancelled with ``cancel_futures``)."""
        for pool in (self.io, self.migrating, self.writes, self.hashing, self.logs):
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)
