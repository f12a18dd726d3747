"""The engine's background threads: how each reports a failure, and how ``close()`` stops
them.

Every function the engine runs on a thread of its own whose outcome nobody waits for (the
save pipeline, the migration thread, maintenance requested by a commit, the Lightning IO's
writer) is entered through :func:`reporting`: an exception it lets escape is logged and
recorded in the store's :class:`~tiercheck.runtime.handles.Failures`, which ``close()`` raises in
its :class:`~tiercheck.errors.UnfinishedWork`. None is lost in a future nobody reads.

:class:`Halt` is how ``close()`` stops them. Once it is set, a background thread starts no
new call to a tier: each checks it (:meth:`Halt.check`, raising
:class:`~tiercheck.errors.Halted`) before one, and the work queued is cancelled; a call
already made runs to its end. ``close()`` waits for the threads until its deadline, and
the tiers are closed and the store lock released only once the last of them has ended.

:func:`at_interpreter_exit` is how a store still open when the interpreter exits is closed
in order. Python's ``concurrent.futures`` refuses new work from the moment the
interpreter begins to exit (``cannot schedule new futures after shutdown``) while the
threads already running go on, so a save in flight would fail halfway, with an internal
traceback. The hook runs before that moment (it is registered after ``concurrent.futures``,
and such hooks run newest first): each store's in-flight saves are finished, and what
cannot be finished is logged in one line.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 (its exit hook must be registered before ours)
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from tiercheck.errors import Halted
from tiercheck.runtime.handles import Failures

__all__ = ["Halt", "at_interpreter_exit", "reporting"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_exit_lock = threading.Lock()
_exit_hooks: list[tuple[weakref.ref[Any], Callable[[Any], None]]] = []
_exit_registered = False


def at_interpreter_exit(owner: T, fn: Callable[[T], None]) -> None:
    """Call ``fn(owner)`` when the interpreter exits, while thread pools still take work
    (module docstring), unless ``owner`` was collected by then. ``fn`` should close what
    ``owner`` runs, waiting for its work in flight and logging, in one line each, what it
    leaves; an exception it raises is logged in one line, without a traceback."""
    global _exit_registered
    with _exit_lock:
        _exit_hooks[:] = [(r, f) for r, f in _exit_hooks if r() is not None]
        _exit_hooks.append((weakref.ref(owner), fn))
        if not _exit_registered:
            register = getattr(threading, "_register_atexit", None)
            if register is None:  # no such hook in this Python: the atexit module's, later
                import atexit

                atexit.register(_at_exit)
            else:
                try:
                    register(_at_exit)
                except RuntimeError:  # the interpreter is already exiting
                    return
            _exit_registered = True


def _at_exit() -> None:
    with _exit_lock:
        hooks = list(reversed(_exit_hooks))  # the newest store first
        _exit_hooks.clear()
    for ref, fn in hooks:
        owner = ref()
        if owner is None:
            continue
        try:
            fn(owner)
        except Exception as exc:
            log.warning("at interpreter exit: %s: %s", type(exc).__name__, exc)


class Halt:
    """Set once by ``close()``: from then on no background thread starts a tier call."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self.why = ""

    def set(self, why: str) -> None:
        if not self._set.is_set():
            self.why = why
            self._set.set()

    def is_set(self) -> bool:
        return self._set.is_set()

    def check(self, what: str) -> None:
        """Raise :class:`~tiercheck.errors.Halted` if set; ``what`` names the work not started."""
        if self._set.is_set():
            raise Halted(f"{what} was not started: {self.why}")


def reporting(
    failures: Failures,
    what: str,
    fn: Callable[P, object],
    *,
    then: Callable[[BaseException], None] | None = None,
) -> Callable[P, None]:
    """``fn`` as the entry point of a background thread: an exception it lets escape is
    logged and recorded in ``failures`` as a failure of ``what`` (then passed to ``then``,
    if given), never raised into a future or a thread nobody joins. Work stopped by close
    (:class:`~tiercheck.errors.Halted`) is not a failure."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Halted as exc:
            log.debug("%s stopped: %s", what, exc)
        except BaseException as exc:
            log.error("%s failed unexpectedly", what, exc_info=exc)
            failures.background(f"{what}: {exc!r}", exc)
            if then is not None:
                then(exc)

    return run
