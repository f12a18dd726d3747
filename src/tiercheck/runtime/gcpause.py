"""Pausing Python's automatic garbage collection for a call the caller waits on:
:func:`gc_paused`.

A restore of a state of many tensors allocates tens of thousands of short-lived objects
(views, slices, tuples), enough to set off the cyclic collector's passes, and a pass of the
oldest generation walks every object the process holds. Measured (a state of 2,288 tensors,
1 GiB, 15 restores from shm in one process): with ~200k objects in the process, 36-37 young
passes per restore and a full one in every third (94 ms): median 272-291 ms, slowest
416-437, against 253-257 and 283-338 paused; with 4 million objects one full pass in 15
restores: slowest 642-649 ms against 250-256 paused. The objects such a call makes die
with it (reference counting frees them), so pausing the collector for its length leaves no
work behind: it is the collector's own counting that sets off the passes, not garbage.

Paused while any such call runs on any thread, resumed when the last ends, and only if it
was running when the first began: a caller that disabled the collector keeps it disabled.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_resume = False  # whether the collector was enabled when the outermost pause began


@contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off for the ``with`` body (module docstring)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
