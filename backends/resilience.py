"""Retry with backoff and connection limits, as tier wrappers (restic's retry and limiter
backends): :class:`RetryTier` and :class:`LimitTier` forward the whole tier interface
(:class:`~tiercheck.backends.wrappers.WrapperTier`), so save, migration, restore and GC reach
a tier through them without knowing they are there.

**What is retried.** Only :class:`~tiercheck.errors.TierUnavailable`, the one error the tier
interface calls transient (an endpoint that answered 503, a reset connection, a timeout).
A missing blob, a corrupt copy, a full tier, a refused write are permanent for the call and
go up at once. Each retried call is safe to repeat: blob writes are create-if-absent under
content-addressed names, deletes and reads change nothing twice, and a log record appended
twice (a lost reply to a write that landed) is read as one (the catalog folds records into
maps and sets), which the migration scheduler already relies on when it retries a whole
migration.

**Backoff.** ``attempts`` tries per call at most (the first included), waiting a random time
up to ``initial * 2**n`` seconds (full jitter, capped at ``max_delay``) between them, and no
new try once ``deadline`` seconds have passed since the first (tenacity's
``wait_random_exponential`` and ``stop_after_attempt | stop_after_delay``).

**Two layers that do not multiply.** The migration scheduler retries a whole migration on
``TierUnavailable`` (1 s doubling to 60 s, without end). The retry here absorbs the blip
inside one call; an outage is the scheduler's: once a call has used all its tries, the
wrapper marks the tier *down*, and while it is down every call makes one try and no more.
The first call that succeeds marks it up again. So during an outage each migration attempt
costs one request per call, not ``attempts``, and the requests an outage costs are those of
the scheduler's backoff plus, once, the tries of the call that found it.

**Connection limits.** :class:`LimitTier` lets at most ``max_in_flight`` calls into the
inner tier at once; the others wait for a slot (a bounded semaphore). It sits inside the
retry, so a call waiting out its backoff holds no slot.

:func:`wrapping` applies both from a tier's options (``retry``, ``max_in_flight``; see
docs/configuration.md), with defaults for object stores and remote file systems; the tier
set calls it when it opens a tier.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from tiercheck.backends.base import Buffer, LogScan, PendingPut, StoreOwner, Tier
from tiercheck.backends.wrappers import WrapperTier
from tiercheck.errors import ConfigError, TierUnavailable

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_RETRY",
    "LimitTier",
    "RetryPolicy",
    "RetryTier",
    "open_wrapped",
    "split_options",
    "wrapping",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# URL schemes that reach a store over the network: they get the defaults below
REMOTE_SCHEMES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "http", "https", "sftp", "hdfs"}
)
OPTION_KEYS = ("retry", "max_in_flight")


@dataclass(frozen=True)
class RetryPolicy:
    """How :class:`RetryTier` retries one call (module docstring)."""

    attempts: int = 5
    initial: float = 0.1
    max_delay: float = 2.0
    deadline: float = 15.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool):
            raise ConfigError(f"retry attempts must be an int >= 1, got {self.attempts!r}")
        if self.attempts < 1:
            raise ConfigError(f"retry attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("initial", "max_delay", "deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"retry {name} must be a number >= 0, got {value!r}")


DEFAULT_RETRY = RetryPolicy()
DEFAULT_LIMIT = 16


class RetryTier(WrapperTier):
    """``inner``, each call retried on :class:`~tiercheck.errors.TierUnavailable` with
    bounded exponential backoff and jitter; one try per call while the tier is down (module
    docstring). ``sleep`` is how a backoff waits (tests pass their own to count)."""

    def __init__(
        self,
        inner: Tier,
        policy: RetryPolicy = DEFAULT_RETRY,
        *,
        sleep: Callable[[float], None] = tenacity.nap.sleep,
    ) -> None:
        super().__init__(inner)
        self.policy = policy
        self._sleep = sleep
        self._down = False
        self._state_lock = threading.Lock()
        self.retries = 0  # tries after a first one, over the wrapper's life
        self.gave_up = 0  # calls that used every try

    @property
    def down(self) -> bool:
        """Whether the last call that gave up has not been followed by one that succeeded."""
        with self._state_lock:
            return self._down

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if self._down:
            try:
                result = fn()  # one try: the outage is the caller's to wait out
            except TierUnavailable:
                raise
            except BaseException:
                self._up()  # a permanent error is an answer: the tier is reachable
                raise
            self._up()
            return result
        try:
            return fn()  # the first try costs no more than the call (no retry state)
        except TierUnavailable as exc:
            first: TierUnavailable | None = exc

        def attempt() -> T:
            nonlocal first
            if first is not None:  # tenacity's first try is the one that just failed
                failed, first = first, None
                raise failed
            return fn()

        p = self.policy
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TierUnavailable),
            stop=tenacity.stop_after_attempt(p.attempts) | tenacity.stop_after_delay(p.deadline),
            wait=tenacity.wait_random_exponential(multiplier=p.initial, max=p.max_delay),
            sleep=self._sleep,
            before_sleep=lambda state: self._retrying(what, state),
            reraise=True,
        )
        try:
            result = retrying(attempt)
        except TierUnavailable as exc:
            with self._state_lock:
                self._down = True
                self.gave_up += 1
            log.warning(
                "tier %s: %s still unavailable after %d tries, treated as down (one try "
                "per call until one succeeds): %s",
                self.url,
                what,
                retrying.statistics.get("attempt_number", 1),
                exc,
            )
            raise
        return result

    def _retrying(self, what: str, state: tenacity.RetryCallState) -> None:
        with self._state_lock:
            self.retries += 1
        exc = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        log.info(
            "tier %s: %s unavailable (%s), try %d of %d in %.2f s",
            self.url,
            what,
            exc,
            state.attempt_number + 1,
            self.policy.attempts,
            wait,
        )

    def _up(self) -> None:
        with self._state_lock:
            if self._down:
                log.info("tier %s answers again", self.url)
            self._down = False

    # --- blobs: content-addressed, so a repeated write or delete changes nothing ----------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        return self._call("put", lambda: self.inner.put(blob_id, data, overwrite=overwrite))

    def put_parts(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool = False) -> bool:
        return self._call("put", lambda: self.inner.put_parts(blob_id, parts, overwrite=overwrite))

    def begin_put(self, blob_id: str, parts: Sequence[Buffer]) -> PendingPut:
        return self._call("put", lambda: self.inner.begin_put(blob_id, parts))

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        batch = builtins.list(items)  # a generator could not be given twice
        return self._call("put_many", lambda: self.inner.put_many(batch))

    def put_many_parts(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> int:
        batch = builtins.list(items)
        return self._call("put_many", lambda: self.inner.put_many_parts(batch))

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        return self._call("get", lambda: self.inner.get(blob_id, out))

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        return self._call("get", lambda: self.inner.get_parts(blob_id, parts))

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        ids = builtins.list(blob_ids)
        return self._call("has", lambda: self.inner.has(ids))

    def delete(self, blob_ids: Iterable[str]) -> int:
        ids = builtins.list(blob_ids)
        return self._call("delete", lambda: self.inner.delete(ids))

    def list(self) -> Iterator[str]:
        return iter(self._call("list", lambda: builtins.list(self.inner.list())))

    def size(self, blob_id: str) -> int:
        return self._call("size", lambda: self.inner.size(blob_id))

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        return self._call("head", lambda: self.inner.head(blob_id, nbytes))

    # --- log: a record appended twice reads as one ------------------------------------------

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        batch = builtins.list(blobs)
        self._call("append", lambda: self.inner.append(record, blobs=batch))

    def read_log(self) -> builtins.list[bytes]:
        return self._call("read_log", self.inner.read_log)

    def scan_log(self) -> LogScan:
        return self._call("scan_log", self.inner.scan_log)

    # --- metadata: reading it twice, or writing the same record twice, is harmless -----------

    def written_at(self, blob_ids: Sequence[str]) -> dict[str, float]:
        ids = builtins.list(blob_ids)
        return self._call("written_at", lambda: self.inner.written_at(ids))

    def read_owner(self) -> StoreOwner | None:
        return self._call("read_owner", self.inner.read_owner)

    def write_owner(self, owner: StoreOwner) -> None:
        self._call("write_owner", lambda: self.inner.write_owner(owner))

    def claim_owner(self, owner: StoreOwner, *, replacing: StoreOwner | None = None) -> StoreOwner:
        # a retry after a claim that did land finds this very record: it still wins
        return self._call("claim_owner", lambda: self.inner.claim_owner(owner, replacing=replacing))


class LimitTier(WrapperTier):
    """``inner`` with at most ``max_in_flight`` calls in it at once (module docstring)."""

    def __init__(self, inner: Tier, max_in_flight: int) -> None:
        super().__init__(inner)
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)

    def _call(self, fn: Callable[[], T]) -> T:
        with self._slots:
            return fn()

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        return self._call(lambda: self.inner.put(blob_id, data, overwrite=overwrite))

    def put_parts(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool = False) -> bool:
        return self._call(lambda: self.inner.put_parts(blob_id, parts, overwrite=overwrite))

    def begin_put(self, blob_id: str, parts: Sequence[Buffer]) -> PendingPut:
        return self._call(lambda: self.inner.begin_put(blob_id, parts))

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        return self._call(lambda: self.inner.put_many(items))

    def put_many_parts(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> int:
        return self._call(lambda: self.inner.put_many_parts(items))

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        return self._call(lambda: self.inner.get(blob_id, out))

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        return self._call(lambda: self.inner.get_parts(blob_id, parts))

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        return self._call(lambda: self.inner.has(blob_ids))

    def delete(self, blob_ids: Iterable[str]) -> int:
        return self._call(lambda: self.inner.delete(blob_ids))

    def list(self) -> Iterator[str]:
        return iter(self._call(lambda: builtins.list(self.inner.list())))

    def size(self, blob_id: str) -> int:
        return self._call(lambda: self.inner.size(blob_id))

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        return self._call(lambda: self.inner.head(blob_id, nbytes))

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self._call(lambda: self.inner.append(record, blobs=blobs))

    def read_log(self) -> builtins.list[bytes]:
        return self._call(self.inner.read_log)

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        self._call(lambda: self.inner.replace_log_prefix(count, record))

    def scan_log(self) -> LogScan:
        return self._call(self.inner.scan_log)

    def written_at(self, blob_ids: Sequence[str]) -> dict[str, float]:
        return self._call(lambda: self.inner.written_at(blob_ids))

    def read_owner(self) -> StoreOwner | None:
        return self._call(self.inner.read_owner)

    def write_owner(self, owner: StoreOwner) -> None:
        self._call(lambda: self.inner.write_owner(owner))

    def claim_owner(self, owner: StoreOwner, *, replacing: StoreOwner | None = None) -> StoreOwner:
        return self._call(lambda: self.inner.claim_owner(owner, replacing=replacing))


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` as (the tier class's, the wrappers': ``retry``, ``max_in_flight``)."""
    ours = {k: v for k, v in options.items() if k in OPTION_KEYS}
    return {k: v for k, v in options.items() if k not in OPTION_KEYS}, ours


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def _retry_policy(value: Any, url: str) -> RetryPolicy | None:
    if value is None:
        return DEFAULT_RETRY if _scheme(url) in REMOTE_SCHEMES else None
    if value is False:
        return None
    if value is True:
        return DEFAULT_RETRY
    if isinstance(value, Mapping):
        unknown = set(value) - {"attempts", "initial", "max_delay", "deadline"}
        if unknown:
            raise ConfigError(
                f"tier {url}: unknown retry options {sorted(unknown)} (attempts, initial, "
                "max_delay, deadline)"
            )
        return RetryPolicy(**dict(value))
    raise ConfigError(f"tier {url}: retry must be true, false or a table, got {value!r}")


def _limit(value: Any, url: str) -> int | None:
    if value is None:
        return DEFAULT_LIMIT if _scheme(url) in REMOTE_SCHEMES else None
    if value is False or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"tier {url}: max_in_flight must be an int >= 0, got {value!r}")
    return value


def wrapping(url: str, options: Mapping[str, Any]) -> Callable[[Tier], Tier]:
    """What puts the tier at ``url`` inside the wrappers its ``options`` (from
    :func:`split_options`) ask for: ``RetryTier(LimitTier(tier))``, either left out where
    it is off. Without options, a tier whose URL reaches a store over the network
    (``s3://``, ``gs://``, ``az://``, ``https://``, ...) gets :data:`DEFAULT_RETRY` and
    :data:`DEFAULT_LIMIT`; a local one (memory, shm, LMDB, a file system path, peer,
    collective) neither. Bad options raise :class:`~tiercheck.errors.ConfigError` here,
    before the tier is opened."""
    policy = _retry_policy(options.get("retry"), url)
    limit = _limit(options.get("max_in_flight"), url)

    def wrap(tier: Tier) -> Tier:
        if limit is not None:
            tier = LimitTier(tier, limit)
        if policy is not None:
            tier = RetryTier(tier, policy)
        return tier

    return wrap


def open_wrapped(url: str, options: Mapping[str, Any], open_: Callable[[], Tier]) -> Tier:
    """``open_()`` inside the wrappers :func:`wrapping` gives ``url`` and ``options``;
    opening is retried as a call is (an S3 tier's open asks for its bucket), and gives up
    with the :class:`~tiercheck.errors.TierUnavailable` of its last try."""
    wrap = wrapping(url, options)
    policy = _retry_policy(options.get("retry"), url)
    if policy is None:
        return wrap(open_())
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TierUnavailable),
        stop=tenacity.stop_after_attempt(policy.attempts)
        | tenacity.stop_after_delay(policy.deadline),
        wait=tenacity.wait_random_exponential(multiplier=policy.initial, max=policy.max_delay),
        reraise=True,
    )
    return wrap(retrying(open_))
