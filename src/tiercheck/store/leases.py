"""Leases: who may write to a store and its tiers, and when garbage collection may sweep.

Three mechanisms, from the widest to the narrowest, all in the spirit of restic's locks
(shared locks for backups, an exclusive lock for prune):

- :class:`StoreLock`, on the store root: one writing process at a time, or the ranks of one
  job together. A single writer holds ``.lock`` exclusively; each rank of a multi-rank job
  holds ``.lock.rankN`` exclusively and ``.lock`` shared, so a second job, or ``tiercheck
  gc`` from a shell, cannot open the store for writing while the job runs.
- :class:`GCFence`, in this process: every blob id a save or migration relies on is
  *protected* before the engine asks a tier whether it has the blob, and stays protected
  until a commit record (which the mark reads) names it. A sweep deletes only what was
  unprotected when it claimed its candidates; a writer that protects an id a sweep is
  deleting right now waits for that deletion to end, then finds the blob absent and
  writes it again. The fence never calls a tier, and its lock is never held while a tier
  is called.
- :class:`TierLeases`, in tiers shared by several processes (several ranks, several jobs):
  a writer puts a *write lease* object into the tier before it asks what the tier has, and
  deletes it once its records are written; a sweep first puts the tier's *sweep lease*,
  then lists the tier, and does not sweep if it finds a live write lease of another
  process. A writer that finds a live sweep lease waits until the sweep ends, polling the
  tier with a backoff (10 ms doubling to 1 s). Appearing in one tier's listing in one order
  or the other, the two never overlap. The put and delete of this process's lease object
  in a tier run under a lock of that tier's (so that the object follows the count of holds
  in order); waiting for a sweep holds no lock. A lease of a
  process that died on this host is stale at once; any other lease after its time to live.

Lease objects are blobs whose ids begin with :data:`LEASE_PREFIX` (sixteen zeros; a
BLAKE3 chunk id begins so with probability 2^-64), holding ``TCLEASE1`` and a msgpack map.
GC never counts them as garbage unless they are stale (formats/SPEC.md, "Leases").
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgpack
import psutil

from tiercheck.backends.base import Tier
from tiercheck.errors import NotFound, StoreLocked, TierError, TierFull, TierUnavailable
from tiercheck.formats.ids import chunk_id
from tiercheck.store.tierset import TierSlot

__all__ = [
    "LEASE_PREFIX",
    "GCFence",
    "Lease",
    "Reservation",
    "StoreLock",
    "TierLeases",
    "is_lease_id",
]

log = logging.getLogger(__name__)

LEASE_PREFIX = "0" * 16
LEASE_MAGIC = b"TCLEASE1"
SWEEP_LEASE_ID = LEASE_PREFIX + "5" * 48
WRITE_TTL = 3600.0  # a writer holds its lease for one save or migration; refreshed per use
SWEEP_TTL = 600.0  # a sweep refreshes its lease between batches of deletes


_EVERY = "*"  # no blob's id: (tier, _EVERY) protects every blob of the tier (GCFence.hold)


def is_lease_id(blob_id: str) -> bool:
    return blob_id.startswith(LEASE_PREFIX)


# --- the store root ------------------------------------------------------------------------


class StoreLock:
    """The writer lock of a store root (see the module docstring). ``rank`` is None for a
    single-process writer."""

    def __init__(self, root: Path, rank: int | None) -> None:
        self._fds: list[int] = []
        try:
            if rank is None:
                self._take(root / ".lock", fcntl.LOCK_EX, "another process")
            else:
                self._take(root / ".lock", fcntl.LOCK_SH, "a single-process writer")
                self._take(root / f".lock.rank{rank}", fcntl.LOCK_EX, f"another rank {rank}")
        except BaseException:
            self.release()
            raise

    def _take(self, path: Path, mode: int, who: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = _holder(path)
            if pid == os.getpid():
                raise StoreLocked(
                    f"{path.parent} is open for writing by this process (pid {pid}): another "
                    "Checkpointer or TierWriter here holds it; close that one first, or open "
                    "this one with read_only=True"
                ) from None
            raise StoreLocked(
                f"{path.parent} is open for writing by {who}"
                + (f" (pid {pid})" if pid is not None else "")
                + "; open it with read_only=True to inspect it, or stop the other writer"
            ) from None
        if mode == fcntl.LOCK_EX:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._fds.append(fd)

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _holder(path: Path) -> int | None:
    """The pid an exclusive holder of the lock file ``path`` wrote into it; with ``.lock``
    held shared (the ranks of a job), the pid of a rank holding its own lock file."""
    candidates = [path]
    if path.name == ".lock":
        candidates += sorted(path.parent.glob(".lock.rank*"))
    for candidate in candidates:
        try:
            fd = os.open(candidate, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            continue  # not held exclusively: what it says is stale
        except BlockingIOError:
            text = os.read(fd, 32).decode(errors="replace").strip()
        finally:
            os.close(fd)
        if text.isdigit():
            return int(text)
    return None


# --- this process ---------------------------------------------------------------------------


class GCFence:
    r"""Blob ids that saves and migrations in this process rely on, and the sweeps running
    (see the module docstring). Thread-safe; :meth:`protect` waits only on a conflict.

    A sweep calls :meth:`begin`, then reads the catalog it marks from, lists the tier,
    :meth:`claim`\ s its candidates and deletes them, then calls :meth:`done`. Ids released
    while a sweep runs stay protected until it is done: the sweep may have read its
    catalog before the commit that now names them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # (tier, id): protected in that tier only; (None, id): in every tier
        self._protected: Counter[tuple[str | None, str]] = Counter()
        self._deleting: dict[str, frozenset[str]] = {}
        self._sweeps = 0
        self._deferred: list[list[tuple[str | None, str]]] = []

    def protect(self, ids: Iterable[str]) -> list[str]:
        """Protect ``ids`` in every tier; return once no sweep is deleting any of them. Pass
        the result to :meth:`release` when a commit record names them (or the work was
        abandoned)."""
        out = list(ids)
        self._add([(None, i) for i in out], None)
        return out

    def protect_in(self, tiers: Iterable[str], ids: Iterable[str]) -> list[tuple[str | None, str]]:
        """Protect ``ids`` in ``tiers`` only (a sweep of another tier may delete them: a
        migration that reads a version from a more durable tier lets a tier over its memory
        budget free it); otherwise as :meth:`protect`. Pass the result to
        :meth:`release_in`."""
        names, wanted = list(tiers), set(ids)
        keys: list[tuple[str | None, str]] = [(t, i) for t in names for i in wanted]
        self._add(keys, names)
        return keys

    def hold(self, tiers: Iterable[str]) -> list[tuple[str | None, str]]:
        """Protect every blob of ``tiers``: a sweep of them deletes nothing until the result
        is passed to :meth:`release_in`. Rank 0 holds the shared tiers while a version
        other ranks write there is in flight: it does not know their chunk ids (the
        commit protocol never sends them all to one rank). Returns once no sweep of
        ``tiers`` is deleting."""
        names = list(tiers)
        keys: list[tuple[str | None, str]] = [(t, _EVERY) for t in names]
        with self._cond:
            self._protected.update(keys)
            while any(self._deleting.get(t) for t in names):
                self._cond.wait()
        return keys

    def _add(self, keys: list[tuple[str | None, str]], tiers: list[str] | None) -> None:
        """Count ``keys`` as protected, then wait while a sweep of ``tiers`` (None: any)
        is deleting one of their ids."""
        wanted = {i for _, i in keys}
        with self._cond:
            self._protected.update(keys)
            while any(
                not wanted.isdisjoint(d)
                for t, d in self._deleting.items()
                if tiers is None or t in tiers
            ):
                self._cond.wait()

    def release(self, ids: list[str]) -> None:
        self.release_in([(None, i) for i in ids])

    def release_in(self, keys: list[tuple[str | None, str]]) -> None:
        with self._cond:
            if self._sweeps:
                self._deferred.append(keys)
            else:
                self._subtract(keys)

    def _subtract(self, keys: Iterable[tuple[str | None, str]]) -> None:
        self._protected.subtract(keys)
        for k in [k for k, n in self._protected.items() if n <= 0]:
            del self._protected[k]

    def protected(self, tier: str | None = None) -> set[str]:
        """The ids protected in every tier, plus those protected in ``tier`` alone."""
        with self._cond:
            return {i for t, i in self._protected if (t is None or t == tier) and i != _EVERY}

    def begin(self) -> None:
        """A sweep starts (before it reads the catalog it marks from)."""
        with self._cond:
            self._sweeps += 1

    def claim(self, tier: str, candidates: Iterable[str]) -> list[str]:
        """The ``candidates`` a sweep of ``tier`` may delete now (those unprotected); they
        count as being deleted until :meth:`done`."""
        with self._cond:
            held = (tier, _EVERY) in self._protected
            out = [
                c
                for c in candidates
                if (None, c) not in self._protected and (tier, c) not in self._protected
            ]
            if held:  # a version in flight: its writers' blobs may be among them
                out = []
            self._deleting[tier] = frozenset(out)
            return out

    def done(self, tier: str) -> None:
        with self._cond:
            self._deleting.pop(tier, None)
            self._sweeps -= 1
            if not self._sweeps:
                for keys in self._deferred:
                    self._subtract(keys)
                self._deferred.clear()
            self._cond.notify_all()


# --- tiers shared by several processes ----------------------------------------------------


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True)
class Lease:
    """A lease object's content."""

    kind: Literal["write", "sweep"]
    holder: str
    boot: str
    pidns: int
    pid: int
    time: float
    ttl: float

    def encode(self) -> bytes:
        body = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return LEASE_MAGIC + bytes(msgpack.packb(body, use_bin_type=True))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Lease | None:
        raw = bytes(data)
        if not raw.startswith(LEASE_MAGIC):
            return None
        try:
            body: Any = msgpack.unpackb(raw[len(LEASE_MAGIC) :], raw=False)
            return cls(**body)
        except (ValueError, TypeError, msgpack.UnpackException):
            return None

    def stale(self, now: float | None = None) -> bool:
        """Past its time to live, or held by a process that died on this host."""
        now = time.time() if now is None else now
        if now - self.time > self.ttl:
            return True
        same_host = self.boot == _boot_id() and self.pidns == _pid_namespace()
        return same_host and not psutil.pid_exists(self.pid)


def read_lease(tier: Tier, lease_id: str) -> Lease | None:
    """The lease stored under ``lease_id`` (None if absent or not a lease)."""
    try:
        return Lease.decode(tier.get(lease_id))
    except NotFound:
        return None


class TierLeases:
    """This process's leases in shared tiers (see the module docstring). ``holder`` names
    the process (a random id by default). Thread-safe: the write lease in one tier is put
    and deleted in the order its holds begin and end (a writer starting while the last one
    deletes the lease waits for the delete, then puts it again); waiting for a sweep holds
    no lock."""

    def __init__(self, holder: str | None = None) -> None:
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.write_id = LEASE_PREFIX + chunk_id(self.holder.encode())[16:]
        self._lock = threading.Lock()
        self._writers: Counter[str] = Counter()  # tier url -> holds
        self._since: dict[str, float] = {}  # tier url -> when the lease was (re)written
        # tier url -> held across the put or delete of this process's lease there and the
        # change of its count, so that the lease object follows the count in order
        self._ordering: dict[str, threading.RLock] = {}

    def _lease(self, kind: Literal["write", "sweep"], ttl: float) -> Lease:
        return Lease(kind, self.holder, _boot_id(), _pid_namespace(), os.getpid(), time.time(), ttl)

    # writers

    def acquire_write(
        self, tier: Tier, *, wait: bool = True, deadline: float | None = None
    ) -> None:
        """Hold a write lease in ``tier`` (shared by this process's writers), then, with
        ``wait``, wait while another process sweeps it (a writer must, before it asks the
        tier what it has). Raises :class:`TierUnavailable` if the sweep does not end by
        ``deadline`` (``time.monotonic()``; default: the sweep lease's time to live)."""
        with self._ordered(tier):  # reentrant: a failed put releases the hold under it
            with self._lock:
                first = self._writers[tier.url] == 0
                self._writers[tier.url] += 1
                stale = time.monotonic() - self._since.get(tier.url, 0.0) > WRITE_TTL / 4
            try:
                if first or stale:
                    lease = self._lease("write", WRITE_TTL).encode()
                    tier.put(self.write_id, lease, overwrite=True)
                    with self._lock:
                        self._since[tier.url] = time.monotonic()
            except BaseException:
                self.release_write(tier)
                raise
        try:
            if wait:
                self._wait_for_sweep(tier, deadline)
        except BaseException:
            self.release_write(tier)
            raise

    def _wait_for_sweep(self, tier: Tier, deadline: float | None) -> None:
        delay = 0.01
        limit = time.monotonic() + SWEEP_TTL if deadline is None else deadline
        while SWEEP_LEASE_ID in tier.has([SWEEP_LEASE_ID]):
            lease = read_lease(tier, SWEEP_LEASE_ID)
            if lease is None:
                return  # gone between the two calls, or not a lease: nobody sweeps
            if lease.holder == self.holder:
                return  # this process's own sweep: the GCFence orders the two
            if lease.stale():
                log.warning("%s: removing the stale sweep lease of %s", tier.url, lease.holder)
                with contextlib.suppress(TierError):
                    tier.delete([SWEEP_LEASE_ID])
                return
            if time.monotonic() > limit:
                raise TierUnavailable(
                    f"{lease.holder} has been sweeping this tier for too long", url=tier.url
                )
            time.sleep(delay)  # another process's sweep: poll the tier, backing off
            delay = min(delay * 2, 1.0)

    def write_valid(self, tier: Tier) -> bool:
        """Whether this process's write lease in ``tier`` still counts: a writer that held
        it longer than its time to live must not commit what it wrote."""
        with self._lock:
            since = self._since.get(tier.url)
        return since is not None and time.monotonic() - since < WRITE_TTL * 0.9

    def _ordered(self, tier: Tier) -> threading.RLock:
        """The lock ordering the puts and deletes of the write lease in ``tier``."""
        with self._lock:
            return self._ordering.setdefault(tier.url, threading.RLock())

    def release_write(self, tier: Tier) -> None:
        """End one hold of the write lease in ``tier``; the last one deletes the lease,
        before any hold that begins after it puts the lease again."""
        with self._ordered(tier):
            with self._lock:
                self._writers[tier.url] -= 1
                last = self._writers[tier.url] <= 0
                if last:
                    del self._writers[tier.url]
                    self._since.pop(tier.url, None)
            if last:
                try:
                    tier.delete([self.write_id])
                except TierError as exc:  # it goes stale by itself; a sweep removes it then
                    log.warning(
                        "%s: could not remove this process's write lease: %s", tier.url, exc
                    )

    @contextlib.contextmanager
    def writing(self, tier: Tier) -> Iterator[None]:
        self.acquire_write(tier)
        try:
            yield
        finally:
            self.release_write(tier)

    # sweeps

    def begin_sweep(self, tier: Tier, listed: Iterable[str]) -> str | None:
        """Take ``tier``'s sweep lease, given the ids a listing made *after* it was put
        (:meth:`put_sweep`); return why not to sweep (a live write lease of another
        process), or None. Stale leases found are deleted."""
        stale: list[str] = []
        for blob_id in listed:
            if not is_lease_id(blob_id) or blob_id in (SWEEP_LEASE_ID, self.write_id):
                continue
            lease = read_lease(tier, blob_id)
            if lease is None:
                continue
            if lease.stale():
                stale.append(blob_id)
                continue
            return f"{lease.holder} is writing to it"
        if stale:
            with contextlib.suppress(TierError):
                tier.delete(stale)
        return None

    def put_sweep(self, tier: Tier) -> str | None:
        """Put ``tier``'s sweep lease; return why not to sweep (another live sweep), or
        None. Must be followed by :meth:`end_sweep` when it returns None."""
        current = read_lease(tier, SWEEP_LEASE_ID)
        if current is not None and current.holder != self.holder and not current.stale():
            return f"{current.holder} is sweeping it"
        try:
            tier.put(SWEEP_LEASE_ID, self._lease("sweep", SWEEP_TTL).encode(), overwrite=True)
        except TierFull as exc:
            # no room for the lease in a full tier, and this sweep may be what frees room:
            # it goes on without it (the writers' leases are still checked, and the grace
            # period keeps what was written lately); a sweep racing it deletes as it does
            log.info("%s: sweeping without a sweep lease: %s", tier.url, exc)
            return None
        back = read_lease(tier, SWEEP_LEASE_ID)  # two sweepers racing: the last put wins
        if back is None or back.holder != self.holder:
            return "another process is sweeping it"
        return None

    def end_sweep(self, tier: Tier) -> None:
        try:
            tier.delete([SWEEP_LEASE_ID])
        except TierError as exc:
            log.warning("%s: could not remove the sweep lease: %s", tier.url, exc)


@dataclass
class Reservation:
    """What rank 0 holds for a version's migrations to shared tiers from the save on: its
    own ids protected, every blob of each shared target held from its own sweeps (the
    other ranks' ids are theirs alone), and a write lease in each shared target."""

    protected: list[str] = field(default_factory=list)
    held: list[tuple[str | None, str]] = field(default_factory=list)
    leased: list[TierSlot] = field(default_factory=list)
