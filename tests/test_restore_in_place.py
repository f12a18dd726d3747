"""A restore from shm verifies each chunk where shm holds it and copies it once, into the
caller's tensor (issue 32, item 2): no staging copy, so a restarted process touches no
fresh staging pages; and while the restore holds its chunks, no put rewrites their pages.

Real /dev/shm segments (under the test's directory) and a real LMDB environment.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tiercheck
from tiercheck import Policy, TierSpec
from tiercheck.backends._shm import ShmTier
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.testing.conformance import blob

CHUNK = 64 * 1024


def specs(tmp_path: Path, name: str) -> list[TierSpec]:
    return [
        TierSpec("shm", f"shm://{name}", {"root": str(tmp_path / "shm")}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
    ]


def saved_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": nn.Linear(64, 32),  # stateful: its tensors are kept by the undo copy
        "weights": {f"w{i}": torch.randn(40_000) for i in range(4)},  # loose, written last
        "table": np.arange(30_000, dtype=np.int64),
        "step": 12,
    }


def blank_state() -> dict[str, Any]:
    torch.manual_seed(1)
    return {
        "model": nn.Linear(64, 32),
        "weights": {f"w{i}": torch.zeros(40_000) for i in range(4)},
        "table": np.zeros(30_000, dtype=np.int64),
        "step": 0,
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want["model"].state_dict().items():
        assert torch.equal(got["model"].state_dict()[k], v), k
    for k, v in want["weights"].items():
        assert torch.equal(got["weights"][k], v), k
    assert np.array_equal(got["table"], want["table"])
    assert got["step"] == want["step"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[tiercheck.Checkpointer, list[TierSpec]]]:
    """A store of shm and LMDB holding one base version of :func:`saved_state`."""
    tiers = specs(tmp_path, f"ip{uuid.uuid4().hex[:10]}")
    ckpt = tiercheck.Checkpointer(
        tmp_path / "store", tiers=tiers, policy=Policy(chunk_size=CHUNK, gc_grace_seconds=0)
    )
    ckpt.save(12, saved_state()).wait()
    ckpt.flush()
    try:
        yield ckpt, tiers
    finally:
        ckpt.close()


def test_a_restarted_reader_restores_from_shm_without_staging(
    tmp_path: Path, store: tuple[tiercheck.Checkpointer, list[TierSpec]]
) -> None:
    """A fresh process's restore (a second Checkpointer, read-only) fills the caller's
    tensors straight from the shm segments, every chunk verified there: its staging buffer
    is never allocated, and the shm tier can be pinned again afterwards (released)."""
    writer, tiers = store
    reader = tiercheck.Checkpointer(tmp_path / "store", tiers=tiers, read_only=True)
    try:
        target = blank_state()
        info = reader.restore(target)
        assert info.version == 0 and info.chunks_from == {"shm": sum(info.chunks_from.values())}
        assert_same(target, saved_state())
        assert reader._engine.staging.capacity == 0  # nothing was staged
    finally:
        reader.close()
    shm = writer.tierset.get("shm").tier
    assert shm is not None
    pins = shm.pin()
    assert pins is not None, "the restore left shm pinned"
    pins.close()


def test_a_chunk_damaged_in_shm_comes_from_lmdb_and_is_repaired(
    store: tuple[tiercheck.Checkpointer, list[TierSpec]],
) -> None:
    """A chunk that fails its check where shm holds it is read from LMDB instead (into a
    buffer of its own), the restore is exact, and shm's copy is rewritten."""
    ckpt, _ = store
    shm = ckpt.tierset.get("shm").tier
    assert shm is not None
    manifest = ChunkFetcher(ckpt.tierset.by_speed()).manifest(ckpt.refresh().versions[0].shards[0])
    bad = manifest.chunks[len(manifest.chunks) // 2].id
    damaged = bytearray(shm.get(bad))
    damaged[-1] ^= 0x01
    shm.put(bad, bytes(damaged), overwrite=True)
    target = blank_state()
    info = ckpt.restore(target)
    assert_same(target, saved_state())
    assert ("shm", bad) in info.corrupt and ("shm", bad) in info.repaired
    assert info.chunks_from == {"shm": len(manifest.chunks), "lmdb": 1}  # manifest too
    good = ChunkFetcher([ckpt.tierset.get("lmdb")]).fetch(bad)[0]
    assert bytes(shm.get(bad)) == encode_blob(good, Codec.RAW)


class _Rewriter(nn.Linear):
    """A layer whose ``load_state_dict`` runs ``during`` first: a restore calls it after
    every chunk was verified and before the loose tensors are copied."""

    def __init__(self, during: Any = None) -> None:
        super().__init__(64, 32)
        self.during = during

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.during is not None:
            self.during()
        return super().load_state_dict(*args, **kwargs)


def test_chunks_verified_in_place_cannot_change_before_they_are_copied(
    store: tuple[tiercheck.Checkpointer, list[TierSpec]],
) -> None:
    """Between the check of a chunk and its copy into the caller's tensor, the version's
    blobs are deleted from shm and blobs of the same sizes put, as a writer's retention
    and next save would: those puts do not recycle the deleted blobs' pages while the
    restore holds them, so the tensors get what was verified."""
    ckpt, _ = store
    shm = ckpt.tierset.get("shm").tier
    assert isinstance(shm, ShmTier)
    torch.manual_seed(0)
    saved = {**saved_state(), "model": _Rewriter()}
    ckpt.save(13, saved).wait()
    ckpt.flush()
    ids = list(shm.list())
    sizes = [shm.size(b) for b in ids]

    def rewrite() -> None:
        shm.delete(ids)
        for i, n in enumerate(sizes):
            shm.put(*blob(n, seed=900 + i))

    torch.manual_seed(1)
    target = {**blank_state(), "model": _Rewriter(rewrite)}
    reused = shm.segments_reused
    assert ckpt.restore(target).version == 1
    assert_same(target, saved)
    assert shm.segments_reused == reused  # every put while pinned wrote fresh pages


def _mapped(blob_id: str) -> bool:
    """Whether this process maps ``blob_id``'s file (``/proc/self/maps``)."""
    return blob_id in Path("/proc/self/maps").read_text()


def test_pins_release_the_pool_at_once_and_unmap_on_later(tmp_path: Path) -> None:
    """``close(later)`` releases shm's pool lock before it returns (a put may recycle
    pages, another reader may pin) and leaves the unmapping to ``later``: the blob stays
    mapped until that runs, then is gone, every map closed (none still viewed). A
    ``later`` that refuses the work (a pool shut down) leaves it to ``close`` itself."""
    shm = ShmTier(f"shm://pl{uuid.uuid4().hex[:10]}", root=str(tmp_path / "shm"))
    try:
        blob_id, data = blob(3 * CHUNK, seed=7)
        shm.put(blob_id, data)
        pins = shm.pin()
        assert pins is not None
        assert bytes(pins.get(blob_id)) == data
        jobs: list[Any] = []
        pins.close(jobs.append)
        again = shm.pin()
        assert again is not None, "close left the pool locked"
        again.close()
        assert _mapped(blob_id) and len(jobs) == 1
        assert jobs[0]() == 0  # unmapped: no view of it was left
        assert not _mapped(blob_id)
        pins.close()  # idempotent
        # a pool already shut down refuses the work: the unmapping runs in close()
        pins = shm.pin()
        assert pins is not None
        pins.get(blob_id)
        pool = ThreadPoolExecutor(1)
        pool.shutdown()
        pins.close(pool.submit)
        assert not _mapped(blob_id)
    finally:
        shm.close()


def test_the_writing_process_pins_through_its_kept_mappings(tmp_path: Path) -> None:
    """In the process that wrote them, blobs in segments shm keeps mapped (prepared, or
    reused) are pinned through those mappings: no mapping of the blob's file is made and
    no page faulted. What was verified stays what is read: a put while pinned writes
    fresh pages, not the pinned segment's, and a blob deleted and its segment freed while
    a view of it lives (its kept mapping dropped) stays readable, unchanged, until the
    last slice of it goes."""
    shm = ShmTier(f"shm://kp{uuid.uuid4().hex[:10]}", root=str(tmp_path / "shm"))
    try:
        blob_id, data = blob(3 * CHUNK, seed=8)
        assert shm.preallocate([len(data)]) == len(data)  # a segment shm keeps mapped
        shm.put(blob_id, data)
        pins = shm.pin()
        assert pins is not None
        view = pins.get(blob_id)
        assert view.readonly and bytes(view) == data
        assert not _mapped(blob_id), "pinned with a mapping of its own"
        shm.delete([blob_id])  # its segment to the pool, still mapped
        reused = shm.segments_reused
        other = blob(3 * CHUNK, seed=9)
        shm.put(*other)  # pinned: fresh pages
        assert shm.segments_reused == reused and bytes(view) == data
        assert shm.trim_pool(0) == len(data)  # the segment freed, its mapping dropped
        assert bytes(view) == data
        part = view[CHUNK:]  # a slice outlives close (the view itself is released)
        pins.close()
        assert bytes(part) == data[CHUNK:]
        part.release()
        again = shm.pin()
        assert again is not None
        assert bytes(again.get(other[0])) == other[1]
        again.close()
    finally:
        shm.close()


def test_a_restore_unmaps_its_pins_off_the_callers_time(
    store: tuple[tiercheck.Checkpointer, list[TierSpec]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore drops its views of the blobs it verified in shm before it closes its
    pins, and hands their unmapping (~30 ms per GiB) to the I/O pool: no map is left for
    the caller's frame to unmap when the views die there."""
    from tiercheck.backends import _shm_segments

    ckpt, _ = store
    seen: list[tuple[bool, int]] = []
    close = _shm_segments.ShmPins.close

    def watched(self: _shm_segments.ShmPins, later: Any = None) -> None:
        def run_now(job: Any) -> None:
            seen.append((True, job()))

        if later is None:
            seen.append((False, -1))
            close(self)
        else:
            close(self, run_now)

    monkeypatch.setattr(_shm_segments.ShmPins, "close", watched)
    target = blank_state()
    assert ckpt.restore(target).version == 0
    assert_same(target, saved_state())
    assert seen == [(True, 0)]  # handed on, and nothing of the restore still viewed it
