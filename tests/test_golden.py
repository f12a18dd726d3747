"""Golden vectors: committed bytes that format v1 must keep reading and writing exactly.

The vectors in tests/golden/ were made by tests/golden/make_golden.py. These tests decode
them byte for byte, re-encode the fixed inputs and compare, and read the blobs a second
time with a minimal reader written from SPEC.md alone, so neither the code nor the spec
can drift without a test failing.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import blake3
import msgpack
import pytest
import xxhash
import zstandard

from tiercheck.errors import BlobCorrupt
from tiercheck.formats import (
    Codec,
    chunk_id,
    decode_blob,
    encode_blob,
    frame_record,
    iter_frames,
    read_header,
)
from tiercheck.formats.manifest import (
    SCHEMA_MINOR,
    pack_manifest,
    pack_record,
    unpack_manifest,
    unpack_record,
)
from tiercheck.logversions.fingerprint import fingerprints, wsum64_reference
from tiercheck.logversions.update_log import (
    CapturedStep,
    GradSlot,
    Implementation,
    LoggedSteps,
    plan_log,
)

GOLDEN = Path(__file__).resolve().parent / "golden"
INDEX: dict[str, Any] = json.loads((GOLDEN / "index.json").read_text())
SAME_ZSTD = INDEX["zstd_version"] == ".".join(map(str, zstandard.ZSTD_VERSION))


def _load_maker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKER = _load_maker()


def _load_reader_1_0() -> ModuleType:
    """formats/manifest.py as released with schema 1.0 (a frozen copy)."""
    path = GOLDEN / "v1_0" / "manifest_1_0.py"
    spec = importlib.util.spec_from_file_location("tiercheck_manifest_1_0", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _read(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def _inputs() -> dict[str, bytes]:
    return {k: _read(v["file"]) for k, v in INDEX["inputs"].items()}


def test_files_intact() -> None:
    for name, digest in INDEX["blake3"].items():
        assert blake3.blake3(_read(name)).hexdigest() == digest, name
    for spec in INDEX["inputs"].values():
        assert chunk_id(_read(spec["file"])) == spec["id"]


@pytest.mark.parametrize("spec", INDEX["blobs"], ids=lambda s: s["file"])
def test_decode_golden_blob(spec: dict[str, Any]) -> None:
    blob = _read(spec["file"])
    inputs = _inputs()
    want = inputs[spec["input"]] if spec["input"] else b""
    hdr = read_header(blob)
    assert hdr.codec is Codec.from_name(spec["codec"])
    assert (hdr.major, hdr.minor, hdr.header_size) == (1, 0, 64)
    assert hdr.raw_length == len(want)
    assert hdr.elem_size == spec.get("elem_size", 1)
    assert hdr.base_id == spec.get("base")
    by_id = {chunk_id(v): v for v in inputs.values()}
    got = decode_blob(blob, spec["id"], base_lookup=by_id.__getitem__)
    assert bytes(got) == want


@pytest.mark.parametrize("spec", INDEX["blobs"], ids=lambda s: s["file"])
def test_reencode_golden_blob(spec: dict[str, Any]) -> None:
    inputs = _inputs()
    raw = inputs[spec["input"]] if spec["input"] else b""
    codec = Codec.from_name(spec["codec"])
    if codec is Codec.DELTA:
        again = encode_blob(
            raw,
            codec,
            base=inputs["base"],
            base_id=spec["base"],
            elem_size=spec["elem_size"],
            level=spec["level"],
        )
    elif codec is Codec.ZSTD:
        again = encode_blob(raw, codec, level=spec["level"])
    else:
        again = encode_blob(raw, codec)
    golden = _read(spec["file"])
    if codec is Codec.RAW or SAME_ZSTD:
        assert again == golden
        return
    # Another libzstd may compress differently (SPEC.md section 11): everything but the
    # compressed bytes, and what they decompress to, must still match exactly.
    fixed = slice(0, 12), slice(16, 24), slice(32, 64)
    for part in fixed:
        assert again[part] == golden[part]
    dec = zstandard.ZstdDecompressor()
    assert dec.decompress(again[64:]) == dec.decompress(golden[64:])


def _spec_reader(blob: bytes, lookup: dict[str, bytes]) -> bytes:
    """A second blob reader, written from SPEC.md sections 3-5 with no tiercheck code."""
    magic, major, minor, codec, elem, hsize, _, check, n, plen, base_id = struct.unpack_from(
        "<4sBBBBHH4sQQ32s", blob, 0
    )
    assert (magic, major, minor, hsize) == (b"TCKB", 1, 0, 64)
    zeroed = blob[:12] + b"\0\0\0\0" + blob[16:hsize]
    assert blake3.blake3(zeroed).digest(length=4) == check
    assert len(blob) == hsize + plen
    payload = blob[hsize:]
    if codec == 0:
        raw = payload
    elif codec == 1:
        raw = zstandard.ZstdDecompressor().decompress(payload)
    else:
        assert codec == 2
        s = zstandard.ZstdDecompressor().decompress(payload)
        base = lookup[base_id.hex()]
        m = n // elem
        x = bytearray(n)
        for i in range(m):
            for j in range(elem):
                x[i * elem + j] = s[j * m + i]
        x[m * elem :] = s[m * elem :]
        for i in range(min(n, len(base))):
            x[i] ^= base[i]
        raw = bytes(x)
    assert len(raw) == n
    return raw


@pytest.mark.parametrize("spec", INDEX["blobs"], ids=lambda s: s["file"])
def test_spec_reader_agrees(spec: dict[str, Any]) -> None:
    inputs = _inputs()
    lookup = {chunk_id(v): v for v in inputs.values()}
    raw = _spec_reader(_read(spec["file"]), lookup)
    assert blake3.blake3(raw).hexdigest() == spec["id"]


def test_raw_header_bytes() -> None:
    """The raw blob's header, byte by byte, as SPEC.md section 3 lays it out."""
    blob = _read("blob_raw.bin")
    n = len(_read("input_new.bin"))
    assert blob[:12] == b"TCKB" + bytes([1, 0, 0, 1]) + (64).to_bytes(2, "little") + b"\0\0"
    assert blob[16:24] == n.to_bytes(8, "little")
    assert blob[24:32] == n.to_bytes(8, "little")
    assert blob[32:64] == bytes(32)
    assert blob[64:] == _read("input_new.bin")


def test_golden_manifest() -> None:
    base, new = _inputs()["base"], _inputs()["new"]
    data = _read("manifest.msgpack")
    assert chunk_id(data) == INDEX["manifest"]["id"]
    fixed = MAKER.fixed_manifest(base, new)
    assert unpack_manifest(data) == fixed
    assert pack_manifest(fixed) == data


def test_golden_manifest_checks_are_xxh3_128_of_each_chunk() -> None:
    """Schema 1.2: ``checks`` is 16 bytes per chunk, XXH3-128 (seed 0, big-endian) of the
    window's bytes, read here with msgpack and xxhash alone (SPEC.md section 7.2)."""
    base, new = _inputs()["base"], _inputs()["new"]
    obj = msgpack.unpackb(_read("manifest.msgpack"), raw=False)
    assert obj["v"] == [1, 2]
    windows = [base[:4096], new]  # the bytes fixed_manifest names its two chunks by
    assert [bytes(cid) for cid, _, _ in obj["chunks"]] == [
        blake3.blake3(w).digest() for w in windows
    ]
    assert obj["checks"] == b"".join(xxhash.xxh3_128_digest(w) for w in windows)
    assert [c.check for c in unpack_manifest(_read("manifest.msgpack")).chunks] == [
        xxhash.xxh3_128(w).digest() for w in windows
    ]


@pytest.mark.parametrize("cut", [1, 16, 17])
def test_checks_not_16_bytes_a_chunk_are_corruption(cut: int) -> None:
    obj = msgpack.unpackb(_read("manifest.msgpack"), raw=False)
    obj["checks"] = obj["checks"][:-cut]
    with pytest.raises(BlobCorrupt, match="checks must be 16 bytes"):
        unpack_manifest(msgpack.packb(obj, use_bin_type=True))


def test_golden_log() -> None:
    base, new = _inputs()["base"], _inputs()["new"]
    records = MAKER.fixed_records(INDEX["manifest"]["id"], base, new)
    log = _read("log.bin")
    payloads = list(iter_frames(log))
    assert len(payloads) == INDEX["log"]["records"] == len(records)
    assert [chunk_id(p) for p in payloads] == INDEX["log"]["record_ids"]
    assert [unpack_record(p) for p in payloads] == records
    assert [pack_record(r) for r in records] == payloads
    assert b"".join(frame_record(p) for p in payloads) == log


def test_golden_torn_log() -> None:
    torn = _read("log_torn.bin")
    payloads = list(iter_frames(torn))
    assert len(payloads) == INDEX["log_torn"]["records"]
    assert b"".join(frame_record(p) for p in payloads) == _read("log.bin")


# --- schema 1.0 vectors: a 1.1 reader keeps reading them ---------------------------------


def test_v1_0_vectors_intact_and_read() -> None:
    for spec in INDEX["v1_0"].values():
        assert chunk_id(_read(spec["file"])) == spec["blake3"], spec["file"]
    base, new = _inputs()["base"], _inputs()["new"]
    old_manifest = _read("v1_0/manifest.msgpack")
    fixed = MAKER.fixed_manifest(base, new)
    assert unpack_manifest(old_manifest) == fixed
    assert all(c.check is None for c in unpack_manifest(old_manifest).chunks)
    # "v" is the last key and [1, minor] packs as 92 01 <minor>: re-encoding changes only it
    assert pack_manifest(unpack_manifest(old_manifest)) == old_manifest[:-1] + bytes([SCHEMA_MINOR])
    payloads = list(iter_frames(_read("v1_0/log.bin")))
    records = MAKER.fixed_records(chunk_id(old_manifest), base, new)
    assert [unpack_record(p) for p in payloads] == records
    assert [pack_record(r) for r in records] == [p[:-1] + bytes([SCHEMA_MINOR]) for p in payloads]


def test_v1_1_vectors_intact_and_read() -> None:
    """Schema 1.1 (before chunk checks): every manifest and record reads as it did, its
    chunks without checks (restore verifies them by BLAKE3), and re-encodes with only its
    minor version changed."""
    base, new = _inputs()["base"], _inputs()["new"]
    for name, spec in INDEX["v1_1"].items():
        data = _read(spec["file"])
        assert chunk_id(data) == spec["blake3"], name
        if name.endswith(".msgpack"):
            m = unpack_manifest(data)
            assert all(c.check is None for c in m.chunks)
            assert pack_manifest(m) == data[:-1] + bytes([SCHEMA_MINOR])
        else:
            payloads = list(iter_frames(data))
            assert [pack_record(unpack_record(p)) for p in payloads] == [
                p[:-1] + bytes([SCHEMA_MINOR]) for p in payloads
            ]
    assert unpack_manifest(_read("v1_1/manifest.msgpack")) == MAKER.fixed_manifest(base, new)


# --- schema 1.1: log versions (SPEC.md section 12) -------------------------------------


def test_golden_log_version_manifest() -> None:
    base, new = _inputs()["base"], _inputs()["new"]
    data = _read("log_version_manifest.msgpack")
    assert chunk_id(data) == INDEX["log_version"]["manifest"]["id"]
    fixed = MAKER.fixed_log_manifest(base, new)
    assert unpack_manifest(data) == fixed
    assert pack_manifest(fixed) == data
    stream = _read(INDEX["log_version"]["stream"])
    assert stream == MAKER.fixed_log_stream(new)
    assert fixed.stream_bytes == len(stream)
    for c in fixed.chunks:
        assert chunk_id(stream[c.offset : c.offset + c.length]) == c.id
    assert fixed.log is not None
    for step in fixed.log.steps:
        for i, e in enumerate(step.grads):
            if e is not None:
                assert fixed.entries[e].key == f"/log/{step.index}/{i}"


def test_golden_log_version_records() -> None:
    records = MAKER.fixed_log_records(INDEX["log_version"]["manifest"]["id"])
    payloads = list(iter_frames(_read(INDEX["log_version"]["records"]["file"])))
    assert [chunk_id(p) for p in payloads] == INDEX["log_version"]["records"]["record_ids"]
    assert [unpack_record(p) for p in payloads] == records
    assert [pack_record(r) for r in records] == payloads


def test_plan_log_writes_the_golden_layout() -> None:
    """The reference writer lays the golden steps out byte for byte as the vector does."""
    base, new = _inputs()["base"], _inputs()["new"]
    fixed = MAKER.fixed_log_manifest(base, new)
    log = fixed.log
    assert log is not None
    w, b = GradSlot(0, 128, "float32", (4, 8)), GradSlot(128, 6, "bfloat16", (3,))
    data = {0: new[0:134], 1: b"", 2: new[256:384]}
    slots = {0: (w, b), 1: (), 2: (w, None)}
    steps = tuple(
        CapturedStep(
            index=s.index,
            skipped=s.skipped,
            grads=slots[s.index],
            data=memoryview(data[s.index]),
            options=s.options,
            attrs=s.attrs,
            counter=s.counter,
            scaler=s.scaler,
            seconds=0.0,
        )
        for s in log.steps
    )
    impl = Implementation(log.optimizer, log.torch, log.device, log.flags, log.params)
    logged = LoggedSteps(
        steps, impl, log.mirrors, log.options, log.scaler, fingerprints=log.fingerprints
    )
    layout = plan_log(logged, fixed.chunk_size)
    assert layout.replay == log
    assert layout.entries == fixed.entries[:3]
    assert layout.end == 320 == fixed.entries[3].offset
    assert [(c.offset, c.length) for c in fixed.chunks[:3]] == list(layout.windows)
    stream = _read(INDEX["log_version"]["stream"])
    for offset, segment in layout.segments:
        assert stream[offset : offset + len(segment)] == bytes(segment)


def _wsum64_spec(data: bytes) -> bytes:
    """SPEC.md section 12.4's wsum64, written from the text with struct alone."""
    padded = data + bytes(-len(data) % 4)
    words = struct.unpack(f"<{len(padded) // 4}I", padded)
    s0 = sum(words) % 2**64
    s1 = sum((2 * i + 1) * w for i, w in enumerate(words)) % 2**64
    return struct.pack("<QQ", s0, s1)


@pytest.mark.parametrize("name", ["base", "new"])
def test_golden_fingerprints(name: str) -> None:
    import torch

    data = _inputs()[name]
    want = {algo: bytes.fromhex(h) for algo, h in INDEX["fingerprints"][name].items()}
    assert blake3.blake3(data).digest(length=16) == want["blake3"]
    assert _wsum64_spec(data) == wsum64_reference(data) == want["wsum64"]
    # the same bytes as tensors of several dtypes: fingerprints depend on the bytes only
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    views = {"uint8": raw, "odd": raw[: len(data) - len(data) % 2].view(torch.bfloat16)}
    if len(data) % 4 == 0:
        views["float32"] = raw.view(torch.float32).reshape(-1, 4)
    for label, t in views.items():
        got = fingerprints({"t": t}, {"t": "wsum64"})["t"].digest
        assert got == wsum64_reference(bytes(t.contiguous().view(torch.uint8).numpy())), label
    assert fingerprints({"t": raw}, {"t": "wsum64"})["t"].digest == want["wsum64"]
    assert fingerprints({"t": raw})["t"].digest == want["blake3"]


def test_a_1_0_reader_skips_log_versions_and_keeps_the_rest() -> None:
    """SPEC.md section 12.6, with the released 1.0 reader: the log version's records are
    damaged records to it (skipped, never misread); the 1.1 records of other versions,
    and the log shard's manifest, decode normally."""
    old = _load_reader_1_0()
    frames = list(iter_frames(_read("log.bin"))) + list(
        iter_frames(_read(INDEX["log_version"]["records"]["file"]))
    )
    committed, corrupt = {}, 0
    for payload in frames:  # tiercheck 1.0's read_tier_log
        try:
            rec = old.unpack_record(payload)
        except BlobCorrupt:
            corrupt += 1
            continue
        if isinstance(rec, old.CommitRecord):
            committed[rec.info.id] = rec.info
    assert corrupt == 2
    assert sorted(committed) == [7] and committed[7].role == "diff"
    manifest = old.unpack_manifest(_read("log_version_manifest.msgpack"))
    assert not hasattr(manifest, "log") and len(manifest.entries) == 5


# --- schema 1.1: sharded tensors (SPEC.md section 14) ----------------------------------


def test_golden_sharded_manifest() -> None:
    base = _inputs()["base"]
    data = _read(INDEX["sharded"]["manifest"]["file"])
    assert chunk_id(data) == INDEX["sharded"]["manifest"]["id"]
    fixed = MAKER.fixed_sharded_manifest(base)
    assert unpack_manifest(data) == fixed
    assert pack_manifest(fixed) == data
    stream = _read(INDEX["sharded"]["stream"])
    assert stream == MAKER.fixed_sharded_stream(base) and len(stream) == fixed.stream_bytes
    assert [chunk_id(stream)] == [c.id for c in fixed.chunks]


@pytest.mark.parametrize(
    "bad",
    [
        [2, [1], [1], [2], ["R"], [0]],  # a msgpack entry
        [0, [32, 32], [32, 1], [2], ["S(0)"], [17, 0]],  # the box leaves the tensor
        [0, [32, 32], [32, 1], [2], ["S(0)", "R"], [16, 0]],  # a placement per mesh dim
        [5, [4], [1], [2], ["R"], [0]],  # no such entry
    ],
)
def test_a_sharded_placement_that_does_not_fit_is_corruption(bad: list[Any]) -> None:
    obj = msgpack.unpackb(_read(INDEX["sharded"]["manifest"]["file"]), raw=False)
    obj["sharded"] = [bad]
    with pytest.raises(BlobCorrupt, match=r"sharded|placement"):
        unpack_manifest(msgpack.packb(obj, use_bin_type=True))


def test_a_reader_without_section_13_cannot_mistake_a_piece_for_the_tensor() -> None:
    """SPEC.md section 14.3 with the released 1.0 reader: the manifest decodes (the key is
    ignored), each entry has its piece's shape, and the tree names the pieces with a node
    the old reader's restore refuses."""
    old = _load_reader_1_0()
    manifest = old.unpack_manifest(_read(INDEX["sharded"]["manifest"]["file"]))
    assert manifest.entries[0].shape == (16, 32)
    model = dict(manifest.tree["d"])["model"]["o"]["d"]
    assert [node for _, node in model] == [{"s": 0}, {"s": 1}]
