"""The memory tier: conformance suite plus its naming rules."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tiercheck.backends._memory import MemoryTier
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import InvalidURL
from tiercheck.testing.conformance import TierConformance, blob


class TestMemoryTier(TierConformance):
    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(f"memory://test-{uuid.uuid4().hex}")

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return open_tier(tier.url)


class TestPrivateMemoryTier(TierConformance):
    reopenable = False
    supports_read_only = False

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier("memory://")


def test_named_stores_are_shared_and_discardable() -> None:
    name = f"shared-{uuid.uuid4().hex}"
    a = open_tier(f"memory://{name}")
    b = open_tier(f"memory://{name}")
    bid, data = blob(10)
    a.put(bid, data)
    a.append(b"r")
    assert bytes(b.get(bid)) == data
    assert b.read_log() == [b"r"]
    assert MemoryTier.discard(name) is True
    assert MemoryTier.discard(name) is False
    c = open_tier(f"memory://{name}")
    assert c.read_log() == []
    assert bytes(a.get(bid)) == data  # open tiers keep their store


def test_private_stores_are_separate() -> None:
    a, b = open_tier("memory://"), open_tier("memory://")
    bid, data = blob(10)
    a.put(bid, data)
    assert b.has([bid]) == set()


@pytest.mark.parametrize("url", ["memory://x?y=1", "memory://a#b", "memory://a\nb"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(InvalidURL):
        open_tier(url)


def test_unknown_option() -> None:
    with pytest.raises(InvalidURL):
        open_tier("memory://x", colour="blue")
