"""Memory tiers inside a budget: a write that does not fit raises OverBudget and writes
nothing; usage() counts what is held; /dev/shm's free space is checked before writing."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercheck.backends import open_tier
from tiercheck.backends._shm import ShmTier
from tiercheck.backends._shm_segments import shm_free_bytes
from tiercheck.core.sizes import format_size, parse_size
from tiercheck.errors import InvalidURL, OverBudget, TierFull
from tiercheck.testing.conformance import blob


@pytest.fixture
def shm_root(tmp_path: Path) -> Iterator[Path]:
    """A root in real shared memory where there is one (the free-space check is real)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        root = Path("/dev/shm") / f"tiercheck-budget-{uuid.uuid4().hex}"
    else:
        root = tmp_path / "shm"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8GiB", 8 << 30),
        ("8 GiB", 8 << 30),
        ("512MiB", 512 << 20),
        ("1G", 1 << 30),
        ("1GB", 10**9),
        ("10kb", 10_000),
        ("1.5M", 3 << 19),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_sizes(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1 Qi", "12 apples", "1e3", True])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]


def test_format_size() -> None:
    assert [format_size(n) for n in (10, 1536, 3 << 30)] == ["10 B", "1.5 KiB", "3.0 GiB"]


def test_shm_budget(shm_root: Path) -> None:
    with open_tier("shm://b", root=shm_root, budget="1MiB") as tier:
        assert isinstance(tier, ShmTier)
        a, data_a = blob(600_000, seed=1)
        b, data_b = blob(600_000, seed=2)
        assert tier.put(a, data_a)
        assert tier.usage() == 600_000
        with pytest.raises(OverBudget) as info:
            tier.put(b, data_b)
        assert isinstance(info.value, TierFull)  # handled wherever TierFull is
        assert (info.value.needed, info.value.held, info.value.budget) == (
            600_000,
            600_000,
            1 << 20,
        )
        assert "budget" in str(info.value) and "keep_bases" in str(info.value)
        assert tier.has([a, b]) == {a} and tier.usage() == 600_000
        assert os.listdir(Path(tier.path) / "tmp") == []  # nothing half-written
        with pytest.raises(OverBudget):
            tier.append(b"record", blobs=[(b, data_b)])
        assert tier.read_log() == []  # the record waits for its blobs, which did not fit
        # an overwrite needs only the difference; a delete makes room
        assert tier.put(a, data_a, overwrite=True)
        assert tier.delete([a]) == 1 and tier.usage() == 0
        assert tier.pool_bytes == 600_000  # a's pages, kept for the next put
        assert tier.put(b, data_b) and tier.usage() == 600_000
        assert tier.segments_reused == 1 and tier.pool_bytes == 0  # b reused a's pages
        c, data_c = blob(300_000, seed=3)
        assert tier.put(c, data_c) and tier.delete([c]) == 1
        assert tier.usage() + tier.pool_bytes <= 1 << 20  # pool trimmed to the budget
        d, data_d = blob(400_000, seed=4)
        assert tier.put(d, data_d) and tier.usage() + tier.pool_bytes <= 1 << 20
    with open_tier("shm://b", root=shm_root, budget=1 << 20) as again:
        assert again.usage() == 1_000_000  # counted again at open (b and d)


def test_shm_refuses_a_write_past_the_free_memory(shm_root: Path) -> None:
    """A put bigger than what the file system has free is refused before a byte is written
    (no allocation is needed to ask: the parts are views of one small buffer)."""
    with open_tier("shm://free", root=shm_root) as tier:
        assert isinstance(tier, ShmTier)
        # bigger than the whole file system, not only than what is free now: another
        # process freeing memory meanwhile must not let the put start writing
        st = os.statvfs(tier.path)
        assert shm_free_bytes(tier.path) <= st.f_blocks * st.f_frsize
        piece = memoryview(bytearray(1 << 20))
        parts = [piece] * (st.f_blocks * st.f_frsize // len(piece) + 2)
        bid = "ab" * 32
        with pytest.raises(OverBudget, match="free"):
            tier.put_parts(bid, parts)
        assert tier.has([bid]) == set() and tier.usage() == 0
        assert os.listdir(Path(tier.path) / "tmp") == []


def test_memory_budget() -> None:
    tier = open_tier("memory://", budget="1KiB")
    a, data_a = blob(800, seed=1)
    tier.put(a, data_a)
    with pytest.raises(OverBudget):
        tier.put(*blob(300, seed=2))
    assert tier.usage() == 800


def test_bad_budget_is_an_invalid_url(shm_root: Path) -> None:
    with pytest.raises(InvalidURL, match="budget"):
        open_tier("shm://x", root=shm_root, budget="lots")


def test_set_budget_at_run_time(shm_root: Path) -> None:
    """The engine sets a default budget once it knows the state's size."""
    with open_tier("shm://late", root=shm_root) as tier:
        a, data_a = blob(600_000, seed=1)
        tier.put(a, data_a)
        tier.set_budget("1MiB")
        with pytest.raises(OverBudget):
            tier.put(*blob(600_000, seed=2))
        tier.set_budget(None)
        assert tier.put(*blob(600_000, seed=2))
    mem = open_tier("memory://")
    mem.set_budget(100)
    with pytest.raises(OverBudget):
        mem.put(*blob(101, seed=3))
