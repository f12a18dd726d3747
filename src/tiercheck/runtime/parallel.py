"""Running one call per item on a pool, all or nothing: :func:`map_all`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor, wait
from typing import TypeVar

__all__ = ["map_all"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def map_all(pool: Executor, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
    """``list(pool.map(fn, items))``, except that a failure leaves no call running: the
    calls not started are cancelled and the running ones awaited before the first failure
    is raised.

    ``Executor.map`` lets them run on after it raised, and here they read a staged buffer
    that is reused once the caller returns, or write what the caller has already given up:
    a save's chunks that its failure deletes, a restore's chunks into the buffer the next
    attempt (an older version) fills."""
    futures = [pool.submit(fn, item) for item in items]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise
