"""Bad-input sweep: generated state dicts round-trip exactly or fail typed before anything is
written; fuzzed blob, manifest, log-record and framed-log bytes raise only typed errors.

Example counts are modest for CI; ``TIERCHECK_SOAK=1`` multiplies them by 25.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from crash_harness import bit_mismatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercheck import Checkpointer, Policy
from tiercheck.errors import TiercheckError
from tiercheck.formats.codecs import Codec, decode_blob, encode_blob
from tiercheck.formats.framing import frame_record, iter_frames, unframe_record
from tiercheck.formats.ids import chunk_id
from tiercheck.formats.manifest import (
    AbortRecord,
    ChunkRef,
    CommitRecord,
    DropRecord,
    Entry,
    PrepareRecord,
    ShardManifest,
    VersionInfo,
    pack_manifest,
    pack_record,
    unpack_manifest,
    unpack_record,
)

SCALE = 25 if os.environ.get("TIERCHECK_SOAK") == "1" else 1
STATES = settings(
    max_examples=50 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BYTES = settings(max_examples=300 * SCALE, deadline=None)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
]
DTYPES += [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]


# --- state dicts --------------------------------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    n = 1
    for d in shape:
        n *= d
    size = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    t = flat.to(torch.uint8).view(dtype).reshape(shape)
    if dtype == torch.bool:
        t = t.view(torch.uint8).remainder(2).to(torch.bool)  # only 0/1 are valid bools
    view = draw(st.sampled_from(["plain", "step", "t", "expand", "slice", "unsqueeze"]))
    if view == "step" and t.dim() >= 1:
        return t[::2]
    if view == "t" and t.dim() == 2:
        return t.t()
    if view == "expand":
        return t.unsqueeze(0).expand(3, *t.shape)  # overlapping: every row is one memory
    if view == "slice" and t.dim() >= 1 and t.shape[0] > 1:
        return t[1:]
    if view == "unsqueeze":
        return t.unsqueeze(-1)
    return t


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**200), 2**200),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=40),
)
keys = st.text(min_size=1, max_size=8)  # "/" and odd keys included: those must fail typed
leaves = st.one_of(scalars, tensors())
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=12,
)
states = st.dictionaries(keys, values, min_size=1, max_size=5)


def target_like(value: Any) -> Any:
    """A destination of the same structure: zeroed contiguous tensors, other leaves None."""
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, dict):
        return {k: target_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [target_like(v) for v in value]
    if isinstance(value, tuple):
        return tuple(target_like(v) for v in value)
    return value


_STORE: list[Checkpointer] = []


def store(tmp_path_factory: pytest.TempPathFactory) -> Checkpointer:
    if not _STORE:
        root = tmp_path_factory.mktemp("fuzz")
        _STORE.append(
            Checkpointer(
                root,
                tiers=[("m", f"memory://{uuid.uuid4().hex}")],
                policy=Policy(base_every=3, chunk_size=4096, gc_grace_seconds=0),
            )
        )
    return _STORE[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkpointer]:
    c = store(tmp_path_factory)
    yield c
    c.close()
    _STORE.clear()


@STATES
@given(state=states)
def test_state_round_trips_exactly_or_fails_typed_before_writing(
    ckpt: Checkpointer, state: dict[str, Any]
) -> None:
    tier = ckpt.tierset.get("m").tier
    assert tier is not None
    before = (len(tier.read_log()), sorted(tier.list()))
    step = len(before[1]) + before[0]
    try:
        handle = ckpt.save(step, state)
    except TiercheckError:
        ckpt.flush()
        assert (len(tier.read_log()), sorted(tier.list())) == before
        return
    handle.wait()
    info = ckpt.restore(None)
    assert info.step == step
    bad = bit_mismatch(info.state, state)
    assert bad is None, bad
    target = target_like(state)
    out = ckpt.restore(target).state
    bad = bit_mismatch(out, state)
    assert bad is None, bad


# --- bytes ----------------------------------------------------------------------------------------


def _samples() -> dict[str, bytes]:
    raw = bytes(range(256)) * 20
    base = bytes(reversed(raw))
    info = VersionInfo(1, 5, "diff", 0, 1, (chunk_id(b"m"),), 1.5, 100, {"k": [1, "x"]})
    manifest = ShardManifest(
        version=1,
        rank=0,
        world_size=1,
        chunk_size=4096,
        stream_bytes=8,
        entries=(Entry("w", "tensor", "float32", (2,), 0, 8),),
        chunks=(ChunkRef(chunk_id(b"c"), 0, 8),),
        tree={"d": [["w", {"e": 0}]]},
    )
    records = [
        PrepareRecord(
            1,
            0,
            5,
            "diff",
            0,
            chunk_id(b"m"),
            1,
            10,
            1.0,
            {chunk_id(b"a"): raw[:0].hex() or chunk_id(b"b")},
        ),
        CommitRecord(info),
        AbortRecord(2, "no"),
        DropRecord(1, 2.0),
    ]
    return {
        "raw": encode_blob(raw, Codec.RAW),
        "zstd": encode_blob(raw, Codec.ZSTD),
        "delta": encode_blob(raw, Codec.DELTA, base=base, base_id=chunk_id(base), elem_size=4),
        "manifest": pack_manifest(manifest),
        "log": b"".join(frame_record(pack_record(r)) for r in records),
        # a log version's shard (schema 1.1): the replay log's nested fields
        "log_manifest": (
            Path(__file__).parent / "golden" / "log_version_manifest.msgpack"
        ).read_bytes(),
        **{f"rec{i}": pack_record(r) for i, r in enumerate(records)},
    }


SAMPLES = _samples()
RAW_ID = chunk_id(bytes(range(256)) * 20)


@st.composite
def mutated(draw: st.DrawFn, names: list[str]) -> bytes:
    """A sample with a few random flips, cuts, insertions; or plain random bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=300))
    data = bytearray(SAMPLES[draw(st.sampled_from(names))])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "set"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            data = data[:pos] + data[pos + draw(st.integers(1, 64)) :]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif data:
            data[pos] = draw(st.integers(0, 255))
    return bytes(data)


def typed_only(fn: Callable[[], object]) -> None:
    try:
        fn()
    except TiercheckError:
        pass


@BYTES
@given(data=mutated(["raw", "zstd", "delta"]), base=st.binary(max_size=6000))
def test_fuzzed_blobs_raise_only_typed_errors(data: bytes, base: bytes) -> None:
    lookup = lambda _id: base  # noqa: E731 - a base of any length, right or wrong
    typed_only(lambda: decode_blob(data, RAW_ID, base_lookup=lookup))
    typed_only(
        lambda: decode_blob(data, RAW_ID, base_lookup=lookup, out=memoryview(bytearray(6000)))
    )


@BYTES
@given(data=mutated(["manifest", "log_manifest"]))
def test_fuzzed_manifests_raise_only_typed_errors(data: bytes) -> None:
    typed_only(lambda: unpack_manifest(data))


@BYTES
@given(data=mutated(["rec0", "rec1", "rec2", "rec3"]))
def test_fuzzed_log_records_raise_only_typed_errors(data: bytes) -> None:
    typed_only(lambda: unpack_record(data))


msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=5),
        st.binary(max_size=40),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
FIELDS = [
    "type",
    "version",
    "rank",
    "step",
    "role",
    "base",
    "manifest",
    "chunks_written",
    "bytes_written",
    "time",
    "deltas",
    "info",
    "reason",
    "entries",
    "chunks",
    "tree",
    "world_size",
    "chunk_size",
    "stream_bytes",
    "extra",
    "log",
]


@BYTES
@given(
    obj=st.dictionaries(st.sampled_from(FIELDS), msgpack_values, max_size=8),
    kind=st.sampled_from(["prepare", "commit", "abort", "drop", "manifest", None]),
)
def test_well_formed_msgpack_with_wrong_fields_raises_only_typed_errors(
    obj: dict[str, Any], kind: str | None
) -> None:
    obj["v"] = [1, 0]
    if kind is not None:
        obj["type"] = kind
    data = msgpack.packb(obj, use_bin_type=True)
    typed_only(lambda: unpack_record(data))
    typed_only(lambda: unpack_manifest(data))


@BYTES
@given(data=mutated(["log"]))
def test_fuzzed_framed_logs_never_raise(data: bytes) -> None:
    for payload in iter_frames(data):
        typed_only(lambda p=payload: unpack_record(p))  # type: ignore[misc]
    unframe_record(data)
