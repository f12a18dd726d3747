"""Manifests read as hostile input: a tier is not a trusted place (a shared file system, a
bucket), so a manifest someone crafted, with a valid id and a commit record naming it, must
make its version unreadable (``BlobCorrupt``) before anything is allocated by its claims,
and restore must fall back to the previous version. Never an untyped exception."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercheck import Checkpointer, Policy, TierPolicy
from tiercheck.errors import BlobCorrupt, TiercheckError
from tiercheck.formats.codecs import Codec, decode_blob, encode_blob
from tiercheck.formats.ids import chunk_id
from tiercheck.formats.manifest import (
    ChunkRef,
    CommitRecord,
    Entry,
    PrepareRecord,
    ShardManifest,
    VersionInfo,
    element_size,
    pack_manifest,
    unpack_manifest,
)
from tiercheck.restore.binding import check_stream
from tiercheck.store.catalog import append_record

Mutation = Callable[[ShardManifest], ShardManifest]


def _state(scale: float) -> dict[str, Any]:
    return {
        "w": torch.arange(1000, dtype=torch.float32) * scale,
        "a": np.arange(10, dtype="<f4") * scale,
        "n": int(scale),
        "nested": {"x": torch.ones(3, dtype=torch.float64) * scale},
    }


def _blank() -> dict[str, Any]:
    return {
        "w": torch.zeros(1000),
        "a": np.zeros(10, dtype="<f4"),
        "n": 0,
        "nested": {"x": torch.zeros(3, dtype=torch.float64)},
    }


def _entry(m: ShardManifest, key: str, **changes: Any) -> ShardManifest:
    entries = tuple(dataclasses.replace(e, **changes) if e.key == key else e for e in m.entries)
    return dataclasses.replace(m, entries=entries)


class Store:
    """A store on one file:// tier holding versions 1 and 2, and a way to commit a crafted
    version whose manifest is any :class:`ShardManifest`, under a valid id."""

    def __init__(self, root: Path) -> None:
        keep = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
        self.ckpt = Checkpointer(
            root,
            tiers=[("remote", f"file://{root / 'remote'}")],
            policy=Policy(base_every=1, tiers={"remote": keep}),
        )
        for step in (1, 2):
            self.ckpt.save(step, _state(float(step))).wait()
        catalog = self.ckpt.refresh()
        self.latest = max(catalog.versions)
        info = catalog.versions[self.latest]
        self.tier = self.ckpt.tierset.get("remote").tier
        assert self.tier is not None
        raw = self.tier.get(info.shards[0])
        self.manifest = unpack_manifest(decode_blob(bytes(raw), info.shards[0]))
        self.next_id: int = self.latest + 1

    def commit(self, manifest: ShardManifest) -> int:
        """Commit ``manifest`` as a new version (the newest); return its id."""
        vid = self.next_id
        self.next_id += 1
        data = pack_manifest(dataclasses.replace(manifest, version=vid))
        mid = chunk_id(data)
        assert self.tier is not None
        self.tier.put(mid, encode_blob(data, Codec.RAW), overwrite=True)
        append_record(self.tier, PrepareRecord(vid, 0, vid, "base", None, mid, 1, len(data), 1.0))
        info = VersionInfo(vid, vid, "base", None, 1, (mid,), 1.0, manifest.stream_bytes)
        append_record(self.tier, CommitRecord(info))
        return vid


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "store")
    try:
        yield s
    finally:
        s.ckpt.close()


HUGE = 1 << 60
CRAFTED: dict[str, Mutation] = {
    "object-dtype": lambda m: _entry(m, "a", dtype="|O"),
    "structured-dtype": lambda m: _entry(m, "a", dtype="[('f0', '<f4')]"),
    "tensor-with-numpy-dtype": lambda m: _entry(m, "w", dtype="<f4"),
    "unknown-torch-dtype": lambda m: _entry(m, "w", dtype="qint8"),
    "ndarray-with-torch-dtype": lambda m: _entry(m, "a", dtype="float32"),
    "shape-needs-more-bytes": lambda m: _entry(m, "w", shape=(2000,)),
    "shape-needs-fewer-bytes": lambda m: _entry(m, "w", shape=(10,)),
    "shape-of-2^60-bytes": lambda m: _entry(m, "w", shape=(HUGE // 4,), nbytes=HUGE),
    "ndarray-of-2^60-bytes": lambda m: _entry(m, "a", shape=(HUGE // 4,), nbytes=HUGE),
    "entry-past-the-stream": lambda m: _entry(m, "w", offset=m.stream_bytes),
    "overlapping-entries": lambda m: _entry(
        m, "nested/x", offset=next(e.offset for e in m.entries if e.key == "w")
    ),
    "scalar-with-shape": lambda m: _entry(m, "n", shape=(4,)),
    "stream-of-2^60-bytes": lambda m: dataclasses.replace(
        m,
        stream_bytes=HUGE,
        chunks=(*m.chunks, ChunkRef(m.chunks[0].id, m.stream_bytes, HUGE - m.stream_bytes)),
    ),
    "stream-longer-than-its-chunks": lambda m: dataclasses.replace(m, stream_bytes=HUGE),
    "chunks-with-a-gap": lambda m: dataclasses.replace(
        m, chunks=tuple(dataclasses.replace(c, offset=c.offset + 64) for c in m.chunks)
    ),
    "tree-names-a-missing-entry": lambda m: dataclasses.replace(m, tree={"d": [["w", {"e": 99}]]}),
    "tree-names-a-sharded-piece": lambda m: dataclasses.replace(m, tree={"d": [["w", {"s": 0}]]}),
    "tree-node-not-a-pair": lambda m: dataclasses.replace(m, tree={"d": [["w"]]}),
    "tree-too-deep": lambda m: dataclasses.replace(m, tree=_deep(300)),
    "rank-outside-world": lambda m: dataclasses.replace(m, rank=3),
}


def _deep(n: int) -> Any:
    node: Any = {"e": 0}
    for _ in range(n):
        node = {"o": node}
    return node


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_manifest_is_corrupt_and_restore_falls_back(store: Store, name: str) -> None:
    bad = CRAFTED[name](store.manifest)
    with pytest.raises(BlobCorrupt):
        check_stream(unpack_manifest(pack_manifest(bad)))
    vid = store.commit(bad)
    state = _blank()
    info = store.ckpt.restore(state)
    assert info.version == store.latest, info
    assert info.fallback is not None and f"version {vid}" in info.fallback
    assert torch.equal(state["w"], _state(2.0)["w"]) and state["n"] == 2
    assert np.array_equal(state["a"], _state(2.0)["a"])


def test_an_intact_crafted_version_still_restores(store: Store) -> None:
    """The checks refuse nothing a writer produces: the newest version's own manifest,
    committed again under a new id, restores."""
    vid = store.commit(store.manifest)
    state = _blank()
    assert store.ckpt.restore(state).version == vid
    assert torch.equal(state["w"], _state(2.0)["w"])


# --- fuzz ---------------------------------------------------------------------------------

_INTS = st.one_of(
    st.integers(0, 4096),
    st.sampled_from([1 << 31, 1 << 32, 1 << 40, 1 << 60, (1 << 63) - 1]),
    st.integers(0, (1 << 63) - 1),
)
_DTYPES = st.sampled_from(
    [
        "float32",
        "float64",
        "int64",
        "bfloat16",
        "qint8",
        "<f4",
        "<f8",
        ">f8",
        "|O",
        "object",
        "|V8",
        "V0",
        "f4,f4",
        "(2,)<f4",
        "<U4",
        "<M8[s]",
        "",
        "bogus",
    ]
)
_TREES = st.recursive(
    st.one_of(
        st.builds(lambda i: {"e": i}, st.integers(-2, 6)),
        st.builds(lambda i: {"s": i}, st.integers(-1, 6)),
        st.builds(lambda s: {"r": s}, st.text(max_size=4)),
        st.none(),
        st.integers(),
    ),
    lambda kids: st.one_of(
        st.builds(lambda c: {"o": c}, kids),
        st.builds(lambda cs: {"l": cs}, st.lists(kids, max_size=3)),
        st.builds(lambda cs: {"t": cs}, st.lists(kids, max_size=3)),
        st.builds(
            lambda ks, cs: {"d": [[k, c] for k, c in zip(ks, cs)]},
            st.lists(st.text(max_size=3), max_size=3),
            st.lists(kids, max_size=3),
        ),
        st.builds(lambda c: {"x": c}, kids),
    ),
    max_leaves=8,
)


def _set_entry(m: ShardManifest, i: int, change: dict[str, Any]) -> ShardManifest:
    entries = list(m.entries)
    entries[i % len(entries)] = dataclasses.replace(entries[i % len(entries)], **change)
    return dataclasses.replace(m, entries=tuple(entries))


def _set_chunk(m: ShardManifest, i: int, offset: int, length: int) -> ShardManifest:
    chunks = list(m.chunks)
    chunks[i % len(chunks)] = ChunkRef(chunks[i % len(chunks)].id, offset, length)
    return dataclasses.replace(m, chunks=tuple(chunks))


def _set(m: ShardManifest, change: dict[str, Any]) -> ShardManifest:
    return dataclasses.replace(m, **change)


def _apply(ops: list[Mutation], m: ShardManifest) -> ShardManifest:
    for op in ops:
        m = op(m)
    return m


@st.composite
def mutations(draw: st.DrawFn) -> Mutation:
    """One to three changes to a manifest's sizes, dtypes, chunks or tree."""
    entry_values: dict[str, st.SearchStrategy[Any]] = {
        "kind": st.sampled_from(["tensor", "ndarray", "msgpack", "pickle"]),
        "dtype": _DTYPES,
        "shape": st.lists(_INTS, max_size=3).map(tuple),
        "offset": _INTS,
        "nbytes": _INTS,
    }
    ops: list[Mutation] = []
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from([*entry_values, "stream", "chunk", "tree", "chunk_size"]))
        i = draw(st.integers(0, 7))
        if what in entry_values:
            ops.append(functools.partial(_set_entry, i=i, change={what: draw(entry_values[what])}))
        elif what == "chunk":
            ops.append(functools.partial(_set_chunk, i=i, offset=draw(_INTS), length=draw(_INTS)))
        elif what == "tree":
            ops.append(functools.partial(_set, change={"tree": draw(_TREES)}))
        else:
            field = "stream_bytes" if what == "stream" else what
            ops.append(functools.partial(_set, change={field: draw(_INTS)}))
    return functools.partial(_apply, ops)


def _sample_manifest() -> ShardManifest:
    entries = (
        Entry("w", "tensor", "float32", (16,), 0, 64),
        Entry("a", "ndarray", "<f8", (2, 2), 64, 32),
        Entry("n", "msgpack", "", (), 128, 3),
    )
    return ShardManifest(
        version=1,
        rank=0,
        world_size=1,
        chunk_size=4096,
        stream_bytes=131,
        entries=entries,
        chunks=(ChunkRef(chunk_id(b"c"), 0, 131),),
        tree={"d": [["w", {"e": 0}], ["a", {"e": 1}], ["n", {"e": 2}]]},
    )


@settings(max_examples=400, deadline=None)
@given(mutate=mutations())
def test_decoding_mutated_manifests_bounds_every_size(mutate: Mutation) -> None:
    """A mutated manifest either decodes to one whose every size agrees with the others
    (what a reader allocates by it is bounded by its chunks) or raises ``BlobCorrupt``."""
    try:
        data = pack_manifest(mutate(_sample_manifest()))
    except (OverflowError, TypeError, ValueError):
        return  # msgpack cannot even write it: nothing for a reader to read
    try:
        m = unpack_manifest(data)
        check_stream(m)
    except BlobCorrupt:
        return
    assert m.stream_bytes == sum(c.length for c in m.chunks)
    for e in m.entries:
        size = element_size(e.kind, e.dtype)
        assert size is not None
        assert e.offset + e.nbytes <= m.stream_bytes
        assert size == 0 or math.prod(e.shape) * size == e.nbytes


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mutate=mutations())
def test_restore_of_mutated_manifests_raises_only_typed_errors(
    store: Store, mutate: Mutation
) -> None:
    """Restore with the newest version's manifest mutated: it restores that version, falls
    back to an older one, or raises a typed error."""
    try:
        bad = mutate(store.manifest)
        pack_manifest(bad)
    except (OverflowError, TypeError, ValueError, msgpack.PackException):
        return
    store.commit(bad)
    state = _blank()
    try:
        info = store.ckpt.restore(state)
    except TiercheckError:
        return
    assert info.version <= store.next_id
