"""The shm tier: conformance suite, segment reuse, recovery after a crash, ENOSPC."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercheck.backends import _shm
from tiercheck.backends._shm import ShmTier
from tiercheck.backends._shm_segments import KEEP_FRESH_BYTES
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import InvalidURL, ReadOnlyTier, TierFull, TierLost
from tiercheck.formats.framing import frame_record
from tiercheck.testing.conformance import TierConformance, blob


def shm_root(tmp_path: Path) -> Path:
    """A per-test root in real shared memory where there is one, else under tmp_path."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm") / f"tiercheck-test-{uuid.uuid4().hex}"
    return tmp_path / "shm"


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = shm_root(tmp_path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class TestShmTier(TierConformance):
    @pytest.fixture(autouse=True)
    def _root(self, root: Path) -> None:
        self.root = root

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier("shm://store", root=self.root)

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return open_tier(tier.url, root=self.root)

    def open_read_only(self, tier: Tier) -> Tier:
        return open_tier(tier.url, root=self.root, read_only=True)


def _open(root: Path, name: str = "t", **options: object) -> ShmTier:
    tier = open_tier(f"shm://{name}", root=root, **options)
    assert isinstance(tier, ShmTier)
    return tier


def _tmp_files(tier: ShmTier) -> list[str]:
    return os.listdir(os.path.join(tier.path, "tmp"))


def test_layout(root: Path) -> None:
    with _open(root, "lay") as tier:
        bid, data = blob(100)
        tier.put(bid, data)
        tier.append(b"r")
        assert sorted(os.listdir(root / "lay")) == ["blobs", "log", "owner.json", "pool", "tmp"]
        assert os.listdir(root / "lay" / "blobs") == [bid]
        assert (root / "lay" / "log").read_bytes() == frame_record(b"r")


def test_delete_then_put_reuses_segment(root: Path) -> None:
    with _open(root) as tier:
        a, data_a = blob(1 << 20, seed=1)
        tier.put(a, data_a)
        inode = os.stat(os.path.join(tier.path, "blobs", a)).st_ino
        assert tier.delete([a]) == 1
        assert tier.pool_bytes == 1 << 20
        assert os.listdir(os.path.join(tier.path, "pool")) != []

        b, data_b = blob((1 << 20) - 100, seed=2)  # a bit smaller: truncated segment
        assert tier.put(b, data_b) is True
        assert tier.segments_reused == 1
        assert os.stat(os.path.join(tier.path, "blobs", b)).st_ino == inode
        assert bytes(tier.get(b)) == data_b
        assert tier.size(b) == len(data_b)
        assert tier.pool_bytes == 0
        assert os.listdir(os.path.join(tier.path, "pool")) == []
        assert _tmp_files(tier) == []


def test_pool_best_fit_and_growth(root: Path) -> None:
    with _open(root) as tier:
        small, big = blob(1000, seed=1), blob(100_000, seed=2)
        tier.put(*small)
        tier.put(*big)
        tier.delete([small[0], big[0]])
        # A 50 kB blob takes the 100 kB segment (smallest that fits), not the 1 kB one.
        mid = blob(50_000, seed=3)
        tier.put(*mid)
        assert tier.pool_bytes == 1000
        # A blob bigger than every segment still reuses one, and grows it.
        huge = blob(300_000, seed=4)
        tier.put(*huge)
        assert tier.segments_reused == 2
        assert bytes(tier.get(huge[0])) == huge[1]
        assert bytes(tier.get(mid[0])) == mid[1]


def test_pool_survives_reopen_and_limit(root: Path) -> None:
    with _open(root) as tier:
        items = [blob(4096, seed=i) for i in range(4)]
        tier.put_many(items)
        tier.delete(bid for bid, _ in items)
    with _open(root, pool_limit=8192) as tier:
        assert tier.pool_bytes == 4 * 4096  # pooled segments found again at open
        tier.put(*blob(4096, seed=10))
        assert tier.segments_reused == 1
        assert tier.trim_pool(keep_bytes=4096) == 8192
        assert len(os.listdir(os.path.join(tier.path, "pool"))) == 1
        extra = [blob(4096, seed=20 + i) for i in range(3)]
        tier.put_many(extra)
        tier.delete(bid for bid, _ in extra)
        assert tier.pool_bytes == 8192  # the limit: the third delete freed its memory


def test_preallocate_pools_written_pages_within_the_budget(root: Path) -> None:
    """Checkpointer.prepare's call: each segment's pages are allocated now (st_blocks), a
    put of that size takes one and creates nothing, and blobs plus pool stay within the
    budget: the size that would pass it and every size after it are left out."""
    size = 256 * 1024
    with _open(root, budget=3 * size + 100) as tier:
        assert tier.preallocate([size, size, size, size, 10]) == 3 * size
        pooled = [os.path.join(tier.path, "pool", n) for n in os.listdir(tier.path + "/pool")]
        assert len(pooled) == 3
        for path in pooled:
            st = os.stat(path)
            assert st.st_size == size
            assert st.st_blocks * 512 >= size  # written: no page left to fault in later
        assert tier.usage() == 0 and tier.pool_bytes == 3 * size
        items = [blob(size, seed=i) for i in range(2)]
        tier.put_many(items)
        assert (tier.segments_reused, tier.segments_created) == (2, 0)
        assert tier.usage() == 2 * size and tier.pool_bytes == size
        assert [bytes(tier.get(bid)) for bid, _ in items] == [data for _, data in items]
        assert tier.preallocate([size]) == 0  # blobs plus pool are at the budget
        assert _tmp_files(tier) == []
    with _open(root, read_only=True) as reader, pytest.raises(ReadOnlyTier):
        reader.preallocate([size])


def test_preallocate_stops_when_shm_is_full(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process took the memory between the check and the write: ENOSPC ends the
    preallocation with what it made, leaves no partial segment and raises nothing."""
    with _open(root) as tier:
        real_write = _shm._write_all
        writes = 0

        def write_all(fd: int, data: memoryview, offset: int) -> None:
            nonlocal writes
            writes += 1
            if writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(fd, data, offset)

        monkeypatch.setattr(_shm, "_write_all", write_all)
        assert tier.preallocate([4096, 4096, 4096]) == 4096
        assert tier.pool_bytes == 4096
        assert _tmp_files(tier) == []


def test_torn_log_tail_is_ignored_then_truncated(root: Path) -> None:
    with _open(root) as tier:
        tier.append(b"one")
        tier.append(b"two")
        log = Path(tier.path) / "log"
    whole = log.read_bytes()
    torn = frame_record(b"three, never acknowledged")[:-3]
    log.write_bytes(whole + torn)
    with _open(root, read_only=True) as ro:
        assert ro.read_log() == [b"one", b"two"]
    assert log.read_bytes() == whole + torn  # a reader does not repair
    with _open(root) as tier:
        assert log.read_bytes() == whole  # a writer does, before appending
        tier.append(b"four")
        assert tier.read_log() == [b"one", b"two", b"four"]


def test_dead_writer_tmp_files_are_recycled(root: Path) -> None:
    with _open(root) as tier:
        bid, data = blob(5000)
        tier.put(bid, data)
        tmp = Path(tier.path) / "tmp"
        blobs = Path(tier.path) / "blobs"
    # A dead pid (pid_max is below 2**22) left a half-written segment and, separately,
    # died between linking a blob into place and unlinking its temp name.
    (tmp / "4194304.1.0").write_bytes(b"partial")
    os.link(blobs / bid, tmp / "4194304.1.1")
    with _open(root) as tier:
        assert _tmp_files(tier) == []
        assert tier.pool_bytes == len(b"partial")
        assert bytes(tier.get(bid)) == data  # the linked blob was not pooled
        other = blob(5000, seed=9)
        tier.put(*other)
        assert bytes(tier.get(bid)) == data


def test_put_enospc_raises_tier_full_and_cleans_up(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _open(root) as tier:

        def full(fd: int, data: memoryview, offset: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(_shm, "_write_all", full)
        bid, data = blob(1000)
        with pytest.raises(TierFull) as info:
            tier.put(bid, data)
        assert bid in str(info.value) and tier.url in str(info.value)
        assert _tmp_files(tier) == []
        assert tier.has([bid]) == set()
        with pytest.raises(TierFull):
            tier.append(b"rec")
        monkeypatch.undo()
        assert tier.read_log() == []
        tier.append(b"rec")
        assert tier.read_log() == [b"rec"]


def test_append_failure_mid_write_leaves_no_torn_frame(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _shm._write_all

    def half_then_full(fd: int, data: memoryview, offset: int) -> None:
        real(fd, data[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "full")

    with _open(root) as tier:
        tier.append(b"first")
        monkeypatch.setattr(_shm, "_write_all", half_then_full)
        with pytest.raises(TierFull):
            tier.append(b"second record, long enough to tear" * 10)
        monkeypatch.undo()
        tier.append(b"third")
        assert tier.read_log() == [b"first", b"third"]


@pytest.mark.parametrize(
    "url", ["shm://", "shm://a/b", "shm://../x", "shm://.hidden", "shm://a b", "shm://x?y"]
)
def test_bad_urls(url: str, root: Path) -> None:
    with pytest.raises(InvalidURL):
        open_tier(url, root=root)


def test_read_only_needs_existing_store(root: Path) -> None:
    with pytest.raises(TierLost):
        _open(root, "absent", read_only=True)
    assert not (root / "absent").exists()


def test_read_only_trim_and_writes(root: Path) -> None:
    _open(root).close()
    with _open(root, read_only=True) as ro:
        with pytest.raises(ReadOnlyTier):
            ro.put(*blob(1))
        assert ro.read_log() == []


def test_damaged_frame_in_the_middle_keeps_later_records(root: Path) -> None:
    """Damage to one record (a flipped byte, not a torn write) hides that record only:
    readers skip it, and a writable open keeps every valid record after it."""
    records = [b"one", b"two" * 50, b"three", b"four"]
    with _open(root) as tier:
        for rec in records:
            tier.append(rec)
        log = Path(tier.path) / "log"
    data = bytearray(log.read_bytes())
    data[len(frame_record(records[0])) + 20] ^= 0xFF  # inside the payload of "two..."
    log.write_bytes(bytes(data))
    with _open(root, read_only=True) as ro:
        assert ro.read_log() == [b"one", b"three", b"four"]
    with _open(root) as tier:
        assert log.read_bytes() == bytes(data)  # nothing cut
        tier.append(b"five")
        assert tier.read_log() == [b"one", b"three", b"four", b"five"]
    # a damaged length field: the reader finds the next intact frame by its magic
    data = bytearray(log.read_bytes())
    data[len(frame_record(records[0])) + 2] ^= 0x7F
    log.write_bytes(bytes(data))
    with _open(root) as tier:
        assert tier.read_log() == [b"one", b"three", b"four", b"five"]


def test_compaction_replaces_the_log_file_under_an_open_appender(root: Path) -> None:
    """A second instance appending to the store keeps appending to the live log after
    another instance compacted it (it reopens the renamed file)."""
    with _open(root) as first, _open(root) as second:
        for i in range(5):
            first.append(f"r{i}".encode())
        second.append(b"from second")
        first.replace_log_prefix(4, b"checkpoint")
        second.append(b"after compaction")
        assert first.read_log() == [b"checkpoint", b"r4", b"from second", b"after compaction"]
        assert not (Path(first.path) / "log.compact").exists()


# --- kept mappings ---------------------------------------------------------------------


def _mapped(tier: ShmTier) -> list[str]:
    """The lines of /proc/self/maps that name a file of ``tier``'s segment."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if tier.path in line]


def _stale(tier: ShmTier) -> list[str]:
    """Mappings of files the segment no longer has (their inode in none of its directories;
    the path a line shows may be a temporary name since replaced by a link)."""
    live = {
        e.inode() for d in ("blobs", "pool", "tmp") for e in os.scandir(os.path.join(tier.path, d))
    }
    return [line for line in _mapped(tier) if int(line.split()[4]) not in live]


def _cycle(tier: ShmTier, rounds: int, seed: int = 0) -> None:
    """``rounds`` of: put four 1 MiB blobs, read each back exact, delete them."""
    for r in range(rounds):
        items = [blob(1 << 20, seed=seed + 10 * r + i) for i in range(4)]
        tier.put_many(items)
        for bid, data in items:
            assert bytes(tier.get(bid)) == data
        tier.delete(bid for bid, _ in items)


def test_a_reused_segment_is_written_through_its_kept_mapping(root: Path) -> None:
    """A put into a fresh segment of a chunk's size writes with pwrite and maps the file;
    its reuse copies through that mapping. Every blob reads back exact, a smaller one in a
    larger segment too, and a blob larger than the segment's pages or its mapping goes
    through pwrite (never a mapped write past the pages the file has)."""
    with _open(root) as tier:
        _cycle(tier, 1)
        assert tier._kept.writes == 0 and len(tier._kept) == 4
        _cycle(tier, 1, seed=100)
        assert tier._kept.writes == 4
        small = blob((1 << 20) - 100, seed=200)  # truncates a mapped segment
        tier.put(*small)
        assert tier._kept.writes == 5 and bytes(tier.get(small[0])) == small[1]
        big = blob(2 << 20, seed=201)  # grows a segment: pwrite
        tier.put(*big)
        assert tier._kept.writes == 5 and bytes(tier.get(big[0])) == big[1]
        tier.delete([small[0], big[0]])
        tier.trim_pool(keep_bytes=2 << 20)  # the grown segment stays, its mapping 1 MiB
        assert tier.pool_bytes == 2 << 20
        past = blob((1 << 20) + 4096, seed=202)  # within its pages, past its mapping
        tier.put(*past)
        assert tier._kept.writes == 5 and bytes(tier.get(past[0])) == past[1]


def test_a_one_off_segment_is_mapped_only_once_reused(root: Path) -> None:
    """A fresh segment shorter than ``KEEP_FRESH_BYTES`` (a manifest's) is not mapped at
    its first put (most are never reused: a mapping would hold a descriptor for nothing);
    one of a chunk's size is, for the saves that reuse it and a restore in this process
    (tests/test_restore_in_place.py)."""
    with _open(root) as tier:
        tiny = blob(4096, seed=300)
        tier.put(*tiny)
        assert len(tier._kept) == 0
        tier.delete([tiny[0]])
        tier.put(*blob(4096, seed=301))  # its segment reused: mapped now
        assert len(tier._kept) == 1
        tier.put(*blob(KEEP_FRESH_BYTES, seed=302))
        assert len(tier._kept) == 2


def test_no_kept_mapping_outlives_its_file(root: Path) -> None:
    """A kept mapping holds its file's pages: one left on a deleted file would be memory
    nobody counts. None is left after segments are freed past the pool's limit, by
    trim_pool, by an overwrite replacing a blob, or by close."""
    with _open(root, pool_limit=2 << 20) as tier:  # two of four deleted segments freed
        _cycle(tier, 4)
        assert _mapped(tier)
        assert _stale(tier) == []
        _cycle(tier, 1, seed=50)
        kept = blob(1 << 20, seed=60)
        tier.put(*kept)  # into a mapped segment
        assert tier.put(kept[0], blob(1 << 20, seed=61)[1], overwrite=True)
        assert _stale(tier) == []
        tier.trim_pool(keep_bytes=0)
        assert _stale(tier) == []
    assert _mapped(tier) == []


def test_a_forked_child_inherits_no_kept_mapping(root: Path) -> None:
    """A DataLoader worker forked by the trainer must not hold the store's pages."""
    with _open(root) as tier:
        _cycle(tier, 3)
        assert _mapped(tier)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it maps, and go
            os.write(write, str(len(_mapped(tier))).encode())
            os._exit(0)
        os.close(write)
        seen = int(os.read(read, 64))
        os.close(read)
        os.waitpid(pid, 0)
        assert seen == 0


def test_a_mapped_write_stays_inside_the_pages_the_file_has(root: Path) -> None:
    """A segment truncated below its mapping and then reused for a blob longer than it
    now is: the blob grows the file with pwrite. A write through the mapping past the
    file's end would be SIGBUS (the page has no file behind it), not an error."""
    with _open(root) as tier:
        bid, data = blob(1 << 20, seed=0)  # the first put maps the segment
        tier.put(bid, data)
        tier.delete([bid])
        assert len(tier._kept) == 1 and tier._kept.writes == 0
        short = blob((1 << 20) - 4096, seed=10)  # the file ends a page before its mapping
        tier.put(*short)
        tier.delete([short[0]])
        whole = blob(1 << 20, seed=11)
        tier.put(*whole)
        assert bytes(tier.get(whole[0])) == whole[1]
        assert tier._kept.writes == 1  # the short one only
