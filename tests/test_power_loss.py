"""Power loss, not only a killed process (issue 21, item 6): crash-consistency tests in the
manner of ALICE and CrashMonkey.

A save runs for real while ``tests/_crash_states.Recorder`` stands in for the backend's
``_os`` and records every operation that changes the tier's files. From the trace and a
snapshot of the tree before it, ``_crash_states`` builds the trees a power cut (or, for
shm, a SIGKILL) could leave at every fsync barrier, with unsynced writes lost, torn or
reordered and unsynced directory changes lost or reordered, seeded and bounded. Each tree
is written out, the tier (and a Checkpointer over it) is opened on it, and:

- it opens and reads without error;
- what it returns is what was acknowledged before the cut, bit for bit, or newer (never
  a record or version that was not written, never a blob that does not hash to its id).

The packs of the default remote tier go through the same crash states on a packed
``file://`` tier (packs, their indexes, drop lists, repacks), and on S3 (moto) the writer
loses power before each request that changes the store, its pack's multipart upload
included: what the store acknowledged stays, nothing after the cut arrives.

LMDB's durability comes from its environment flags, which the last test pins.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from _crash_states import (
    CrashState,
    Recorder,
    Tree,
    materialize,
    power_loss_states,
    process_crash_states,
)

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends import _shm
from tiercheck.backends._fsspec import FsspecTier, local
from tiercheck.backends._lmdb import LmdbTier
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import NoRestorableVersion, NotFound, TiercheckError

CHUNK = 4096
SEED = 21
REORDERS = 4


# --- helpers -------------------------------------------------------------------------


def blob(n: int, size: int = 3000) -> tuple[str, bytes]:
    data = blake3.blake3(n.to_bytes(8, "little")).digest(length=size)
    return blake3.blake3(data).hexdigest(), data


def record(i: int, ids: list[str]) -> bytes:
    return f"rec {i} {','.join(ids)}".encode()


def check_log(tier: Tier, acked: int, state: CrashState) -> None:
    """The tier's log holds records 0..m in order for some m >= ``acked`` (a checkpoint
    record ``ckpt a..b`` standing for records a..b), every blob they name reads back and
    hashes to its id, and a record appended now follows them."""
    covered: list[int] = []
    before = tier.read_log()
    for payload in before:
        kind, span, ids = payload.decode().split(" ")
        if kind == "ckpt":
            lo, hi = map(int, span.split(".."))
            covered += range(lo, hi + 1)
        else:
            assert kind == "rec", f"{state}: a record that was never written: {payload!r}"
            covered.append(int(span))
        for bid in filter(None, ids.split(",")):
            try:
                data = bytes(tier.get(bid))
            except NotFound:
                raise AssertionError(
                    f"{state.variant} state at op {state.cut}: record {span} names blob "
                    f"{bid[:12]}, which is gone"
                ) from None
            assert blake3.blake3(data).hexdigest() == bid, f"{state}: blob {bid[:12]} garbage"
    assert covered == list(range(len(covered))), f"{state}: log {covered} not a prefix"
    assert len(covered) > acked, (
        f"{state.variant} state at op {state.cut}: acknowledged record {acked} lost "
        f"(log holds {covered})"
    )
    # the restarted writer goes on: its record lands after what was there, which stays
    tier.append(b"after the crash")
    assert tier.read_log() == [*before, b"after the crash"], f"{state}: appending broke the log"


def acked_number(state: CrashState) -> int:
    return int(state.acked.split()[1]) if state.acked else -1


def check_states(states: list[CrashState], tmp: Path, open_and_check: Any) -> None:
    for n, state in enumerate(states):
        where = tmp / f"state{n}"
        where.mkdir()
        materialize(state.tree, str(where))
        try:
            open_and_check(where, state)
        finally:
            shutil.rmtree(where)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory in /dev/shm (tmpfs, as in production), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="tiercheck-power-loss-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- the file:// tier ----------------------------------------------------------------


def _tier_workload(tier: Tier, rec: Recorder, first: int = 0, count: int = 4) -> None:
    """Append records ``first..``, each with two new blobs and one of the previous record's
    (already there: not written again), acknowledging each; compact after the third; a
    repair overwrites one blob; GC deletes a blob no record names."""
    prev = ""
    for i in range(first, first + count):
        items = [blob(2 * i), blob(2 * i + 1)]
        ids = [bid for bid, _ in items] + ([prev] if prev else [])
        for bid, data in items:
            tier.put(bid, data)
        tier.append(record(i, ids), blobs=items)
        rec.mark(f"ack {i}")
        prev = ids[0]
        if i == first + 2:
            tier.replace_log_prefix(3, f"ckpt {first}..{i} {','.join(ids)}".encode())
            rec.mark(f"ack {i}")
    bid, data = blob(2 * first)
    tier.put(bid, data, overwrite=True)
    stray, stray_data = blob(10_000)
    tier.put(stray, stray_data)
    tier.delete([stray])


def _check_file_tier(where: Path, state: CrashState) -> None:
    """The file:// tier a crash left at ``where`` opens, and its log holds every record
    acknowledged before the cut (:func:`check_log`)."""
    t = open_tier(f"file://{where}")
    try:
        check_log(t, acked_number(state), state)
    finally:
        t.close()


@pytest.mark.parametrize("hard_links", [True, False], ids=["link", "no-link"])
def test_file_tier_keeps_every_acknowledged_record_through_power_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    """Records are created by link (or, without hard links, by O_EXCL and fsync)."""
    root = tmp_path / "tier"
    root.mkdir()
    rec = Recorder(str(root), hard_links=hard_links)
    monkeypatch.setattr(local, "_os", rec)
    tier = open_tier(f"file://{root}")
    _tier_workload(tier, rec)
    tier.close()
    monkeypatch.undo()
    rec.check_trace()

    states = power_loss_states(rec.ops, rec.base, seed=SEED, reorders=REORDERS)
    assert len(states) > 20

    check_states(states, tmp_path, _check_file_tier)


@pytest.mark.parametrize("relied_on", ["its blob", "its directory"])
def test_what_a_crashed_writer_left_is_made_durable_before_a_record_relies_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relied_on: str
) -> None:
    """A writer that crashed after a put leaves a named blob whose directories were never
    fsynced. The next writer finds the blob present and does not write it again (the
    engine asks ``has`` first), or puts another blob into a directory the crashed writer
    made: either way its record relies on names a power cut could still undo, so they
    must be made durable before the record is written."""
    root = tmp_path / "tier"
    root.mkdir()
    rec = Recorder(str(root))
    monkeypatch.setattr(local, "_os", rec)
    crashed = open_tier(f"file://{root}")
    bid, data = blob(0)
    crashed.put(bid, data)
    del crashed  # SIGKILLed: no close, no record
    tier = open_tier(f"file://{root}")
    if relied_on == "its blob":
        assert tier.has([bid]) == {bid}
        tier.append(record(0, [bid]))
    else:
        other = next(b for b in (blob(n) for n in range(1, 5000)) if b[0][:2] == bid[:2])
        tier.put(*other)
        tier.append(record(0, [other[0]]))
    rec.mark("ack 0")
    tier.close()
    monkeypatch.undo()
    rec.check_trace()

    states = power_loss_states(rec.ops, rec.base, seed=SEED, reorders=REORDERS)

    check_states(states, tmp_path, _check_file_tier)


# --- packs (the layout of the default remote tier) -----------------------------------

PACK_SIZE = 8000  # about three blobs of 3000 bytes: packs are sealed between puts too


def _pack_workload(tier: Tier, rec: Recorder) -> dict[str, int]:
    """The packed tier's paths under power loss: records 0..3 with their blobs packed about
    three to a pack, sealed between puts and at each append, with stray blobs no record
    names in the same packs; a compaction after record 2; a repair (a loose copy); GC of
    the strays, which writes drop lists, repacks a pack whose live blobs became few and
    deletes one left with none; then record 4, naming a blob the repack moved. Returns the
    pack objects of each kind found after the GC."""
    new = (blob(n) for n in range(100))
    strays: list[str] = []
    prev = ""
    moved = ""
    for i, order in enumerate(["NNS", "NNSSS", "SSNN", "NN"]):
        named: list[tuple[str, bytes]] = []
        for kind in order:
            bid, data = next(new)
            tier.put(bid, data)
            (named if kind == "N" else []).append((bid, data))
            if kind == "S":
                strays.append(bid)
        if i == 2:
            moved = named[0][0]  # packed with two strays: repacked by their GC
        ids = [bid for bid, _ in named] + ([prev] if prev else [])
        tier.append(record(i, ids), blobs=named)
        rec.mark(f"ack {i}")
        prev = ids[0]
        if i == 2:
            tier.replace_log_prefix(3, f"ckpt 0..2 {','.join(ids)}".encode())
            rec.mark("ack 2")
    first, first_data = blob(0)
    tier.put(first, first_data, overwrite=True)  # a repair: a loose copy, read first
    assert tier.delete(strays) == len(strays)
    last, last_data = next(new)
    tier.append(record(4, [moved, last]), blobs=[(last, last_data)])
    rec.mark("ack 4")
    names = os.listdir(os.path.join(rec.root, "packs"))
    return {ext: sum(n.endswith(ext) for n in names) for ext in (".pack", ".drop")}


def _check_packed_tier(where: Path, state: CrashState) -> None:
    """As :func:`_check_file_tier`, packed: besides the log, every blob the tier lists
    reads back whole, and no pack object it finds is torn (its index parses)."""
    t = open_tier(f"file://{where}", pack_size=PACK_SIZE)
    try:
        assert isinstance(t, FsspecTier) and t._packs is not None
        for bid in t.list():
            data = bytes(t.get(bid))
            assert blake3.blake3(data).hexdigest() == bid, f"{state}: blob {bid[:12]} garbage"
        assert t._packs._bad == {}, f"{state}: a torn pack is visible: {t._packs._bad}"
        check_log(t, acked_number(state), state)
    finally:
        t.close()


def test_packed_tier_keeps_every_acknowledged_record_through_power_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packs, their indexes (at their ends), drop lists and repacks under power loss: a pack
    is named only once its bytes, index included, are durable, and its name is durable
    before the record that relies on it; a repack's new pack before the old one goes."""
    root = tmp_path / "tier"
    root.mkdir()
    rec = Recorder(str(root))
    monkeypatch.setattr(local, "_os", rec)
    tier = open_tier(f"file://{root}", pack_size=PACK_SIZE)
    kinds = _pack_workload(tier, rec)
    tier.close()
    monkeypatch.undo()
    rec.check_trace()
    assert kinds[".drop"] >= 1, "the GC wrote no drop list: the workload misses that path"

    states = power_loss_states(rec.ops, rec.base, seed=SEED, reorders=REORDERS)
    assert len(states) > 20

    check_states(states, tmp_path, _check_packed_tier)


class _PackFsyncLost(Recorder):
    """A recorder over a file system that drops the fsync of pack files (as a tier that
    named a pack before its bytes were durable would leave it)."""

    def fsync(self, fd: int) -> None:
        if "/packs/" in os.readlink(f"/proc/self/fd/{fd}"):  # a pack file, not the directory
            return
        super().fsync(fd)


def test_the_recorder_finds_a_pack_named_before_its_bytes_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above has teeth: where a pack's bytes are not durable before its name, a
    power cut leaves a torn or empty pack that an acknowledged record relies on, and some
    crash state fails the check."""
    root = tmp_path / "tier"
    root.mkdir()
    rec = _PackFsyncLost(str(root))
    monkeypatch.setattr(local, "_os", rec)
    tier = open_tier(f"file://{root}", pack_size=PACK_SIZE)
    _pack_workload(tier, rec)
    tier.close()
    monkeypatch.undo()

    states = power_loss_states(rec.ops, rec.base, seed=SEED, reorders=REORDERS)
    failed = []
    for state in states:
        try:
            check_states([state], tmp_path, _check_packed_tier)
        except (AssertionError, TiercheckError) as exc:
            failed.append(str(exc))
    assert failed, "no crash state lost a pack whose fsync was dropped"


class PowerCut(Exception):
    """The writer's node lost power: no request leaves it any more."""


class _S3Cut:
    """Stands between a writer and S3 (botocore's ``before-send`` event): records the
    operation of every request, and from the ``cut``-th on lets none leave. What the
    store answered before the cut is durable (an object store acknowledges only what it
    stored); nothing after it arrives, parts in flight included."""

    def __init__(self, cut: int | None) -> None:
        self.cut = cut
        self.sent: list[str] = []

    def __call__(self, event_name: str = "", **kwargs: Any) -> None:
        if self.cut is not None and len(self.sent) >= self.cut:
            raise PowerCut(f"power lost before request {len(self.sent)} ({event_name})")
        self.sent.append(event_name.rsplit(".", 1)[-1])


S3_PACK_SIZE = 19 << 19  # 9.5 MiB: five blobs of 2 MiB make a pack of two 8 MiB parts


def _s3_workload(url: str, storage: dict[str, Any], cut: _S3Cut) -> list[int]:
    """Record 0 with five blobs of 2 MiB (a pack streamed as a multipart upload: created
    and its first part sent at the fourth put, while the pack fills; its last part and
    its completion at the fifth, which fills it),
    record 1 with one small blob (a pack of one PutObject), through ``cut``; the records
    acknowledged before the power cut."""
    acked: list[int] = []
    tier = open_tier(
        url, pack_size=S3_PACK_SIZE, storage_options={**storage, "skip_instance_cache": True}
    )
    assert isinstance(tier, FsspecTier)
    tier._store.fs.s3.meta.events.register("before-send.s3", cut)
    try:
        for i, sizes in enumerate([[2 << 20] * 5, [3000]]):
            items = [blob(10 * i + j, size) for j, size in enumerate(sizes)]
            for bid, data in items:
                tier.put(bid, data)
            tier.append(record(i, [bid for bid, _ in items]), blobs=items)
            acked.append(i)
    except PowerCut:
        pass
    except TiercheckError as exc:  # the cut, as the tier reports it
        assert isinstance(exc.__cause__, PowerCut) or "power lost" in str(exc), exc
    return acked  # the writer is gone: no close, no abort of its upload


@pytest.mark.slow
def test_a_pack_upload_cut_by_power_loss_on_s3_is_never_visible(
    s3_server: Any, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """Power lost at every request of a packed S3 tier's writer: before its upload is
    created, between its parts, before and after its completion, before and after the
    record. A fresh writer then finds every acknowledged record with its blobs whole, no
    pack of an upload that never completed (the parts stay invisible until an S3
    lifecycle rule aborts the upload), no torn pack, and appends after them."""
    url, storage = s3_bucket
    whole = _S3Cut(None)
    assert _s3_workload(url + "/whole", storage, whole) == [0, 1]
    ops = whole.sent
    assert {"CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"} <= set(ops), ops
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    client = s3_server.client()
    incomplete = 0
    # a cut before a read leaves the store as the cut before the next write does
    writes = {"CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "PutObject"}
    for n in [i for i, op in enumerate(ops) if op in writes] + [len(ops)]:
        prefix = f"{url}/cut{n}"
        acked = _s3_workload(prefix, storage, _S3Cut(n))
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=f"tier/cut{n}/")
        incomplete += len(uploads.get("Uploads", []))
        tier = open_tier(prefix, pack_size=S3_PACK_SIZE, storage_options=storage)
        assert isinstance(tier, FsspecTier) and tier._packs is not None
        acked_last = f"ack {acked[-1]}" if acked else ""
        state = CrashState(n, f"S3 cut before request {n} ({ops[n : n + 1]})", acked_last, Tree(0))
        for bid in tier.list():
            assert blake3.blake3(bytes(tier.get(bid))).hexdigest() == bid, f"{state}: {bid[:12]}"
        assert tier._packs._bad == {}, f"{state}: a torn pack is visible"
        check_log(tier, acked[-1] if acked else -1, state)
        tier.close()
    assert incomplete, "no cut fell inside a multipart upload"


# --- a Checkpointer over file:// -----------------------------------------------------


def state_at(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    frozen = torch.Generator().manual_seed(7)
    return {
        "frozen": torch.randn(CHUNK // 2, generator=frozen),  # the same chunks every step
        "w": torch.randn(CHUNK // 2, generator=g),
        "step": step,
    }


def _policy(tier: str) -> Policy:
    return Policy(base_every=2, chunk_size=CHUNK, gc_grace_seconds=0, tiers={tier: TierPolicy()})


def check_restore(store: Path, tier: TierSpec, state: CrashState, *, promised: bool) -> None:
    """A fresh Checkpointer of the store that saved (``store``) over the crash state opens
    and restores a version that was saved, bit for bit, or finds none; where the tier
    ``promised`` to survive this crash, that version is the newest acknowledged step or a
    newer one. (The store itself reopens: the tier's owner record names it.)"""
    acked = acked_number(state) if promised else -1
    where = f"{state.variant} state at op {state.cut}"
    with Checkpointer(store, tiers=[tier], policy=_policy(tier.name), rewrite_config=True) as ckpt:
        target: dict[str, Any] = {
            "frozen": torch.zeros(CHUNK // 2),
            "w": torch.zeros(CHUNK // 2),
            "step": -1,
        }
        try:
            info = ckpt.restore(target)
        except NoRestorableVersion:
            assert acked < 0, f"{where}: acknowledged step {acked} lost"
            return
    assert info.step >= acked, f"{where}: restored step {info.step}, acknowledged {acked}"
    expected = state_at(info.step)
    assert target["step"] == info.step
    for key in ("frozen", "w"):
        assert torch.equal(target[key].view(torch.int32), expected[key].view(torch.int32))


def save_steps(store: Path, tier: TierSpec, rec: Recorder, steps: int) -> None:
    """Save steps 1..``steps``, marking each acknowledged once ``wait()`` returned."""
    with Checkpointer(store, tiers=[tier], policy=_policy(tier.name)) as ckpt:
        for step in range(1, steps + 1):
            ckpt.save(step, state_at(step)).wait()
            rec.mark(f"ack {step}")


@pytest.mark.slow
def test_checkpointer_over_file_tier_restores_the_newest_acknowledged_step_after_power_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "tier"
    root.mkdir()
    rec = Recorder(str(root))
    monkeypatch.setattr(local, "_os", rec)
    save_steps(tmp_path / "store", TierSpec("disk", f"file://{root}"), rec, steps=4)
    monkeypatch.undo()
    rec.check_trace()

    states = power_loss_states(rec.ops, rec.base, seed=SEED, reorders=2)
    assert len(states) > 20

    def check(where: Path, state: CrashState) -> None:
        check_restore(tmp_path / "store", TierSpec("disk", f"file://{where}"), state, promised=True)

    check_states(states, tmp_path, check)


# --- the shm tier --------------------------------------------------------------------


@pytest.mark.parametrize("preallocated", [False, True], ids=["plain", "preallocated"])
def test_shm_tier_keeps_every_acknowledged_record_through_a_killed_writer(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preallocated: bool
) -> None:
    """tmpfs has no disk: its promise is a killed process (every call that returned stays,
    in order; the write the kill lands in may be torn), not power loss. ``preallocated``:
    ``prepare()``'s preallocation first, its pool segments written through the recorded
    ``_os`` (nothing goes around it), so the kill may land in it or in the puts that take
    its segments."""
    rec = Recorder(str(shm_dir))
    monkeypatch.setattr(_shm, "_os", rec)
    tier = open_tier("shm://power-loss", root=str(shm_dir))
    if preallocated:
        assert isinstance(tier, _shm.ShmTier)
        assert tier.preallocate([3000] * 6) == 6 * 3000
    _tier_workload(tier, rec)
    if preallocated:
        assert isinstance(tier, _shm.ShmTier) and tier.segments_reused > 0
    tier.close()
    monkeypatch.undo()
    rec.check_trace()

    states = process_crash_states(rec.ops, rec.base, seed=SEED)
    assert len(states) > 20

    def check(where: Path, state: CrashState) -> None:
        t = open_tier("shm://power-loss", root=str(where))
        try:
            check_log(t, acked_number(state), state)
        finally:
            t.close()

    check_states(states, tmp_path, check)


def test_checkpointer_over_shm_tier_after_a_killed_writer_and_after_power_loss(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a killed writer, the newest acknowledged step or a newer one. The shm tier
    fsyncs nothing (it survives a process, not the node; tmpfs is gone after power loss):
    with its root on a disk, power loss may take anything, but what a Checkpointer over it
    restores is still a version that was saved, bit for bit, or nothing."""
    rec = Recorder(str(shm_dir))
    monkeypatch.setattr(_shm, "_os", rec)
    save_steps(
        tmp_path / "store",
        TierSpec("shm", "shm://power-loss", {"root": str(shm_dir)}),
        rec,
        steps=3,
    )
    monkeypatch.undo()
    rec.check_trace()

    killed = process_crash_states(rec.ops, rec.base, seed=SEED)
    lost = power_loss_states(rec.ops, rec.base, seed=SEED, reorders=2)

    # every third SIGKILL state (the tier test above takes them all) bounds the time
    promised = {id(s) for s in [*killed[::3], killed[-1]]}

    def check(where: Path, state: CrashState) -> None:
        tier = TierSpec("shm", "shm://power-loss", {"root": str(where)})
        check_restore(tmp_path / "store", tier, state, promised=id(state) in promised)

    check_states([*killed[::3], killed[-1], *lost], tmp_path, check)


# --- LMDB ----------------------------------------------------------------------------


def test_lmdb_tier_opens_its_environment_with_durable_flags(tmp_path: Path) -> None:
    """A commit that returned survives power loss only with these flags (docs/concepts.md,
    Guarantees; formats/SPEC.md section 13): ``sync`` and ``metasync`` (the data pages,
    then the meta page, flushed at every commit), ``map_async`` off (with ``writemap``
    LMDB flushes the map with a synchronous ``msync``, and writes the meta page only after
    it), and ``lock`` (the reader table that keeps a writer off pages a reader still uses).
    A change to any of them must fail here."""
    tier = LmdbTier(f"lmdb://{tmp_path / 'env'}")
    try:
        env = tier._e().env
        flags = env.flags()
        assert flags["readonly"] is False
        assert flags["sync"] is True, "MDB_NOSYNC: commits no longer reach the disk"
        assert flags["metasync"] is True, "MDB_NOMETASYNC: the last commit may be undone"
        assert flags["map_async"] is False, "MDB_MAPASYNC: asynchronous flushes of the map"
        assert flags["lock"] is True, "MDB_NOLOCK: nothing keeps writers off readers' pages"
        # writemap is the default where the file system can reserve blocks (this one can);
        # it is durable only together with the flags above
        assert flags["writemap"] is True
        tier.append(b"rec 0 ")
        assert env.info()["last_txnid"] >= 1  # a write transaction committed under them
    finally:
        tier.close()
