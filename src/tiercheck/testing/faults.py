"""Fault injection: a tier wrapper that fails, stalls, damages and loses writes on purpose.

:class:`FaultyTier` wraps any :class:`~tiercheck.backends.base.Tier` (it is a
:class:`~tiercheck.backends.wrappers.WrapperTier`: every call of the tier interface reaches
the inner tier) and consults a :class:`FaultPlan` on every call of the operations a plan names.
A plan is a list of :class:`Fault` rules; each names the operations it applies to
(``put``, ``get``, ``has``, ``delete``, ``list``, ``append``, ``read_log``), the calls
it fires on (the ``nth`` call of those operations on this tier, counted from 1, and
``count`` calls from there, or every call from there with ``count=None``), an
optional seeded ``probability``, and what it does:

- ``fail``: raise ``error`` (a :class:`~tiercheck.errors.TierError` subclass, default
  :class:`~tiercheck.errors.TierUnavailable`) instead of calling the tier;
- ``corrupt`` / ``truncate``: on ``put``/``append`` store damaged bytes (one byte flipped,
  or a prefix); on ``get`` return a damaged copy and leave the stored one intact;
- ``latency``: sleep ``seconds`` before the call;
- ``lose``: report a ``put``/``append``/``delete`` as done without doing it;
- ``hook``: call ``hook(event)`` before (or, with ``after=True``, after) the call; the
  hook may raise, record, or end the process (crash tests).

``plan.down()`` makes the tier unavailable until ``plan.up()``; ``FaultyTier.damage`` damages
a stored copy in place. Everything random comes from the plan's seed, so a plan replays
the same way given the same sequence of calls (the engine calls tiers from several threads,
so *which* blob is the Nth put can vary between runs; the count cannot).

By URL: importing this module registers ``faulty+SCHEME`` for the built-in schemes and
``file``/``s3``/``gs``/``memory`` (:func:`register_faulty_schemes` adds others). The URL
``faulty+lmdb:///data/t`` opens ``lmdb:///data/t`` wrapped in a FaultyTier; the options
``faults`` (a list of rule mappings, see :meth:`FaultPlan.from_specs`), ``seed`` and
``plan`` (a :class:`FaultPlan` object) configure it, and every other option goes to the
inner tier. See ``docs/fault-injection.md``.
"""

from __future__ import annotations

import builtins
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from tiercheck import errors
from tiercheck.backends.base import Buffer, Later, LogScan, PendingPut, Pins, Tier, scatter
from tiercheck.backends.registry import open_tier, register_tier
from tiercheck.backends.wrappers import WrapperTier
from tiercheck.errors import ConfigError, TierError, TierUnavailable

if TYPE_CHECKING:
    from tiercheck.checkpointer import Checkpointer

__all__ = [
    "ALL_OPS",
    "Fault",
    "FaultEvent",
    "FaultPlan",
    "FaultyTier",
    "WrapperTier",
    "damage_bytes",
    "inject",
    "open_faulty",
    "register_faulty_schemes",
]

Op = Literal["put", "get", "has", "delete", "list", "append", "read_log"]
Action = Literal["fail", "corrupt", "truncate", "latency", "lose", "hook"]
ALL_OPS: tuple[Op, ...] = get_args(Op)
WRITE_OPS: tuple[Op, ...] = ("put", "delete", "append")
_ACTIONS: tuple[Action, ...] = get_args(Action)
PREFIX = "faulty+"


@dataclass(frozen=True)
class FaultEvent:
    """One firing of a fault: which tier, operation, call number and blob id (or "")."""

    tier: str
    op: Op
    call: int
    key: str
    action: Action
    after: bool = False


@dataclass(eq=False)
class Fault:
    """One rule of a :class:`FaultPlan` (see the module docstring). ``active`` switches it
    off without removing it; ``fired`` counts how often it fired."""

    action: Action
    ops: tuple[Op, ...]
    nth: int = 1
    count: int | None = 1
    probability: float = 1.0
    error: type[TierError] = TierUnavailable
    seconds: float = 0.0
    hook: Callable[[FaultEvent], None] | None = None
    after: bool = False
    active: bool = True
    fired: int = 0

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ConfigError(f"unknown fault action {self.action!r}; known: {_ACTIONS}")
        bad = [op for op in self.ops if op not in ALL_OPS]
        if bad or not self.ops:
            raise ConfigError(f"fault ops must be a non-empty subset of {ALL_OPS}, got {self.ops}")
        if self.nth < 1 or (self.count is not None and self.count < 1):
            raise ConfigError(f"nth and count must be >= 1 (count may be None), got {self}")
        if not 0.0 <= self.probability <= 1.0:
            raise ConfigError(f"probability must be in [0, 1], got {self.probability}")
        if not (isinstance(self.error, type) and issubclass(self.error, TierError)):
            raise ConfigError(f"error must be a TierError subclass, got {self.error!r}")
        if self.action == "hook" and self.hook is None:
            raise ConfigError("a hook fault needs hook=callable")
        if self.after and self.action not in ("hook", "latency"):
            raise ConfigError("after=True applies to hook and latency faults only")

    def covers(self, call: int) -> bool:
        return call >= self.nth and (self.count is None or call < self.nth + self.count)


def _ops(ops: Op | Sequence[Op]) -> tuple[Op, ...]:
    return (ops,) if isinstance(ops, str) else tuple(ops)


class FaultPlan:
    """The faults a :class:`FaultyTier` injects, and the seeded randomness they use.

    ``events`` lists every firing in order. A plan may be shared by several tiers; call
    numbers are counted per tier and operation.
    """

    def __init__(self, faults: Iterable[Fault] = (), *, seed: int = 0) -> None:
        self.faults: list[Fault] = list(faults)
        self.seed = seed
        self.rng = random.Random(seed)
        self.events: list[FaultEvent] = []
        self._lock = threading.Lock()

    # --- building ------------------------------------------------------------------

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def remove(self, fault: Fault) -> None:
        with self._lock:
            if fault in self.faults:
                self.faults.remove(fault)

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def fail(
        self,
        ops: Op | Sequence[Op],
        *,
        nth: int = 1,
        count: int | None = 1,
        error: type[TierError] = TierUnavailable,
        probability: float = 1.0,
    ) -> Fault:
        """Raise ``error`` on calls ``nth`` .. ``nth + count - 1`` of ``ops``."""
        return self.add(Fault("fail", _ops(ops), nth, count, probability, error))

    def down(
        self, ops: Op | Sequence[Op] = ALL_OPS, *, count: int | None = None, nth: int = 1
    ) -> Fault:
        """Unavailable for ``count`` calls (from the ``nth``), or until :meth:`up`."""
        return self.add(Fault("fail", _ops(ops), nth, count, error=TierUnavailable))

    def up(self) -> None:
        """Switch off every ``down``/``fail`` fault raising :class:`TierUnavailable`."""
        with self._lock:
            for f in self.faults:
                if f.action == "fail" and issubclass(f.error, TierUnavailable):
                    f.active = False

    def corrupt(
        self,
        ops: Op | Sequence[Op] = "put",
        *,
        nth: int = 1,
        count: int | None = 1,
        probability: float = 1.0,
    ) -> Fault:
        """Flip one byte of what is stored (put/append) or returned (get)."""
        return self.add(Fault("corrupt", _ops(ops), nth, count, probability))

    def truncate(
        self,
        ops: Op | Sequence[Op] = "put",
        *,
        nth: int = 1,
        count: int | None = 1,
        probability: float = 1.0,
    ) -> Fault:
        """Keep only a (seeded, random) prefix of what is stored or returned."""
        return self.add(Fault("truncate", _ops(ops), nth, count, probability))

    def latency(
        self,
        seconds: float,
        ops: Op | Sequence[Op] = ALL_OPS,
        *,
        nth: int = 1,
        count: int | None = None,
        probability: float = 1.0,
    ) -> Fault:
        """Sleep ``seconds`` before each matching call."""
        return self.add(Fault("latency", _ops(ops), nth, count, probability, seconds=seconds))

    def lose(
        self,
        ops: Op | Sequence[Op] = "put",
        *,
        nth: int = 1,
        count: int | None = 1,
        probability: float = 1.0,
    ) -> Fault:
        """Report matching put/append/delete calls as done without doing them."""
        ops_t = _ops(ops)
        if any(op not in WRITE_OPS for op in ops_t):
            raise ConfigError(f"only {WRITE_OPS} can be lost, got {ops_t}")
        return self.add(Fault("lose", ops_t, nth, count, probability))

    def hook(
        self,
        fn: Callable[[FaultEvent], None],
        ops: Op | Sequence[Op] = ALL_OPS,
        *,
        nth: int = 1,
        count: int | None = None,
        after: bool = False,
    ) -> Fault:
        """Call ``fn(event)`` before (or after) each matching call."""
        return self.add(Fault("hook", _ops(ops), nth, count, hook=fn, after=after))

    @classmethod
    def from_specs(cls, specs: Iterable[Mapping[str, Any]], *, seed: int = 0) -> FaultPlan:
        """A plan from plain mappings (e.g. the ``faults`` option of a ``faulty+`` URL).

        Keys: ``action`` (required), ``op`` (a name or list, default every operation),
        ``nth``, ``count`` (``"all"`` or absent-with-``"down"`` means no end),
        ``probability``, ``error`` (a name from :mod:`tiercheck.errors`), ``seconds``.
        """
        faults = []
        for spec in specs:
            spec = dict(spec)
            unknown = set(spec) - {
                "action",
                "op",
                "nth",
                "count",
                "probability",
                "error",
                "seconds",
            }
            if unknown or "action" not in spec:
                raise ConfigError(f"bad fault spec {spec!r}: needs 'action', unknown {unknown}")
            count = spec.get("count", 1)
            error_name = spec.get("error", "TierUnavailable")
            error = getattr(errors, str(error_name), None)
            if not (isinstance(error, type) and issubclass(error, TierError)):
                raise ConfigError(f"fault error {error_name!r} is not a tiercheck TierError")
            faults.append(
                Fault(
                    action=spec["action"],
                    ops=_ops(spec.get("op", ALL_OPS)),
                    nth=int(spec.get("nth", 1)),
                    count=None if count in (None, "all") else int(count),
                    probability=float(spec.get("probability", 1.0)),
                    error=error,
                    seconds=float(spec.get("seconds", 0.0)),
                )
            )
        return cls(faults, seed=seed)

    # --- consulting ----------------------------------------------------------------

    def _matching(self, op: Op, call: int) -> list[Fault]:
        with self._lock:
            out = []
            for f in self.faults:
                if (
                    f.active
                    and op in f.ops
                    and f.covers(call)
                    and (f.probability >= 1.0 or self.rng.random() < f.probability)
                ):
                    f.fired += 1
                    out.append(f)
            return out

    def _record(self, event: FaultEvent) -> None:
        with self._lock:
            self.events.append(event)


def damage_bytes(data: Buffer, how: Literal["corrupt", "truncate"], rng: random.Random) -> bytes:
    """A damaged copy of ``data``: one byte flipped, or a strictly shorter prefix."""
    out = bytearray(data)
    if how == "truncate":
        return bytes(out[: rng.randrange(len(out))]) if out else b""
    if out:
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    else:
        out = bytearray(b"\x00")
    return bytes(out)


class FaultyTier(WrapperTier):
    """``inner`` with the faults of ``plan`` injected. Capabilities are the inner tier's.

    A :class:`~tiercheck.backends.wrappers.WrapperTier`: every call of the tier interface reaches
    the inner tier (budgets, ``usage``, vectored and batched writes, log compaction
    included); the calls of the seven operations a plan names pass through the faults
    first. ``put_parts``, ``begin_put``, ``put_many`` and ``put_many_parts`` count as one
    ``put`` per blob, ``get_parts``, ``size``, ``head`` and a read through ``pin`` as one
    ``get``. ``calls`` counts the calls made per operation. Attributes this class does not
    define are looked up on ``inner`` (e.g. an LMDB tier's ``path``).
    """

    scheme = "faulty"

    def __init__(self, inner: Tier, plan: FaultPlan | None = None) -> None:
        super().__init__(inner)
        self.plan = plan if plan is not None else FaultPlan()
        self.calls: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    @property
    def url(self) -> str:
        return PREFIX + self.inner.url

    @url.setter
    def url(self, value: str) -> None:
        self.inner.url = value.removeprefix(PREFIX)

    # --- the fault machinery -------------------------------------------------------

    def _before(self, op: Op, key: str = "") -> tuple[int, list[Fault]]:
        call, faults = self._match(op)
        self._fire_before(op, call, faults, key)
        return call, faults

    def _match(self, op: Op) -> tuple[int, list[Fault]]:
        """Count a call of ``op``; its number and the rules that fire on it."""
        with self._count_lock:
            self.calls[op] += 1
            call = self.calls[op]
        return call, self.plan._matching(op, call)

    def _fire_before(self, op: Op, call: int, faults: list[Fault], key: str) -> None:
        for f in faults:
            if f.after:
                continue
            if f.action == "latency":
                self._fire(f, op, call, key)
                time.sleep(f.seconds)
            elif f.action == "hook":
                self._fire(f, op, call, key)
                assert f.hook is not None
                f.hook(FaultEvent(self.url, op, call, key, "hook"))
        for f in faults:
            if f.action == "fail":
                self._fire(f, op, call, key)
                raise f.error(f"injected fault: {op} call {call} fails", url=self.url, key=key)

    def _after(self, op: Op, call: int, faults: list[Fault], key: str = "") -> None:
        for f in faults:
            if not f.after:
                continue
            self._fire(f, op, call, key, after=True)
            if f.action == "latency":
                time.sleep(f.seconds)
            elif f.hook is not None:
                f.hook(FaultEvent(self.url, op, call, key, "hook", after=True))

    def _fire(self, f: Fault, op: Op, call: int, key: str, *, after: bool = False) -> None:
        self.plan._record(FaultEvent(self.url, op, call, key, f.action, after))

    def _damage(self, data: Buffer, faults: list[Fault], op: Op, call: int, key: str) -> Buffer:
        for f in faults:
            if f.action in ("corrupt", "truncate"):
                self._fire(f, op, call, key)
                with self.plan._lock:
                    data = damage_bytes(data, f.action, self.plan.rng)  # type: ignore[arg-type]
        return data

    @staticmethod
    def _damages(faults: list[Fault]) -> bool:
        return any(f.action in ("corrupt", "truncate") for f in faults)

    def _lost(self, faults: list[Fault], op: Op, call: int, key: str) -> bool:
        for f in faults:
            if f.action == "lose":
                self._fire(f, op, call, key)
                return True
        return False

    def _damaged_get(self, blob_id: str) -> tuple[memoryview | None, int, list[Fault]]:
        """The ``get`` faults of one read: a damaged copy of the blob when a rule damages
        reads (else None: read the inner tier as asked), the call number, the rules."""
        call, faults = self._before("get", blob_id)
        if not self._damages(faults):
            return None, call, faults
        data = self._damage(bytes(self.inner.get(blob_id)), faults, "get", call, blob_id)
        return memoryview(data), call, faults

    def damage(self, blob_id: str, how: Literal["corrupt", "truncate"] = "corrupt") -> None:
        """Damage the stored copy of ``blob_id`` in the inner tier (seeded), bypassing faults."""
        data = bytes(self.inner.get(blob_id))
        with self.plan._lock:
            bad = damage_bytes(data, how, self.plan.rng)
        self.inner.put(blob_id, bad, overwrite=True)

    # --- Tier: the operations a plan names ---------------------------------------------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        call, faults = self._match("put")
        return self._put_one(
            blob_id,
            [data],
            call,
            faults,
            overwrite,
            lambda: self.inner.put(blob_id, data, overwrite=overwrite),
        )

    def put_parts(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool = False) -> bool:
        call, faults = self._match("put")
        return self._put_one(
            blob_id,
            parts,
            call,
            faults,
            overwrite,
            lambda: self.inner.put_parts(blob_id, parts, overwrite=overwrite),
        )

    def _put_one(
        self,
        blob_id: str,
        parts: Sequence[Buffer],
        call: int,
        faults: list[Fault],
        overwrite: bool,
        write: Callable[[], bool],
    ) -> bool:
        """One put through the rules ``faults`` of its call; ``write`` does it undamaged."""
        self._fire_before("put", call, faults, blob_id)
        if self._lost(faults, "put", call, blob_id):
            return True
        if self._damages(faults):
            data = self._damage(b"".join(parts), faults, "put", call, blob_id)
            out = self.inner.put(blob_id, data, overwrite=overwrite)
        else:
            out = write()
        self._after("put", call, faults, blob_id)
        return out

    def begin_put(self, blob_id: str, parts: Sequence[Buffer]) -> PendingPut:
        call, faults = self._before("put", blob_id)
        if self._lost(faults, "put", call, blob_id):
            return PendingPut(True)
        if self._damages(faults):
            data = self._damage(b"".join(parts), faults, "put", call, blob_id)
            pending = PendingPut(self.inner.put(blob_id, data))
        else:
            pending = self.inner.begin_put(blob_id, parts)
        return _FaultyPending(pending, lambda: self._after("put", call, faults, blob_id))

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        return self._put_batch(
            ((blob_id, [data]) for blob_id, data in items),
            lambda batch: self.inner.put_many((b, parts[0]) for b, parts in batch),
        )

    def put_many_parts(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> int:
        return self._put_batch(items, self.inner.put_many_parts)

    def _put_batch(
        self,
        items: Iterable[tuple[str, Sequence[Buffer]]],
        forward: Callable[[builtins.list[tuple[str, Sequence[Buffer]]]], int],
    ) -> int:
        """A batch of puts, forwarded as batches between the calls a rule fires on. Such a
        call is made alone, after the blobs before it were written: the Nth put fails (or
        is damaged, or ends the process) with the puts before it done, as one by one."""
        written = 0
        pending: builtins.list[tuple[str, Sequence[Buffer]]] = []
        for blob_id, parts in items:
            call, faults = self._match("put")
            if not faults:
                pending.append((blob_id, parts))
                continue
            if pending:
                written += forward(pending)
                pending = []

            def one(blob_id: str = blob_id, parts: Sequence[Buffer] = parts) -> bool:
                return forward([(blob_id, parts)]) > 0

            written += self._put_one(blob_id, parts, call, faults, False, one)
        if pending:
            written += forward(pending)
        return written

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        damaged, call, faults = self._damaged_get(blob_id)
        if damaged is not None:
            result = self._copy_out(damaged, out, self.url, blob_id)
        else:
            result = self.inner.get(blob_id, out)
        self._after("get", call, faults, blob_id)
        return result

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        damaged, call, faults = self._damaged_get(blob_id)
        n = scatter(damaged, parts) if damaged is not None else self.inner.get_parts(blob_id, parts)
        self._after("get", call, faults, blob_id)
        return n

    def pin(self) -> Pins | None:
        inner = self.inner.pin()
        return None if inner is None else _FaultyPins(self, inner)

    def size(self, blob_id: str) -> int:
        damaged, call, faults = self._damaged_get(blob_id)
        n = len(damaged) if damaged is not None else self.inner.size(blob_id)
        self._after("get", call, faults, blob_id)
        return n

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        damaged, call, faults = self._damaged_get(blob_id)
        data = bytes(damaged[:nbytes]) if damaged is not None else self.inner.head(blob_id, nbytes)
        self._after("get", call, faults, blob_id)
        return data

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        call, faults = self._before("has")
        out = self.inner.has(blob_ids)
        self._after("has", call, faults)
        return out

    def delete(self, blob_ids: Iterable[str]) -> int:
        ids = builtins.list(blob_ids)
        call, faults = self._before("delete")
        if self._lost(faults, "delete", call, ""):
            return len(ids)
        out = self.inner.delete(ids)
        self._after("delete", call, faults)
        return out

    def list(self) -> Iterator[str]:
        call, faults = self._before("list")
        out = builtins.list(self.inner.list())
        self._after("list", call, faults)
        return iter(out)

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        call, faults = self._before("append")
        if self._lost(faults, "append", call, ""):
            return
        record = bytes(self._damage(record, faults, "append", call, ""))
        self.inner.append(record, blobs=blobs)
        self._after("append", call, faults)

    def read_log(self) -> builtins.list[bytes]:
        call, faults = self._before("read_log")
        out = self.inner.read_log()
        self._after("read_log", call, faults)
        return out

    def scan_log(self) -> LogScan:
        call, faults = self._before("read_log")
        out = self.inner.scan_log()
        self._after("read_log", call, faults)
        return out


class _FaultyPending(PendingPut):
    """A :class:`PendingPut` of the inner tier whose ``after`` faults fire once it is
    finished (the put is complete only then)."""

    def __init__(self, pending: PendingPut, after: Callable[[], None]) -> None:
        self._pending = pending
        self._after = after

    def finish(self) -> bool:
        out = self._pending.finish()
        self._after()
        return out

    def abort(self) -> None:
        self._pending.abort()


class _FaultyPins(Pins):
    """The inner tier's pins, each blob read in place counting as one ``get`` of the plan
    (a damaged read gives a damaged copy, as :meth:`FaultyTier.get` does)."""

    def __init__(self, tier: FaultyTier, inner: Pins) -> None:
        self._tier = tier
        self._inner = inner

    def get(self, blob_id: str) -> memoryview:
        damaged, call, faults = self._tier._damaged_get(blob_id)
        view = damaged if damaged is not None else self._inner.get(blob_id)
        self._tier._after("get", call, faults, blob_id)
        return view

    def parts(self, blob_id: str, head: int) -> tuple[memoryview, memoryview, int]:
        damaged, call, faults = self._tier._damaged_get(blob_id)
        if damaged is not None:
            got = (damaged[:head], damaged[head:], len(damaged))
        else:
            got = self._inner.parts(blob_id, head)
        self._tier._after("get", call, faults, blob_id)
        return got

    def close(self, later: Later | None = None) -> None:
        self._inner.close(later)


def open_faulty(
    url: str,
    *,
    faults: Iterable[Mapping[str, Any]] = (),
    seed: int = 0,
    plan: FaultPlan | None = None,
    **options: Any,
) -> FaultyTier:
    """Open ``faulty+INNER_URL``: the inner tier (with ``options``) wrapped in a FaultyTier."""
    if not url.lower().startswith(PREFIX):
        raise errors.InvalidURL(f"expected {PREFIX}SCHEME://..., got {url!r}", url=url)
    inner = open_tier(url[len(PREFIX) :], **options)
    if plan is None:
        plan = FaultPlan.from_specs(faults, seed=seed)
    elif faults:
        raise ConfigError("pass either plan= or faults=, not both")
    return FaultyTier(inner, plan)


def inject(ckpt: Checkpointer, name: str, plan: FaultPlan | None = None) -> FaultPlan:
    """Put tier ``name`` of the open store ``ckpt`` behind ``plan`` (a new empty plan if
    None), in place: for a plan that cannot go in a config (hooks). Returns the plan."""
    plan = plan if plan is not None else FaultPlan()
    slot = ckpt.tierset.get(name)
    if slot.tier is None:
        raise ConfigError(f"tier {name!r} is not open: there is nothing to inject faults into")
    slot.tier = FaultyTier(slot.tier, plan)
    return plan


DEFAULT_SCHEMES = ("memory", "shm", "lmdb", "peer", "file", "s3", "gs")


def register_faulty_schemes(schemes: Iterable[str] = DEFAULT_SCHEMES) -> None:
    """Register ``faulty+SCHEME`` URLs for each scheme (idempotent)."""
    for scheme in schemes:
        register_tier(PREFIX + scheme, open_faulty)


register_faulty_schemes()
