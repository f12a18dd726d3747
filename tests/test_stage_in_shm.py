"""Saves staged straight into shm's segment files (``Policy.stage_in_shm``): the staging
copy becomes the version's blobs, so a dense state takes two copies of host memory, not
three, and everything a save and a restore promise still holds.

The store is the default one (shm, LMDB, a ``file://`` remote) with ``stage_in_shm="on"``
(the default, ``"auto"``, stages states of 64 MiB or more; these are a few MiB).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck import Policy
from tiercheck.backends._shm import ShmTier
from tiercheck.backends._shm_segments import HEADER, StageArea
from tiercheck.formats.codecs import read_header
from tiercheck.store.lifecycle import destroy_store

MIB = 1 << 20


def _state(seed: int, n: int = 8, size: int = MIB) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(size // 4, generator=g) for i in range(n)}


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() for k, v in state.items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _open(root: Path, mode: str = "on") -> tiercheck.Checkpointer:
    return tiercheck.Checkpointer(root, policy=Policy(stage_in_shm=mode))  # type: ignore[arg-type]


def _shm(ckpt: tiercheck.Checkpointer) -> ShmTier:
    tier = ckpt.tierset.get("shm").tier
    assert isinstance(tier, ShmTier)
    return tier


def _files_bytes(path: str) -> int:
    """Memory the files of a shm segment take (blobs, pool, tmp: slots included; a slot
    that is also a blob is one file with two names, counted once)."""
    files: dict[int, int] = {}
    for d in ("blobs", "pool", "tmp"):
        for e in os.scandir(os.path.join(path, d)):
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted meanwhile (the store's GC runs on its own)
                continue
            files[st.st_ino] = st.st_blocks * 512
    return sum(files.values())


@pytest.fixture
def root(tmp_path: Path) -> Any:
    path = tmp_path / "store"
    yield path
    destroy_store(path)


def test_dense_saves_stage_in_shm_and_hold_two_copies(root: Path) -> None:
    """Every save is staged into one of two ranges of shm's files and adopted: no private
    staging buffer, shm holding the two ranges (the newest version's blobs are one of
    them) and no third copy, every staged blob a raw blob with a page of header, and the
    newest version restored bit for bit, in this process and in a reader's store."""
    state = _state(1)
    nbytes = sum(t.numel() * 4 for t in state.values())
    with _open(root) as ckpt:
        ckpt.prepare(state)
        staging = ckpt._engine.staging
        shm = _shm(ckpt)
        saved = []
        for step in range(6):
            for t in state.values():
                t.mul_(1.01).add_(step)
            res = ckpt.save(step, state).wait()
            assert res.tiers["shm"] == "committed", res.errors
            assert staging.capacity == 0, "a private staging buffer was allocated"
            saved.append(_copy(state))
            area = ckpt._engine.shm_staging._area
            assert isinstance(area, StageArea) and area.nbytes <= 2.1 * nbytes
            held = _files_bytes(shm.path)
            assert held <= area.nbytes + 2 * MIB, (step, held)  # the ranges, no third copy
        blobs = [e.path for e in os.scandir(os.path.join(shm.path, "blobs"))]
        staged = [p for p in blobs if os.stat(p).st_size > HEADER]
        assert staged
        for path in staged:
            with open(path, "rb") as f:
                assert read_header(f.read(HEADER)).header_size == HEADER
        target = _state(99)
        assert ckpt.restore(target).step == 5
        assert _same(target, saved[-1])
    with tiercheck.Checkpointer(root, read_only=True) as reader:
        target = _state(98)
        assert reader.restore(target).step == 5
        assert _same(target, saved[-1])


def test_unchanged_chunks_and_a_new_layout(root: Path) -> None:
    """Half the state never changes: its chunks stay the blobs of the first save, and the
    slots that held them get fresh files when their range is staged into again (counted
    by ``replaced``); a state of another layout gets an area of its own. Every restore
    is exact."""
    state = _state(2)
    frozen = {k: v for i, (k, v) in enumerate(state.items()) if i % 2 == 0}
    with _open(root) as ckpt:
        ckpt.prepare(state)
        for step in range(5):
            for k, t in state.items():
                if k not in frozen:
                    t.add_(1)
            ckpt.save(step, state).wait()
        area = ckpt._engine.shm_staging._area
        assert isinstance(area, StageArea) and area.replaced > 0
        target = _state(97)
        ckpt.restore(target)
        assert _same(target, state)
        bigger = {**_copy(state), "extra": torch.arange(300_000, dtype=torch.float32)}
        ckpt.save(5, bigger).wait()
        assert ckpt._engine.shm_staging._area is not area
        target = {**_state(96), "extra": torch.zeros(300_000)}
        assert ckpt.restore(target).step == 5
        assert _same(target, bigger)


def test_a_pinned_reader_keeps_what_it_verified(root: Path) -> None:
    """A reader of another process pins a version's blobs (shm's pool lock) while the
    version is dropped and its range staged into again: the freed slots it may still map
    get fresh files, so the bytes it reads stay those it verified."""
    state = _state(3, n=4)
    with _open(root) as ckpt:
        ckpt.prepare(state)
        ckpt.save(0, state).wait()
        shm = _shm(ckpt)
        blob_ids = sorted(os.listdir(os.path.join(shm.path, "blobs")))
        reader = ShmTier(shm.url, root=shm.root, read_only=True)
        pins = reader.pin()
        assert pins is not None
        views = {b: bytes(pins.get(b)) for b in blob_ids}
        kept = {b: pins.get(b) for b in blob_ids}
        area = ckpt._engine.shm_staging._area
        assert isinstance(area, StageArea)
        before = area.replaced
        for step in range(1, 4):  # range 0 staged into again at step 2
            for t in state.values():
                t.add_(step)
            ckpt.save(step, state).wait()
        assert area.replaced > before  # slots of dropped blobs not reused while pinned
        assert all(bytes(kept[b]) == views[b] for b in blob_ids)
        for v in kept.values():
            v.release()
        pins.close()
        reader.close()
        target = _state(95, n=4)
        assert ckpt.restore(target).step == 3
        assert _same(target, state)


def test_the_saving_process_restores_staged_payloads_where_the_range_maps_them(
    root: Path,
) -> None:
    """In the process that saves, a restore reads the payload of a blob staged there where
    its staging range maps it (``ShmPins.parts``, counted by ``KeptMaps.staged_reads``),
    with no mapping of its own; the restores of the newest and the first version are
    exact."""
    state = _state(7, n=8)  # two 4 MiB chunks: w0..w3 change every save, w4..w7 never
    with _open(root) as ckpt:
        ckpt.prepare(state)
        first: dict[str, Any] = {}
        for step in range(5):  # ranges 0, 1, 0, 1, 0
            for i in range(4):
                state[f"w{i}"].add_(1)
            ckpt.save(step, state).wait()
            first = first or _copy(state)
        kept = _shm(ckpt)._kept
        before = kept.staged_reads
        target = _state(93, n=8)
        assert ckpt.restore(target).step == 4
        assert _same(target, state)
        assert kept.staged_reads > before
        assert ckpt.restore(target, step=0).step == 0
        assert _same(target, first)


def test_a_staged_blob_is_read_in_its_range_only_while_the_range_maps_its_file(
    tmp_path: Path,
) -> None:
    """A slot's payload answers for its blob while the range maps that blob's file: once
    arming gives the slot a fresh file (the old one still a blob) and other bytes are
    staged there, the old blob is read from its own file, and the new one from the
    range."""
    import blake3
    import numpy as np

    tier = ShmTier(f"shm://r{uuid.uuid4().hex[:10]}", root=str(tmp_path / "shm"))
    try:
        area = tier.staging_area([(0, MIB)], MIB)
        assert isinstance(area, StageArea)

        def stage(fill: int) -> str:
            r = area.take()
            area.arm(r)
            area.tensor(r).fill_(fill)
            area.done_staging()
            blob_id = blake3.blake3(bytes([fill]) * MIB).hexdigest()
            assert area.adopt(r, 0, blob_id)
            return blob_id

        old = stage(1)  # range 0
        stage(2)  # range 1
        new = stage(3)  # range 0 again: its slot, still blob ``old``, gets a fresh file
        assert area.replaced == 1
        pins = tier.pin()
        assert pins is not None
        try:
            for blob_id, fill, in_range in ((old, 1, False), (new, 3, True)):
                front, rest, size = pins.parts(blob_id, 64)
                assert size == HEADER + MIB and bytes(rest[-MIB:]) == bytes([fill]) * MIB
                addr = np.frombuffer(rest, np.uint8).ctypes.data
                assert (addr == area._bases[0]) is in_range
                del front, rest
        finally:
            pins.close()
        area.close()
    finally:
        tier.close()


def test_a_killed_writer_leaves_its_slots_to_the_next_open(root: Path) -> None:
    """A process killed with its staging area in place leaves its slots in shm's ``tmp/``
    under its pid; the next writable open unlinks the names of those that are blobs (the
    blobs stay) and pools the others. The acknowledged version restores exactly."""
    code = textwrap.dedent(
        f"""
        import os, torch, tiercheck
        from tiercheck import Policy
        g = torch.Generator().manual_seed(4)
        state = {{f"w{{i}}": torch.randn(MIB // 4, generator=g) for i in range(4)}}
        ckpt = tiercheck.Checkpointer({str(root)!r}, policy=Policy(stage_in_shm="on"))
        ckpt.prepare(state)
        for step in range(3):
            for t in state.values():
                t.add_(1)
            ckpt.save(step, state).wait()
        torch.save(state, {str(root) + ".expected"!r})
        os.kill(os.getpid(), 9)
        """
    ).replace("MIB", str(MIB))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-3000:]
    expected = torch.load(str(root) + ".expected")
    os.unlink(str(root) + ".expected")
    with _open(root) as ckpt:
        shm = _shm(ckpt)
        left = [e.name for e in os.scandir(os.path.join(shm.path, "tmp"))]
        dead = [n for n in left if not n.startswith(f"{os.getpid()}.")]
        assert dead == [], dead  # the killed writer's slots: recycled at this open
        names = set(os.listdir(os.path.join(shm.path, "blobs")))
        assert names and all(
            os.stat(os.path.join(shm.path, "blobs", b)).st_nlink == 1 for b in names
        )
        target = _state(94, n=4)
        assert ckpt.restore(target).step == 2
        assert _same(target, expected)


def test_auto_stages_only_large_states_and_off_never(root: Path, tmp_path: Path) -> None:
    """``"auto"`` (the default) keeps a small state in the private buffer; ``"off"`` keeps
    every state there."""
    state = _state(5, n=2)
    with _open(root, "auto") as ckpt:
        ckpt.save(0, state).wait()
        assert ckpt._engine.shm_staging._area is None
        assert ckpt._engine.staging.capacity > 0
    other = tmp_path / "off"
    try:
        with _open(other, "off") as ckpt:
            ckpt.save(0, state).wait()
            assert ckpt._engine.shm_staging._area is None
    finally:
        destroy_store(other)


def test_a_wrapper_forwards_the_area_of_its_inner_tier(tmp_path: Path) -> None:
    """A wrapper forwards ``staging_area``; the area names the inner tier, which adopts
    the windows (the engine stages privately when that is not the store's own tier)."""
    from tiercheck.backends.wrappers import WrapperTier

    inner = ShmTier(f"shm://w{uuid.uuid4().hex[:10]}", root=str(tmp_path / "shm"))
    try:
        area = WrapperTier(inner).staging_area([(0, 8192)], 8192)
        assert area is not None and area.tier is inner
        area.close()
        assert inner.staging_area([(0, 64), (64, 64)], 128) is None  # not at a page offset
        assert inner.staging_area([(0, 4096), (4096, 4096)], 8000) is None  # not the stream
    finally:
        inner.close()


def test_auto_leaves_a_shm_only_store_to_the_private_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``"auto"`` stages a large enough state in shm only where another synchronous tier
    is behind it (a shm-only store's versions each need the one before in shm until they
    commit, and such a store is saved often); ``"on"`` stages it there anyway."""
    from tiercheck.engine import shm_staging

    monkeypatch.setattr(shm_staging, "AUTO_MIN_BYTES", 1)
    state = _state(6, n=2)
    for mode, staged in (("auto", False), ("on", True)):
        where = tmp_path / mode
        spec = tiercheck.TierSpec("shm", f"shm://s{uuid.uuid4().hex[:10]}")
        try:
            with tiercheck.Checkpointer(
                where,
                tiers=[spec],
                policy=Policy(stage_in_shm=mode),  # type: ignore[arg-type]
            ) as ckpt:
                ckpt.save(0, state).wait()
                assert (ckpt._engine.shm_staging._area is not None) is staged
                target = _state(93, n=2)
                ckpt.restore(target)
                assert _same(target, state)
        finally:
            destroy_store(where)
