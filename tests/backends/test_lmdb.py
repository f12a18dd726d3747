"""The LMDB tier: conformance suite, map growth, max_size, URLs, read-only opening."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import _fresh
import lmdb
import pytest

from tiercheck.backends import _lmdb, _lmdb_env
from tiercheck.backends._lmdb import LmdbTier
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import InvalidURL, ReadOnlyTier, TierError, TierFull, TierLost
from tiercheck.testing.conformance import TierConformance, blob


def _url(path: Path) -> str:
    return "lmdb://" + quote(str(path))


def _open(path: Path, **options: object) -> LmdbTier:
    tier = open_tier(_url(path), **options)
    assert isinstance(tier, LmdbTier)
    return tier


class TestLmdbTier(TierConformance):
    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(_url(tmp_path / "store"))


class TestLmdbTierNoSyncTinyMap(TierConformance):
    """The whole suite again with a tiny initial map, grown by the first writes."""

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(_url(tmp_path / "store"), sync=False, map_size=64 * 1024)


def test_capabilities_and_layout(tmp_path: Path) -> None:
    with _open(tmp_path / "db") as tier:
        assert tier.capabilities.atomic_batch is True
        assert tier.capabilities.persistent is True
        assert tier.capabilities.speed_rank == 30
        tier.append(b"r")
    assert sorted(os.listdir(tmp_path / "db")) == ["data.mdb", "lock.mdb"]
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False, max_dbs=2)
    try:
        with env.begin() as txn:
            log = env.open_db(b"log", txn=txn, create=False)
            assert list(txn.cursor(db=log)) == [(b"\x00" * 8, _frame(b"r"))]
    finally:
        env.close()


def _frame(payload: bytes) -> bytes:
    from tiercheck.formats.framing import frame_record

    return frame_record(payload)


def test_map_grows_past_tiny_initial_size(tmp_path: Path) -> None:
    with _open(tmp_path / "db", map_size=64 * 1024) as tier:
        start = tier.map_size
        items = [blob(1 << 20, seed=i) for i in range(8)]
        for bid, data in items:
            assert tier.put(bid, data) is True
        tier.append(b"x" * (1 << 20), blobs=[blob(3 << 20, seed=99)])
        assert tier.map_size >= 11 << 20
        assert tier.map_size > start
        for bid, data in items:
            assert bytes(tier.get(bid)) == data
        assert tier.read_log() == [b"x" * (1 << 20)]


def test_default_map_keeps_data_file_near_what_it_holds(tmp_path: Path) -> None:
    """The default map starts small and grows with the data: under writemap data.mdb is as
    long as the map, so a fixed 1 GiB map was a 1 GiB file for 8 MiB of blobs."""
    data_file = tmp_path / "db" / "data.mdb"
    with _open(tmp_path / "db", sync=False) as tier:
        tier.put(*blob(8 << 20))
        assert os.path.getsize(data_file) <= 64 << 20
        for i in range(24):  # 96 MiB more: the map grows in steps, not to a power of two
            tier.put(*blob(4 << 20, seed=i + 1))
        held = tier.usage()
        assert held >= 104 << 20
        assert tier.map_size == os.path.getsize(data_file)
        assert os.path.getsize(data_file) <= held + held // 2 + (32 << 20)


GROWER = r"""
import os, sys
import blake3
from tiercheck.backends.registry import open_tier

tier = open_tier(sys.argv[1], sync=False, map_size=1 << 20)
for i in range(12):  # 24 MiB into a 1 MiB map: it grows
    data = os.urandom(2 << 20)
    tier.put(blake3.blake3(data).hexdigest(), data)
last = os.urandom(1 << 20)
tier.put(blake3.blake3(last).hexdigest(), last)
print(blake3.blake3(last).hexdigest(), tier.map_size, flush=True)
tier.close()
"""


def test_a_reader_adopts_a_map_another_process_grew(tmp_path: Path) -> None:
    """A read-only open made before a writer in another process grew the map reads what
    was written after (LMDB's MapResizedError: the reader takes the new size)."""

    import blake3

    url = _url(tmp_path / "store")
    with open_tier(url, sync=False, map_size=1 << 20) as tier:
        tier.put(*blob(1000))
    with _open(tmp_path / "store", read_only=True) as reader:
        start = reader.map_size
        done = _fresh.run(["-c", GROWER, url], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        last, grown = done.stdout.split()
        assert int(grown) > start
        got = bytes(reader.get(last))
        assert blake3.blake3(got).hexdigest() == last
        assert reader.map_size == int(grown)


def test_max_size_raises_tier_full(tmp_path: Path) -> None:
    with _open(tmp_path / "db", map_size=256 * 1024, max_size=4 << 20) as tier:
        kept = []
        with pytest.raises(TierFull) as info:
            for i in range(100):
                bid, data = blob(512 * 1024, seed=i)
                tier.put(bid, data)
                kept.append((bid, data))
        assert tier.map_size == 4 << 20
        assert 0 < len(kept) < 8
        failed_id = blob(512 * 1024, seed=len(kept))[0]
        assert failed_id in str(info.value) and tier.url in str(info.value)
        # Still usable: earlier blobs read back; deleting makes room again.
        for bid, data in kept:
            assert bytes(tier.get(bid)) == data
        with pytest.raises(TierFull):
            tier.append(b"r", blobs=[blob(1 << 20, seed=1000)])
        assert tier.read_log() == []
        assert tier.has([blob(1 << 20, seed=1000)[0]]) == set()
        tier.delete([bid for bid, _ in kept])
        # LMDB reuses pages freed by a transaction only after the next one commits
        # (the previous snapshot stays intact), so one small write comes first.
        tier.append(b"after delete")
        tier.put(*blob(512 * 1024, seed=500))


class _DiskFullEnv:
    """Wraps an environment so that every write transaction's put fails with ENOSPC."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)

    @contextmanager
    def begin(self, **kwargs: object) -> Iterator[object]:
        with self._env.begin(**kwargs) as txn:
            yield _DiskFullTxn(txn) if kwargs.get("write") else txn


class _DiskFullTxn:
    def __init__(self, txn: lmdb.Transaction) -> None:
        self._txn = txn

    def __getattr__(self, name: str) -> object:
        return getattr(self._txn, name)

    def put(self, *args: object, **kwargs: object) -> bool:
        raise lmdb.DiskError("mdb_put: No space left on device")


def test_disk_full_is_tier_full(tmp_path: Path) -> None:
    with _open(tmp_path / "db") as tier:
        env = tier._e()
        real = env.env
        env.env = _DiskFullEnv(real)  # type: ignore[assignment]
        try:
            bid, data = blob(100)
            with pytest.raises(TierFull) as info:
                tier.put(bid, data)
            assert bid in str(info.value) and tier.url in str(info.value)
            with pytest.raises(TierFull):
                tier.append(b"r", blobs=[(bid, data)])
        finally:
            env.env = real
        assert tier.has([bid]) == set()
        assert tier.read_log() == []


_FILL_A_SMALL_DISK = """
import os, sys
from tiercheck.backends._lmdb import LmdbTier
from tiercheck.errors import TierFull
from tiercheck.testing.conformance import blob

tier = LmdbTier("lmdb://" + sys.argv[1], map_size=256 << 20)  # the map: 8x the disk
assert tier._e().data_fd is not None, "writemap is not on"
kept = []
try:
    for i in range(64):
        bid, data = blob(4 << 20, seed=i)
        tier.put_many([(bid, data)])
        kept.append(bid)
    raise SystemExit("the disk never filled up")
except TierFull as exc:
    assert "free disk space" in str(exc), exc
assert kept and tier.has(kept) == set(kept)  # what was written before stays readable
print("ok", len(kept))
"""


def test_writemap_on_a_full_disk_is_tier_full_not_sigbus(tmp_path: Path) -> None:

    from test_faults import small_tmpfs  # type: ignore[import-not-found,unused-ignore]

    with small_tmpfs(tmp_path / "small", "32m") as mounted:
        if not mounted:
            pytest.skip("cannot mount a small tmpfs here")
        proc = _fresh.run(
            ["-c", _FILL_A_SMALL_DISK, str(tmp_path / "small" / "db")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (
        proc.returncode,
        proc.stdout,
        proc.stderr[-2000:],
    )


def test_writemap_off(tmp_path: Path) -> None:
    with _open(tmp_path / "db", writemap=False) as tier:
        assert tier._e().data_fd is None
        tier.put(*blob(1000))
        assert len(list(tier.list())) == 1


def test_preallocate_readies_the_pages_the_next_puts_write(tmp_path: Path) -> None:
    """``Checkpointer.prepare``'s call: the map grows to hold the sizes past the pages in
    use and their disk blocks are reserved (and read into the page cache), so the puts
    that follow neither grow the map nor reserve more; without writemap nothing is done,
    and a read-only tier refuses."""
    sizes = [1 << 20] * 8
    with _open(tmp_path / "db", map_size=1 << 20) as tier:
        e = tier._e()
        ready = tier.preallocate(sizes)
        assert ready >= sum(sizes)
        info = e.env.info()
        assert info["map_size"] >= ready
        reserved = e.reserved
        assert os.stat(tmp_path / "db" / "data.mdb").st_blocks * 512 >= reserved >= ready
        assert e.readied >= ready
        assert tier.preallocate(sizes) == ready  # again: the same pages, nothing new to read
        assert (e.env.info()["map_size"], e.reserved) == (info["map_size"], reserved)
        items = [blob(n, seed=i) for i, n in enumerate(sizes)]
        assert tier.put_many(items) == len(items)
        assert (e.env.info()["map_size"], e.reserved) == (info["map_size"], reserved)
        assert [bytes(tier.get(bid)) for bid, _ in items] == [d for _, d in items]
    with _open(tmp_path / "off", writemap=False) as tier:
        assert tier.preallocate(sizes) == 0
    with _open(tmp_path / "db", read_only=True) as tier, pytest.raises(ReadOnlyTier):
        tier.preallocate(sizes)


def test_preallocate_on_a_full_disk_readies_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preallocation is a help, never a failure: ENOSPC from the reservation is 0 bytes
    ready, and the puts report the full disk themselves."""
    with _open(tmp_path / "db") as tier:

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(_lmdb.os, "posix_fallocate", full)
        assert tier.preallocate([64 << 20]) == 0
        with pytest.raises(TierFull):
            tier.put(*blob(64 << 20))


def test_put_many_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lmdb, "_BATCH_BYTES", 10_000)
    with _open(tmp_path / "db") as tier:
        items = [blob(4000, seed=i) for i in range(10)]
        assert tier.put_many(items) == 10
        assert tier.put_many(items) == 0
        assert set(tier.list()) == {bid for bid, _ in items}


def test_one_environment_per_path(tmp_path: Path) -> None:
    a = _open(tmp_path / "db")
    b = open_tier(_url(tmp_path / "db" / ".." / "db"))  # same directory, other spelling
    assert isinstance(b, LmdbTier)
    assert a._env is b._env
    bid, data = blob(10)
    a.put(bid, data)
    assert bytes(b.get(bid)) == data
    a.close()
    a.close()  # idempotent
    assert bytes(b.get(bid)) == data  # the environment stays open for b
    b.close()
    assert os.path.realpath(tmp_path / "db") not in _lmdb_env._envs


def test_read_only_env_blocks_writable_open(tmp_path: Path) -> None:
    _open(tmp_path / "db").close()
    with _open(tmp_path / "db", read_only=True) as ro:
        with pytest.raises(ReadOnlyTier):
            ro.append(b"r")
        with pytest.raises(TierError):
            _open(tmp_path / "db")
    with _open(tmp_path / "db") as tier:
        tier.append(b"r")


def test_read_only_missing_store(tmp_path: Path) -> None:
    with pytest.raises(TierLost):
        _open(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize(
    "url", ["lmdb://relative/path", "lmdb://", "lmdb:///", "lmdb:///x?y=1", "lmdb:///x#f"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(InvalidURL):
        open_tier(url)


def test_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"not a directory")
    with pytest.raises(InvalidURL):
        _open(tmp_path / "f" / "db")


def test_percent_encoded_path(tmp_path: Path) -> None:
    with _open(tmp_path / "with space") as tier:
        tier.append(b"r")
    assert (tmp_path / "with space" / "data.mdb").exists()


WRITER = r"""
import json, os, sys
import blake3
from tiercheck.backends.registry import open_tier

tier = open_tier(sys.argv[1])
data = os.urandom(256 * 1024)
kept = blake3.blake3(data).hexdigest()
tier.put(kept, data)
tier.append(b"first")
print(json.dumps({"id": kept}), flush=True)
assert sys.stdin.readline().strip() == "go"
tier.delete([kept])  # its pages are free to reuse, except for a reader's snapshot
for i in range(40):
    churn = os.urandom(256 * 1024)
    bid = blake3.blake3(churn).hexdigest()
    tier.put(bid, churn)
    tier.append(b"churn %d" % i)
    tier.delete([bid])
print(json.dumps({"readers": tier._e().env.readers()}), flush=True)
sys.stdin.readline()  # stay alive (and writing's done) until the parent has checked
"""


def test_read_only_reader_is_safe_beside_a_live_writer(tmp_path: Path) -> None:
    """A read-only open registers in LMDB's reader table, so a live writer (another
    process) never reuses the pages of the snapshot the reader holds."""
    import json
    import subprocess
    import sys

    import blake3

    url = _url(tmp_path / "store")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        kept = json.loads(writer.stdout.readline())["id"]
        reader = _open(tmp_path / "store", read_only=True)
        try:
            env = reader._e()
            with env.env.begin() as txn:  # one snapshot, held across the writer's commits
                before = bytes(txn.get(bytes.fromhex(kept), db=env.blobs))
                assert blake3.blake3(before).hexdigest() == kept
                writer.stdin.write("go\n")
                writer.stdin.flush()
                readers = json.loads(writer.stdout.readline())["readers"]
                assert f" {os.getpid()} " in f" {readers} ".replace("\n", " ")
                after = txn.get(bytes.fromhex(kept), db=env.blobs)
                assert after is not None and bytes(after) == before  # the snapshot held
            assert reader.has([kept]) == set()  # a new read sees the delete
            assert reader.read_log()[-1] == b"churn 39"
        finally:
            reader.close()
    finally:
        writer.stdin.close()
        writer.wait(timeout=60)
    assert writer.returncode == 0
