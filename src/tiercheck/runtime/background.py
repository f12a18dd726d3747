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
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import ParamSpec

from tiercheck.errors import Halted
from tiercheck.runtime.handles import Failures

__all__ = ["Halt", "reporting"]

log = logging.getLogger(__name__)

P = ParamSpec("P")


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
