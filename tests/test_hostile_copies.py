"""Copies in shm that are valid blobs of the wrong chunk (found by new-user testing): each
is corruption of that copy, read from LMDB instead and repaired, never a crash.

- another chunk's longer blob in place of a short chunk: ``decode_blob`` raised a bare
  ``ValueError`` (the caller's buffer is the chunk's length), which no fallback caught;
- a diff's delta blob written over the copy of its own base chunk: reading the base meant
  decoding a delta against itself, and the restore, ``verify`` and ``export`` recursed
  until ``RecursionError``.

Real /dev/shm segments (under the test's directory) and a real LMDB environment.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

import tiercheck
from tiercheck import Policy, TierPolicy, TierSpec
from tiercheck.formats.manifest import ChunkRef
from tiercheck.store.fetch import ChunkFetcher


def open_store(tmp_path: Path, policy: Policy) -> tiercheck.Checkpointer:
    tiers = [
        TierSpec("shm", f"shm://hc{uuid.uuid4().hex[:10]}", {"root": str(tmp_path / "shm")}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
    ]
    return tiercheck.Checkpointer(tmp_path / "store", tiers=tiers, policy=policy)


def chunks(ckpt: tiercheck.Checkpointer, version: int) -> tuple[ChunkRef, ...]:
    info = ckpt.refresh().versions[version]
    return ChunkFetcher(ckpt.tierset.by_speed()).manifest(info.shards[0]).chunks


def exact(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(torch.equal(got[k], v) for k, v in want.items())


def test_a_longer_blob_of_another_chunk_in_place_of_a_short_one_is_corrupt(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    saved = {"big": torch.randn(300_000), "small": torch.randn(10)}
    with open_store(tmp_path, Policy(chunk_size=64 * 1024)) as ckpt:
        ckpt.save(1, saved).wait()
        ckpt.flush()
        refs = chunks(ckpt, 0)
        short, long = min(refs, key=lambda c: c.length), max(refs, key=lambda c: c.length)
        assert short.length < long.length
        shm = ckpt.tierset.get("shm").tier
        assert shm is not None
        shm.put(short.id, bytes(shm.get(long.id)), overwrite=True)
        target = {k: torch.full_like(v, 7.0) for k, v in saved.items()}
        info = ckpt.restore(target)
        assert exact(target, saved)
        assert ("shm", short.id) in info.corrupt and ("shm", short.id) in info.repaired, info
        target = {k: torch.full_like(v, 7.0) for k, v in saved.items()}
        assert ckpt.restore(target, version=0).chunks_from == {"shm": len(refs) + 1}
        assert exact(target, saved)


def test_a_delta_blob_over_the_copy_of_its_own_base_is_corrupt(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = {"w": torch.randn(300_000)}
    diff = {"w": base["w"].clone()}
    diff["w"][::1000] += 1e-3
    policy = Policy(chunk_size=64 * 1024, tiers={"shm": TierPolicy(codec="delta")})
    with open_store(tmp_path, policy) as ckpt:
        ckpt.save(1, base).wait()
        ckpt.save(2, diff).wait()
        ckpt.flush()
        b, d = next((a, c) for a, c in zip(chunks(ckpt, 0), chunks(ckpt, 1)) if a.id != c.id)
        shm = ckpt.tierset.get("shm").tier
        assert shm is not None
        delta = bytes(shm.get(d.id))
        assert delta[6] == 2 and delta[32:64].hex() == b.id  # codec delta, base b
        shm.put(b.id, delta, overwrite=True)
        target = {"w": torch.zeros(300_000)}
        info = ckpt.restore(target, version=0)
        assert exact(target, base)
        assert ("shm", b.id) in info.corrupt, info
        target = {"w": torch.zeros(300_000)}
        ckpt.restore(target)
        assert exact(target, diff)
