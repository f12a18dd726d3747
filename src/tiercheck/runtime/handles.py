"""Save handles: where the outcome of one save is delivered, and the failures nobody saw.

``Checkpointer.save`` returns a :class:`SaveHandle`. Everything the background does for that
save (staging, each tier's commit, each migration, and any failure) is recorded on that
handle and nowhere else: an error is raised by the handle's ``wait``/``wait_migrated``,
never by an unrelated later call. A failure whose handle nobody waited on is kept in
:class:`Failures` until ``close()`` reports it.

The engine's services update a handle through its ``_``-prefixed methods; the handle's own
lock guards its fields and is never held while anything else runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from tiercheck.errors import CheckpointError, WaitTimeout
from tiercheck.formats.manifest import Role

__all__ = ["Failures", "SaveHandle", "SaveResult", "TierState"]

TierState = Literal[
    "pending", "committed", "migrating", "missing", "failed", "dropped", "unreachable"
]
"""A tier's state of one version, one vocabulary for the save handle, history and the CLI
(docs/concepts.md, "A tier's state of a version"):

- ``pending``: being written (a handle's state while its save runs);
- ``committed``: the tier holds the version, committed;
- ``migrating``: the version is queued for, or being migrated to, the tier;
- ``missing``: the tier does not hold it and is not going to: its placement does not take
  the version's role, or its memory budget had no room (the handle's ``errors`` say so);
- ``failed``: writing it there failed (the handle's ``errors`` say why);
- ``dropped``: the tier held it and retention dropped it;
- ``unreachable``: the tier could not be opened or read.
"""


@dataclass(frozen=True)
class SaveResult:
    """What a save did. ``tiers`` maps each tier to its state for this version, ``errors``
    each tier that failed to the cause."""

    version: int | None
    step: int
    role: Role | None
    base: int | None
    logical_bytes: int
    bytes_written: Mapping[str, int]
    chunks_written: Mapping[str, int]
    tiers: Mapping[str, TierState]
    errors: Mapping[str, str]
    timings: Mapping[str, float]
    skipped: bool = False
    why_skipped: str = ""  # why no tier took it (``skipped``)

    @property
    def committed_tiers(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.tiers.items() if s == "committed")


class SaveHandle:
    """Tracks one save.

    - ``wait_staged()``: the state has been copied; the caller may change it.
    - ``wait()``: the version is committed and meets the store's guarantees for its
      synchronous tiers; raises :class:`~tiercheck.errors.CommitAborted`,
      :class:`~tiercheck.errors.DurabilityError` or another
      :class:`~tiercheck.errors.CheckpointError` otherwise.
    - ``wait_migrated()``: as ``wait()``, and every migration of the version settled
      (committed, or given up) and the guarantees for asynchronous tiers hold.

    Each takes an optional ``timeout`` (seconds) and raises
    :class:`~tiercheck.errors.WaitTimeout` when it runs out; the save goes on.
    """

    def __init__(
        self,
        step: int,
        version: int | None,
        role: Role | None,
        base: int | None,
        *,
        failures: Failures | None = None,
    ) -> None:
        self.step = step
        self.version = version
        self.role = role
        self.base = base
        self.skipped = False
        self.why_skipped = ""
        self._staged = threading.Event()
        self._done = threading.Event()
        self._migrated = threading.Event()
        self._lock = threading.Lock()
        self._failures = failures
        self._error: BaseException | None = None  # what wait() raises
        self._migrated_error: BaseException | None = None  # what wait_migrated() adds
        self._error_seen = False
        self._migrated_error_seen = False
        self._tiers: dict[str, TierState] = {}
        self._errors: dict[str, str] = {}
        self._bytes: dict[str, int] = {}
        self._chunks: dict[str, int] = {}
        self._timings: dict[str, float] = {}
        self._logical = 0
        self._migrating: set[str] = set()

    # --- called by the engine ---------------------------------------------------------

    def _set_tier(self, name: str, state: TierState, error: str | None = None) -> None:
        with self._lock:
            self._tiers[name] = state
            if error:
                self._errors[name] = error

    def _time(self, what: str, seconds: float) -> None:
        with self._lock:
            self._timings[what] = seconds

    def _written(self, tier: str, nbytes: int, chunks: int) -> None:
        with self._lock:
            self._bytes[tier] = nbytes
            self._chunks[tier] = chunks

    def _mark_staged(self) -> None:
        self._staged.set()

    def _finish(
        self,
        error: BaseException | None,
        migrating: Iterable[str] = (),
        migrated_error: BaseException | None = None,
    ) -> None:
        """The synchronous part ended: committed (``error`` None or a shortfall the version
        survives) or failed. ``migrating``: the tiers it is now being migrated to; with
        none, ``migrated_error`` is what ``wait_migrated()`` adds."""
        targets = set(migrating)
        with self._lock:
            self._error = error
            self._migrating = targets
            for name in targets:
                self._tiers[name] = "migrating"
            for name, state in self._tiers.items():
                if state == "pending":  # its placement did not take the version
                    self._tiers[name] = "missing"
        if error is not None and self._failures is not None:
            self._failures.add(self)
        self._staged.set()
        self._done.set()
        if not targets:
            self._settle_migrated(migrated_error)

    def _supersede(self, why: str) -> None:
        """Given up for a newer save before any tier committed it: skipped, not failed;
        each tier that was to take it is ``missing``, with ``why``."""
        with self._lock:
            for name, state in self._tiers.items():
                if state == "pending":
                    self._tiers[name] = "missing"
                    self._errors[name] = why
        self.skipped, self.why_skipped = True, why
        self._finish(None)

    def _fail(self, exc: BaseException) -> None:
        """The save failed before it committed anywhere."""
        self._finish(exc)

    def _migration_settled(self, tier: str, state: TierState, error: str | None = None) -> bool:
        """Record how the migration to ``tier`` ended; True if it was the last one."""
        with self._lock:
            self._tiers[tier] = state
            if error:
                self._errors[tier] = error
            self._migrating.discard(tier)
            return not self._migrating

    def _settle_migrated(self, error: BaseException | None) -> None:
        """Every migration ended; ``error`` is what ``wait_migrated()`` raises, if anything."""
        with self._lock:
            self._migrated_error = error
        if error is not None and self._failures is not None:
            self._failures.add(self)
        self._migrated.set()

    # --- public -------------------------------------------------------------------------

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied; the caller may then mutate it. Raises
        the save's error if it failed before staging finished."""
        if not self._staged.wait(timeout):
            raise WaitTimeout(f"staging of step {self.step} did not finish in {timeout}s")
        with self._lock:
            failed_early = self._error is not None and "staged" not in self._timings
        if failed_early:
            raise self._take_error()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until committed at the synchronous tiers; raise if the save failed or
        misses the store's guarantees (see the class docstring)."""
        if not self._done.wait(timeout):
            raise WaitTimeout(f"save of step {self.step} did not finish in {timeout}s")
        if self._error is not None:
            raise self._take_error()
        return self.result_now()

    result = wait

    def wait_migrated(self, timeout: float | None = None) -> SaveResult:
        """Block until every migration of the version settled; then raise as ``wait()``
        does, or if a required asynchronous tier did not receive it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._done.wait(timeout):
            raise WaitTimeout(f"save of step {self.step} did not finish in {timeout}s")
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        # a save that missed its guarantees may still be migrating: wait for that first
        if not self._migrated.wait(left):
            with self._lock:
                pending = sorted(self._migrating)
            raise WaitTimeout(
                f"migration of step {self.step} (version {self.version}) to {pending} did not "
                f"finish in {timeout}s; it is still being retried"
            )
        result = self.wait()  # done: the save's own error first, as wait() raises it
        with self._lock:
            err = self._migrated_error
            self._migrated_error_seen = True
        if err is not None:
            raise err
        return result

    def done(self) -> bool:
        """Whether the synchronous part ended (``wait()`` would not block)."""
        return self._done.is_set()

    def migrated(self) -> bool:
        """Whether every migration of the version ended (``wait_migrated()`` would not block)."""
        return self._migrated.is_set()

    def _take_error(self) -> CheckpointError:
        with self._lock:
            err = self._error
            self._error_seen = True
        assert err is not None
        if isinstance(err, CheckpointError):
            return err
        out = CheckpointError(f"save of step {self.step} (version {self.version}) failed: {err}")
        out.__cause__ = err
        return out

    def _unseen_errors(self) -> list[BaseException]:
        """Errors of this save that no ``wait``/``wait_migrated`` has raised yet."""
        with self._lock:
            out = []
            if self._error is not None and not self._error_seen:
                out.append(self._error)
            if self._migrated_error is not None and not self._migrated_error_seen:
                out.append(self._migrated_error)
            return out

    def result_now(self) -> SaveResult:
        """A snapshot of the save's state, whether finished or not."""
        with self._lock:
            return SaveResult(
                version=self.version,
                step=self.step,
                role=self.role,
                base=self.base,
                logical_bytes=self._logical,
                bytes_written=dict(self._bytes),
                chunks_written=dict(self._chunks),
                tiers=dict(self._tiers),
                errors=dict(self._errors),
                timings=dict(self._timings),
                skipped=self.skipped,
                why_skipped=self.why_skipped,
            )

    def __repr__(self) -> str:
        state = "migrated" if self.migrated() else "done" if self.done() else "running"
        return f"SaveHandle(step={self.step}, version={self.version}, {state})"


class Failures:
    """Saves whose failure was recorded on their handle, and failures of the engine's own
    threads, kept until ``close()`` reports those nobody has seen (at most :data:`KEEP`
    of each; beyond that they are counted)."""

    KEEP = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list[SaveHandle] = []
        self._background: list[tuple[str, BaseException | None]] = []
        self._dropped = 0

    def add(self, handle: SaveHandle) -> None:
        with self._lock:
            if handle in self._handles:
                return
            if len(self._handles) >= self.KEEP:  # forget the failures already raised
                self._handles = [h for h in self._handles if h._unseen_errors()]
            if len(self._handles) >= self.KEEP:
                self._handles.pop(0)
                self._dropped += 1
            self._handles.append(handle)

    def background(self, what: str, error: BaseException | None = None) -> None:
        """A failure of an engine thread outside any one save (``error``, if given, is the
        exception, for :meth:`take`)."""
        with self._lock:
            if len(self._background) < self.KEEP:
                self._background.append((what, error))

    def take(self, error: BaseException) -> bool:
        """Forget the background failure ``error`` (its owner raised it where it was seen,
        so ``close()`` need not); True if it was kept."""
        with self._lock:
            kept = [b for b in self._background if b[1] is not error]
            found = len(kept) != len(self._background)
            self._background = kept
            return found

    def unseen(self) -> tuple[list[tuple[int, int | None, str]], list[str]]:
        """``(saves, background)``: each save's step, version and unseen errors; and the
        background failures."""
        with self._lock:
            handles = list(self._handles)
            background = [what for what, _ in self._background]
            if self._dropped:
                background.append(f"{self._dropped} older failed saves, not listed")
        saves = []
        for h in handles:
            errors = h._unseen_errors()
            if errors:
                saves.append((h.step, h.version, "; ".join(str(e) for e in errors)))
        return saves, background
