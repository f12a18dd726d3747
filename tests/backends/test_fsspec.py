"""The fsspec tier on file://, fsspec+memory:// and s3:// (moto server on loopback):
conformance suite, log commit by create-if-absent, damage detection, URL and id checks."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiercheck.backends._fsspec import FsspecTier, local, remote
from tiercheck.backends.base import FailureDomain, Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import (
    FormatVersionError,
    InvalidURL,
    NotFound,
    ReadOnlyTier,
    TierError,
    TierFull,
    TierUnavailable,
)
from tiercheck.testing.conformance import TierConformance, blob

# --- conformance ---------------------------------------------------------------------


class TestFileTier(TierConformance):
    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(f"file://{tmp_path}/tier")


class TestFsspecMemoryTier(TierConformance):
    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(f"fsspec+memory://tiercheck-{uuid.uuid4().hex}")


class TestS3Tier(TierConformance):
    concurrency_rounds = 10  # each round is a handful of HTTP requests

    @pytest.fixture(autouse=True)
    def _bucket(self, s3_bucket: tuple[str, dict[str, Any]]) -> None:
        self.url, self.options = s3_bucket

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(self.url, storage_options=self.options)

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return open_tier(tier.url, storage_options=self.options)

    def open_read_only(self, tier: Tier) -> Tier:
        return open_tier(tier.url, storage_options=self.options, read_only=True)


# --- one parametrised "store" fixture for the specific tests -------------------------

Opener = Callable[..., Tier]


@pytest.fixture(params=["file", "memory", "s3"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """A function opening (again) one fresh store: ``opener(read_only=False, **options)``."""
    storage: dict[str, Any] = {}
    if request.param == "file":
        url = f"file://{tmp_path}/tier"
    elif request.param == "memory":
        url = f"fsspec+memory://tiercheck-{uuid.uuid4().hex}"
    else:
        url, storage = request.getfixturevalue("s3_bucket")

    def open_(**options: Any) -> Tier:
        if storage:
            options.setdefault("storage_options", storage)
        return open_tier(url, **options)

    return open_


def _raw_put(tier: Tier, rel: str, data: bytes) -> None:
    """Write ``data`` at ``rel`` under the tier's root, bypassing the tier's checks."""
    assert isinstance(tier, FsspecTier)
    store = tier._store
    path = tier._join(tier._root, *rel.split("/"))
    if isinstance(store, local.LocalStore):
        Path(path).write_bytes(data)
    else:
        assert isinstance(store, remote.FsspecStore)
        store.fs.pipe_file(path, data)


def _raw_get(tier: Tier, rel: str) -> bytes:
    assert isinstance(tier, FsspecTier)
    path = tier._join(tier._root, *rel.split("/"))
    return bytes(tier._store.read(path, None))


# --- log commit: create-if-absent ----------------------------------------------------


def test_two_writers_collide_and_retry(opener: Opener) -> None:
    # Both writers know the log is empty; the second one's claim of seq 0 must fail and
    # move on, not replace the first record.
    a, b = opener(), opener()
    assert a.read_log() == [] and b.read_log() == []
    a.append(b"from a")
    b.append(b"from b")
    a.append(b"from a again")
    assert a.read_log() == b.read_log() == [b"from a", b"from b", b"from a again"]
    assert _raw_get(a, "log/0000000000000001.rec").endswith(b"from b")


def test_create_is_exclusive(opener: Opener) -> None:
    tier = opener()
    assert isinstance(tier, FsspecTier)
    assert tier._store.exclusive_create
    path = tier._join(tier._root, "log", "0000000000000007.rec")
    tier._store.create(path, memoryview(b"first"))
    with pytest.raises(FileExistsError):
        tier._store.create(path, memoryview(b"second"))
    assert _raw_get(tier, "log/0000000000000007.rec") == b"first"


def test_concurrent_writers_lose_nothing(opener: Opener) -> None:
    writers, per_writer = 4, 15
    tiers = [opener() for _ in range(writers)]
    start = threading.Barrier(writers)
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            start.wait()
            for i in range(per_writer):
                tiers[w].append(f"{w}:{i}:".encode() + bytes([w]) * (100 * i))
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    log = opener(read_only=True).read_log()
    assert len(log) == writers * per_writer
    last = dict.fromkeys(range(writers), -1)
    for rec in log:
        w_s, i_s, pad = rec.split(b":", 2)
        w, i = int(w_s), int(i_s)
        assert pad == bytes([w]) * (100 * i), "interleaved record"
        assert i == last[w] + 1, "a writer's records out of order"
        last[w] = i


def test_file_writers_in_separate_processes(tmp_path: Path) -> None:
    import subprocess
    import sys

    url = f"file://{tmp_path}/tier"
    open_tier(url)  # create the root and marker once
    code = (
        "import sys\nfrom tiercheck import open_tier\n"
        "t = open_tier(sys.argv[1])\n"
        "for i in range(40): t.append(f'{sys.argv[2]}:{i}'.encode())\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url, str(w)], stderr=subprocess.PIPE)
        for w in range(3)
    ]
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err.decode()
    log = open_tier(url).read_log()
    assert sorted(log) == sorted(f"{w}:{i}".encode() for w in range(3) for i in range(40))


# --- damage --------------------------------------------------------------------------


def test_damaged_log_object_is_skipped(opener: Opener, caplog: pytest.LogCaptureFixture) -> None:
    tier = opener()
    for rec in (b"zero", b"one: the record that gets damaged", b"two"):
        tier.append(rec)
    raw = bytearray(_raw_get(tier, "log/0000000000000001.rec"))
    raw[-5] ^= 0xFF
    _raw_put(tier, "log/0000000000000001.rec", bytes(raw))
    _raw_put(tier, "log/0000000000000003.rec", _raw_get(tier, "log/0000000000000002.rec")[:-1])
    with caplog.at_level(logging.WARNING, logger="tiercheck.backends._fsspec"):
        assert tier.read_log() == [b"zero", b"two"]
    assert "0000000000000001" in caplog.text and "0000000000000003" in caplog.text
    tier.append(b"four")  # appends after the damaged ones, never over them
    assert tier.read_log() == [b"zero", b"two", b"four"]


def test_foreign_files_are_ignored(opener: Opener) -> None:
    tier = opener()
    bid, data = blob(10)
    tier.put(bid, data)
    tier.append(b"r")
    _raw_put(tier, "log/notes.txt", b"not a record")
    _raw_put(tier, f"blobs/{bid[:2]}/{'f' * 64}", b"in the wrong fan-out dir")
    _raw_put(tier, "blobs/README", b"hello")
    assert tier.read_log() == [b"r"]
    assert list(tier.list()) == [bid]


# --- ids, read-only, URLs, marker ----------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["../" * 3 + "x" * 55, "ab/../../../" + "0" * 52, "/etc/passwd", "..", "0" * 62 + "/."]
)
def test_path_traversal_id_refused(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "a" / "b" / "tier"
    tier = open_tier(f"file://{root}")
    before = sorted(p for p in tmp_path.rglob("*"))
    for call in (
        lambda: tier.put(bad, b"evil"),
        lambda: tier.put(bad, b"evil", overwrite=True),
        lambda: tier.get(bad),
        lambda: tier.size(bad),
        lambda: tier.has([bad]),
        lambda: tier.delete([bad]),
        lambda: tier.put_many([("0" * 64, b"fine"), (bad, b"evil")]),
        lambda: tier.append(b"rec", blobs=[(bad, b"evil")]),
    ):
        with pytest.raises(TierError, match="invalid blob id"):
            call()
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert tier.read_log() == []


def test_read_only(opener: Opener) -> None:
    writer = opener()
    bid, data = blob(100)
    writer.put(bid, data)
    writer.flush()  # an object store's blobs wait for a pack until then
    ro = opener(read_only=True)
    assert ro.read_only
    with pytest.raises(ReadOnlyTier):
        ro.put_many([blob(5)])
    with pytest.raises(ReadOnlyTier):
        ro.append(b"x")
    with pytest.raises(ReadOnlyTier):
        ro.delete([bid])
    assert bytes(ro.get(bid)) == data


def test_read_only_open_creates_nothing(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}/nothing/here", read_only=True)
    assert tier.read_log() == [] and list(tier.list()) == []
    assert not (tmp_path / "nothing").exists()


def test_marker_written_and_checked(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    open_tier(f"file://{root}")
    assert json.loads((root / "tier.json").read_text()) == {"tier": "tiercheck-fsspec", "layout": 1}
    (root / "tier.json").write_text(json.dumps({"tier": "tiercheck-fsspec", "layout": 99}))
    with pytest.raises(FormatVersionError, match="upgrade"):
        open_tier(f"file://{root}")
    (root / "tier.json").write_text("{not json")
    with pytest.raises(InvalidURL, match="not a tiercheck marker"):
        open_tier(f"file://{root}")


@pytest.mark.parametrize(
    "url",
    [
        "file://relative/path",
        "file://otherhost/abs",
        "file:///",
        "fsspec+memory://",
        "s3://",
        "file:///tmp/x?query=1",
        "fsspec+://x",
        "fsspec+nosuchprotocol://x",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(InvalidURL):
        open_tier(url)


def test_unknown_option(tmp_path: Path) -> None:
    with pytest.raises(InvalidURL, match="colour"):
        open_tier(f"file://{tmp_path}/t", colour="blue")


def test_capabilities_defaults_and_overrides(tmp_path: Path, s3_bucket: Any) -> None:
    local = open_tier(f"file://{tmp_path}/t").capabilities
    assert (local.survives, local.shared, local.persistent, local.speed_rank) == (
        FailureDomain.PROCESS,
        False,
        True,
        40,
    )
    mounted = open_tier(f"file://{tmp_path}/t", shared=True).capabilities
    assert (mounted.survives, mounted.shared) == (FailureDomain.NODE, True)
    lustre = open_tier(f"file://{tmp_path}/t", shared=True, survives="cluster").capabilities
    assert lustre.survives is FailureDomain.CLUSTER
    mem = open_tier(f"fsspec+memory://caps-{uuid.uuid4().hex}").capabilities
    assert (mem.survives, mem.persistent, mem.speed_rank) == (FailureDomain.NONE, False, 5)
    url, options = s3_bucket
    remote = open_tier(url, storage_options=options).capabilities
    assert (remote.survives, remote.shared, remote.persistent, remote.speed_rank) == (
        FailureDomain.CLUSTER,
        True,
        True,
        50,
    )
    with pytest.raises(InvalidURL, match="capability"):
        open_tier(f"file://{tmp_path}/t", survives="galaxy")


# --- typed errors --------------------------------------------------------------------


def test_missing_bucket_is_a_clear_error(s3_server: Any) -> None:
    url = "s3://no-such-bucket-here/prefix"
    with pytest.raises(InvalidURL) as info:
        open_tier(url, storage_options=s3_server.storage_options)
    message = str(info.value)
    assert "bucket 'no-such-bucket-here' does not exist; create it or fix the URL" in message
    assert url in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_endpoint_down_is_unavailable(s3_server: Any, s3_bucket: Any) -> None:
    url, options = s3_bucket
    tier = open_tier(url, storage_options=options)
    bid, data = blob(1000)
    tier.put(bid, data)
    tier.append(b"before")
    with s3_server.down():
        with pytest.raises(TierUnavailable) as info:
            tier.get(bid)
        assert url in str(info.value) and bid in str(info.value)
        with pytest.raises(TierUnavailable):
            tier.append(b"while down")
        with pytest.raises(TierUnavailable):
            open_tier(url, storage_options=options)
    assert tier.read_log() == [b"before"]
    assert bytes(tier.get(bid)) == data


def test_missing_blob_names_tier_and_id(opener: Opener) -> None:
    tier = opener()
    bid = "c" * 64
    with pytest.raises(NotFound) as info:
        tier.get(bid)
    assert bid in str(info.value) and tier.url in str(info.value)


def test_disk_full_is_tier_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = open_tier(f"file://{tmp_path}/t")
    bid, data = blob(1000)

    def no_space(fd: int, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local, "write_all", no_space)
    with pytest.raises(TierFull) as info:
        tier.put(bid, data)
    assert bid in str(info.value)
    with pytest.raises(TierFull):
        tier.append(b"rec")
    monkeypatch.undo()
    assert tier.has([bid]) == set() and tier.read_log() == []
    leftovers = [p.name for p in (tmp_path / "t").rglob("*") if p.is_file()]
    assert leftovers == ["tier.json"]  # no temporary files left behind


def test_get_reads_into_caller_buffer(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}/t")
    bid, data = blob(1 << 20, seed=3)
    tier.put(bid, data)
    buf = bytearray(2 << 20)
    view = tier.get(bid, out=memoryview(buf))
    assert view.obj is buf and bytes(view) == data


def test_begin_put_names_a_blob_only_once_its_content_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local begin_put writes a temporary file; finish fsyncs it, then names it. A failed
    fsync (EIO, ENOSPC at writeback) leaves no name and no temporary file, as typed error."""
    tier = open_tier(f"file://{tmp_path}/t")
    root = tmp_path / "t"
    (bid, data), (bad, bad_data), (gone, gone_data) = (blob(5000, seed=s) for s in (1, 2, 3))

    def files() -> set[str]:
        return {p.name for p in root.rglob("*") if p.is_file()} - {"tier.json"}

    pending = tier.begin_put(bid, [data])
    assert tier.has([bid]) == set() and len(files()) == 1  # the temporary file only
    assert pending.finish() is True and files() == {bid} and tier.has([bid]) == {bid}

    pending = tier.begin_put(bad, [bad_data])

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(local.os, "fsync", eio)
    with pytest.raises(TierError) as info:
        pending.finish()
    assert bad in str(info.value)
    monkeypatch.undo()
    assert files() == {bid}  # neither named nor left as a temporary file

    tier.begin_put(gone, [gone_data]).abort()
    assert files() == {bid}


# --- packs on a local file system: around the page cache ----------------------------


def _resident_pages(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (mincore(2) on a private mapping)."""
    import ctypes
    import mmap as mmap_module

    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mapped = mmap_module.mmap(f.fileno(), size, access=mmap_module.ACCESS_COPY)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        pages = -(-size // mmap_module.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        resident = [bool(b & 1) for b in vec]
        del vec
        return resident
    finally:
        mapped.close()


def _takes_direct_writes(directory: Path) -> bool:
    import mmap as mmap_module

    block = mmap_module.mmap(-1, 4096)
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, block)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(directory / "probe")


_PACK_PARTS = [
    [1],
    [4095],
    [4096, 1],
    [8 << 20, 1],
    [(8 << 20) - 1, 2, 4097],
    [3 << 20] * 5,
]


@pytest.mark.parametrize("sizes", _PACK_PARTS, ids=lambda s: "+".join(map(str, s)))
def test_a_local_pack_is_written_exactly_and_around_the_page_cache(
    tmp_path: Path, sizes: list[int]
) -> None:
    """A pack (``put_object``) holds exactly its parts, whatever their sizes around the
    direct-write block and buffer; where the file system takes O_DIRECT, none of its whole
    pages was left in the page cache by the write (the kernel did not copy it)."""
    store = local.LocalStore(str(tmp_path))
    rng = np.random.default_rng(len(sizes))
    parts = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    path = tmp_path / "packs" / "p1"
    store.put_object(str(path), parts)
    assert path.read_bytes() == b"".join(parts)
    assert [p.name for p in path.parent.iterdir()] == ["p1"]  # no temporary file left
    if not _takes_direct_writes(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT: packs go through the cache")
    # read_bytes above went through the cache: drop what it brought in, then write again
    path2 = tmp_path / "packs" / "p2"
    store.put_object(str(path2), parts)
    whole = sum(sizes) // 4096
    assert not any(_resident_pages(path2)[:whole])


def test_a_file_system_that_refuses_direct_writes_gets_them_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some file systems open with O_DIRECT and refuse the write (EINVAL): the pack is
    written whole through the page cache, and the store stops trying."""
    import fcntl

    class _NoDirect:
        def __init__(self) -> None:
            self.refused = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def writev(self, fd: int, views: Any) -> int:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                self.refused += 1
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return os.writev(fd, views)

    fake = _NoDirect()
    monkeypatch.setattr(local, "_os", fake)
    store = local.LocalStore(str(tmp_path))
    parts = [memoryview(bytes(range(256)) * 40_000), memoryview(b"tail")]
    for name in ("p1", "p2"):
        store.put_object(str(tmp_path / name), parts)
        assert (tmp_path / name).read_bytes() == b"".join(parts)
    assert fake.refused == 1 and store._direct is False
