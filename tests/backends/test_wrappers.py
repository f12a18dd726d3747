"""WrapperTier: a wrapped tier passes the whole conformance suite, and every call of the
tier interface (those with a default in the base class included) reaches the inner tier."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiercheck.backends._memory import MemoryTier
from tiercheck.backends.base import Capabilities, FailureDomain, StoreOwner, Tier
from tiercheck.backends.registry import open_tier
from tiercheck.backends.wrappers import WrapperTier
from tiercheck.testing.conformance import TierConformance, blob
from tiercheck.testing.faults import FaultyTier


class TestWrappedLmdb(TierConformance):  # type: ignore[misc,unused-ignore]
    """LMDB: batched transactional writes, vectored reads, log compaction, no budget."""

    def make_tier(self, tmp_path: Path) -> Tier:
        return WrapperTier(open_tier(f"lmdb://{tmp_path / 'lmdb'}"))

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return WrapperTier(open_tier(tier.url))

    def open_read_only(self, tier: Tier) -> Tier:
        return WrapperTier(open_tier(tier.url, read_only=True))


class TestWrappedMemory(TierConformance):  # type: ignore[misc,unused-ignore]
    """memory://: usage() counted, a budget, log compaction."""

    def make_tier(self, tmp_path: Path) -> Tier:
        return WrapperTier(open_tier(f"memory://wrapped-{uuid.uuid4().hex}"))

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return WrapperTier(open_tier(tier.url))

    def open_read_only(self, tier: Tier) -> Tier:
        return WrapperTier(open_tier(tier.url, read_only=True))


class TestWrappedFile(TierConformance):  # type: ignore[misc,unused-ignore]
    """file://: vectored writes made durable in ``PendingPut.finish`` (begin_put)."""

    def make_tier(self, tmp_path: Path) -> Tier:
        return WrapperTier(open_tier(f"file://{tmp_path / 'remote'}"))

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return WrapperTier(open_tier(tier.url))

    def open_read_only(self, tier: Tier) -> Tier:
        return WrapperTier(open_tier(tier.url, read_only=True))


# --- every call is forwarded --------------------------------------------------------------


def _instance_attributes(base: type[Tier]) -> set[str]:
    """The attributes ``base.__init__`` sets on an instance (``url``, ``capabilities``, ...)."""
    stubs: dict[str, Any] = {name: lambda *a, **k: None for name in base.__abstractmethods__}
    bare = type("Bare", (base,), stubs)
    caps = Capabilities(survives=FailureDomain.NONE, shared=False, persistent=False, speed_rank=0)
    return {n for n in vars(bare("bare://", capabilities=caps)) if not n.startswith("_")}


def interface(base: type[Tier] = Tier) -> set[str]:
    """Every public method, property and instance attribute of the tier interface, and the
    context-manager protocol."""
    names = {n for n in dir(base) if not n.startswith("_") and n != "scheme"}
    return names | _instance_attributes(base) | {"__enter__", "__exit__"}


def unforwarded(wrapper: type[Tier], base: type[Tier] = Tier) -> list[str]:
    """What ``wrapper`` inherits from the base class instead of forwarding."""
    return sorted(n for n in interface(base) if n not in vars(wrapper))


def test_every_tier_method_is_forwarded() -> None:
    """Fails when a method is added to Tier and not to WrapperTier: a wrapper inheriting
    the base's default silently replaces the inner tier's own (a budget, a vectored write)."""
    assert unforwarded(WrapperTier) == []
    assert {"put", "begin_put", "usage", "set_budget", "replace_log_prefix", "url"} <= interface()


def test_the_check_sees_a_method_added_to_the_interface() -> None:
    class Grown(Tier):  # type: ignore[misc,unused-ignore]
        def evict(self) -> None:
            """A call added to the interface later."""

    assert unforwarded(WrapperTier, Grown) == ["evict"]


class _Recording(MemoryTier):  # type: ignore[misc,unused-ignore]
    """A memory tier that records which interface call was made on it first."""

    def __init__(self, url: str) -> None:
        self.seen: list[str] = []
        super().__init__(url)

    def __getattribute__(self, name: str) -> Any:
        if name in _METHODS:
            object.__getattribute__(self, "seen").append(name)
        return super().__getattribute__(name)


ID, DATA = blob(300, seed=1)
OTHER, OTHER_DATA = blob(200, seed=2)

# One call per method of the interface, made on the wrapper.
CALLS: dict[str, Callable[[Tier], object]] = {
    "put": lambda t: t.put(OTHER, OTHER_DATA),
    "put_parts": lambda t: t.put_parts(OTHER, [OTHER_DATA[:5], OTHER_DATA[5:]]),
    "begin_put": lambda t: t.begin_put(OTHER, [OTHER_DATA]).finish(),
    "put_many": lambda t: t.put_many([(OTHER, OTHER_DATA)]),
    "put_many_parts": lambda t: t.put_many_parts([(OTHER, [OTHER_DATA])]),
    "get": lambda t: t.get(ID),
    "get_parts": lambda t: t.get_parts(ID, [memoryview(bytearray(300))]),
    "pin": lambda t: t.pin(),
    "staging_area": lambda t: t.staging_area([(0, 4096)], 4096),
    "has": lambda t: t.has([ID]),
    "delete": lambda t: t.delete([OTHER]),
    "list": lambda t: list(t.list()),
    "size": lambda t: t.size(ID),
    "head": lambda t: t.head(ID, 8),
    "append": lambda t: t.append(b"rec"),
    "read_log": lambda t: t.read_log(),
    "scan_log": lambda t: t.scan_log(),
    "written_at": lambda t: t.written_at([ID]),
    "replace_log_prefix": lambda t: t.replace_log_prefix(1, b"checkpoint"),
    "usage": lambda t: t.usage(),
    "set_budget": lambda t: t.set_budget("1MiB"),
    "free_memory": lambda t: t.free_memory(),
    "preallocate": lambda t: t.preallocate([4096]),
    "read_owner": lambda t: t.read_owner(),
    "write_owner": lambda t: t.write_owner(StoreOwner("0" * 32, "/nonexistent/store", "h")),
    "claim_owner": lambda t: t.claim_owner(StoreOwner("0" * 32, "/nonexistent/store", "h")),
    "bind_store": lambda t: t.bind_store("/nonexistent/store"),
    "flush": lambda t: t.flush(),
    "close": lambda t: t.close(),
    "unmake": lambda t: t.unmake(),
}
_METHODS = frozenset(CALLS)


def test_every_call_reaches_the_inner_tier() -> None:
    assert set(CALLS) | {"url", "capabilities", "read_only", "__enter__", "__exit__"} == (
        interface()
    ), "a Tier method has no call in CALLS: add one"
    for name, call in CALLS.items():
        inner = _Recording(f"memory://wrapped-{uuid.uuid4().hex}")
        inner.put(ID, DATA)
        inner.append(b"first")
        inner.seen = []
        call(WrapperTier(inner))
        assert inner.seen[:1] == [name], f"{name} did not reach the inner tier: {inner.seen}"
        MemoryTier.discard(inner.name)


def test_declarations_and_budget_are_the_inner_tiers() -> None:
    inner = open_tier("memory://", budget="1MiB")
    wrapped = WrapperTier(inner)
    assert (wrapped.url, wrapped.capabilities, wrapped.read_only) == (
        inner.url,
        inner.capabilities,
        inner.read_only,
    )
    assert wrapped.budget == 1 << 20
    wrapped.set_budget("2MiB")
    assert wrapped.budget == inner.budget == 2 << 20  # type: ignore[attr-defined,unused-ignore]
    wrapped.put(ID, DATA)
    assert wrapped.usage() == inner.usage() and inner.usage()
    with wrapped:
        pass


@pytest.mark.parametrize("wrapper", [WrapperTier, FaultyTier])
def test_a_budget_set_through_a_wrapper_bounds_the_inner_tier(
    wrapper: Callable[[Tier], Tier],
) -> None:
    """What the engine does with a memory tier (set its default budget, compare usage with
    it) works through any wrapper, FaultyTier included."""
    from tiercheck.errors import OverBudget
    from tiercheck.store.budgets import budget_of

    tier = wrapper(open_tier("memory://"))
    tier.set_budget(1000)
    assert budget_of(tier) == 1000
    with pytest.raises(OverBudget):
        tier.put(*blob(2000, seed=3))
    tier.put(ID, DATA)
    assert (tier.usage() or 0) >= len(DATA)


def test_the_default_budget_sees_the_memory_behind_a_wrapped_tier() -> None:
    """The default budget's free-memory term is the wrapped tier's (it was unknown through
    a wrapper, so a wrapped shm tier got 2 x V + 1 MiB whatever /dev/shm had free)."""
    from tiercheck.backends import remove_segment
    from tiercheck.store.budgets import free_memory

    tier = open_tier(f"shm://wrapped-{uuid.uuid4().hex[:12]}")
    try:
        assert free_memory(tier) is not None
        assert free_memory(FaultyTier(tier)) is not None
        assert free_memory(WrapperTier(WrapperTier(tier))) is not None
    finally:
        path = tier.path  # type: ignore[attr-defined]
        tier.close()
        remove_segment(path)
