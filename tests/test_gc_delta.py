"""GC keeps the base of a delta blob that no log record describes.

A save that crashes after writing a delta blob but before its prepare record leaves the
delta on the tier with no record of its base; a later version with the same chunk finds it
present and reuses it. GC must learn the base from the blob's header (``Tier.head``), or it
sweeps the base and the later version becomes undecodable. These tests build that state
directly, without killing anything.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Literal, cast

import blake3
import pytest
import torch
from crash_harness import bit_mismatch, check_store

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import TierUnavailable
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.formats.manifest import ShardManifest, VersionInfo
from tiercheck.store.catalog import TierLog
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot
from tiercheck.testing.conformance import blob_id
from tiercheck.upkeep.retention import GCState, collect_garbage, mark

CHUNK = 4096
N = 4 * CHUNK // 4  # float32 elements of "w": four chunks


def weights(step: int) -> torch.Tensor:
    """``w`` at ``step``: chunk 1 takes a small change at step 1 and keeps it; chunk 3
    changes every step (so every version differs)."""
    w = torch.arange(N, dtype=torch.float32) / 7
    if step >= 1:
        w[1024:1040] += 1.0  # chunk 1: a small change, a delta against step 0 pays
    w[3072:3088] += step
    return w


def state_at(step: int) -> dict[str, Any]:
    return {"w": weights(step), "step": step}


def chunk_bytes(step: int, index: int) -> bytes:
    raw = weights(step).numpy().tobytes()
    return raw[index * CHUNK : (index + 1) * CHUNK]


def open_store(tmp_path: Path) -> Checkpointer:
    policy = Policy(
        base_every=3,
        chunk_size=CHUNK,
        gc_grace_seconds=0,
        hash_threads=1,
        tiers={"lmdb": TierPolicy(versions="all", codec="delta", keep_bases=1, keep_diffs=2)},
    )
    spec = TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}")
    return Checkpointer(tmp_path / "store", tiers=[spec], policy=policy, threads=2)


def test_reused_orphan_delta_keeps_its_base(tmp_path: Path) -> None:
    ckpt = open_store(tmp_path)
    ckpt.save(0, state_at(0)).wait()  # v0, a base: its chunks are zstd blobs
    ckpt.flush()  # the sweep after opening (grace 0) is done before the orphan is planted
    lmdb = ckpt.tierset.get("lmdb").tier
    assert lmdb is not None
    v0 = ckpt.refresh().versions[0]
    base_chunk = ChunkFetcher(ckpt.tierset.by_speed()).manifest(v0.shards[0]).chunks[1]
    assert base_chunk.id == blob_id(chunk_bytes(0, 1))  # "w" starts the stream

    # What a diff save of step 1 leaves when it is killed between writing the delta blob
    # of chunk 1 and appending its prepare record: the delta, and no record of its base.
    orphan = chunk_bytes(1, 1)
    orphan_id = blob_id(orphan)
    delta = encode_blob(
        orphan, Codec.DELTA, base=chunk_bytes(0, 1), base_id=base_chunk.id, elem_size=4
    )
    assert lmdb.put(orphan_id, delta)

    # The next process saves on: every later version holds chunk 1 of step 1, finds it
    # present and reuses the orphan. v3 is a base; retention then drops v0-v2, and GC
    # (grace 0) sweeps what it thinks nothing references.
    for step in range(1, 6):
        ckpt.save(step, state_at(step)).wait()
    ckpt.flush()  # the retention those saves asked for has run
    tl = ckpt.refresh().logs["lmdb"]
    assert orphan_id not in tl.deltas  # no record names the orphan's base...
    assert 0 not in tl.held()  # ...and the version that did is gone
    ckpt.gc()

    held = ckpt.refresh().logs["lmdb"].held()
    assert held == [3, 4, 5]
    for version in held:  # each holds the orphan: its base must have survived
        info = ckpt.restore(None, version=version)
        bad = bit_mismatch(info.state, state_at(info.step))
        assert bad is None, f"version {version}: {bad}"
    assert lmdb.has([orphan_id, base_chunk.id]) == {orphan_id, base_chunk.id}
    assert check_store(ckpt) == []
    ckpt.close()

    # a new Checkpointer (an empty header cache) keeps it too
    again = open_store(tmp_path)
    again.gc()
    assert lmdb_has(again, [orphan_id, base_chunk.id])
    assert bit_mismatch(again.restore(None).state, state_at(5)) is None
    again.close()


def lmdb_has(ckpt: Checkpointer, ids: list[str]) -> bool:
    tier = ckpt.tierset.get("lmdb").tier
    assert tier is not None
    return tier.has(ids) == set(ids)


# --- the mark itself, on a memory tier --------------------------------------------------------


class CountingTier:
    """Counts ``head`` calls of the tier it wraps; ``fail`` makes them raise."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.heads: list[str] = []
        self.fail = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        self.heads.append(blob_id)
        if self.fail:
            raise TierUnavailable("down", key=blob_id)
        return self.inner.head(blob_id, nbytes)


def _manifest(chunk_ids: list[str]) -> ShardManifest:
    from tiercheck.formats.manifest import ChunkRef

    refs = tuple(ChunkRef(c, i * CHUNK, CHUNK) for i, c in enumerate(chunk_ids))
    return ShardManifest(
        version=1,
        rank=0,
        world_size=1,
        chunk_size=CHUNK,
        stream_bytes=len(refs) * CHUNK,
        entries=(),
        chunks=refs,
        tree=None,
        extra={},
    )


def test_mark_follows_delta_headers_transitively_and_reads_each_once() -> None:
    tier = open_tier(f"memory://{uuid.uuid4().hex}")
    raw = {name: blake3.blake3(name.encode()).digest(length=CHUNK) for name in "abcdef"}
    ids = {name: blob_id(data) for name, data in raw.items()}

    def put_delta(name: str, base: str) -> None:
        tier.put(
            ids[name],
            encode_blob(raw[name], Codec.DELTA, base=raw[base], base_id=ids[base]),
        )

    put_delta("a", "b")  # a -> b -> c, all orphans: only headers say so
    put_delta("b", "c")
    tier.put(ids["c"], encode_blob(raw["c"], Codec.ZSTD))
    damaged = bytearray(encode_blob(raw["d"], Codec.DELTA, base=raw["c"], base_id=ids["c"]))
    damaged[40] ^= 1  # a flipped bit in the base id: the header check fails
    tier.put(ids["d"], bytes(damaged))  # unreadable header: skipped
    tier.put(ids["f"], encode_blob(raw["f"], Codec.RAW))  # garbage
    # "e" is referenced but absent: skipped
    manifest_id = "f" * 64
    tl = TierLog("t")
    tl.committed[1] = VersionInfo(1, 1, "base", None, 1, (manifest_id,), 0.0, 0)
    m = _manifest([ids["a"], ids["d"], ids["e"]])
    counting = CountingTier(tier)
    slot = TierSlot(TierSpec("t", "memory://t"), cast(Tier, counting), TierPolicy(codec="delta"))
    state = GCState()

    def sweep() -> set[str]:
        report = collect_garbage(slot, tl, lambda mid: m, state=state, grace=0)
        return set(report.deleted_ids)

    assert sweep() == {ids["f"]}
    assert set(tier.list()) == {ids[n] for n in "abcd"}
    assert manifest_id not in counting.heads  # manifests are never deltas
    assert sorted(counting.heads) == sorted(ids[n] for n in "abcde")
    assert state.delta_bases["t"] == {ids["a"]: ids["b"], ids["b"]: ids["c"], ids["c"]: None}

    counting.heads.clear()
    assert sweep() == set()  # cached answers: only the skipped blobs are read again
    assert sorted(counting.heads) == sorted([ids["d"], ids["e"]])
    assert mark(tl, lambda mid: m) == {manifest_id, ids["a"], ids["d"], ids["e"]}  # log only

    # a header read that fails for another reason: the mark may be incomplete, no sweep
    tier.put(ids["f"], encode_blob(raw["f"], Codec.RAW))
    del state.delta_bases["t"][ids["a"]]
    counting.fail = True
    assert sweep() == set()
    assert ids["f"] in set(tier.list())
    counting.fail = False
    assert sweep() == {ids["f"]}
    assert ids["f"] not in state.delta_bases["t"]


def test_a_blob_rewritten_against_another_base_keeps_both() -> None:
    """The log says chunk a is a delta of b (an old save's record), but a crashed save
    rewrote a, after it was swept, as a delta of c: GC must keep c (and b, to be safe)."""
    tier = open_tier(f"memory://{uuid.uuid4().hex}")
    raw = {name: blake3.blake3(name.encode()).digest(length=CHUNK) for name in "abc"}
    ids = {name: blob_id(data) for name, data in raw.items()}
    tier.put(ids["a"], encode_blob(raw["a"], Codec.DELTA, base=raw["c"], base_id=ids["c"]))
    for name in "bc":
        tier.put(ids[name], encode_blob(raw[name], Codec.ZSTD))
    manifest_id = "e" * 64
    tl = TierLog("t")
    tl.committed[1] = VersionInfo(1, 1, "diff", 0, 1, (manifest_id,), 0.0, 0)
    tl.deltas[ids["a"]] = ids["b"]  # the stale record
    m = _manifest([ids["a"]])
    slot = TierSlot(TierSpec("t", "memory://t"), tier, TierPolicy(codec="delta"))
    report = collect_garbage(slot, tl, lambda mid: m, state=GCState(), grace=0)
    assert report.deleted_ids == []
    assert set(tier.list()) == set(ids.values())


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_no_header_reads_on_a_tier_without_deltas(codec: Literal["raw", "zstd"]) -> None:
    tier = open_tier(f"memory://{uuid.uuid4().hex}")
    data = b"x" * 100
    tier.put(blob_id(data), encode_blob(data, Codec.RAW))
    tl = TierLog("t")
    tl.committed[1] = VersionInfo(1, 1, "base", None, 1, ("f" * 64,), 0.0, 0)
    counting = CountingTier(tier)
    slot = TierSlot(TierSpec("t", "memory://t"), cast(Tier, counting), TierPolicy(codec=codec))
    report = collect_garbage(
        slot, tl, lambda mid: _manifest([blob_id(data)]), state=GCState(), grace=0
    )
    assert counting.heads == [] and report.headers_read == 0 and report.deleted == 0
