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
from pathlib import Path
from types import ModuleType
from typing import Any

import blake3
import pytest
import zstandard

from tiercheck.formats import (
    Codec,
    chunk_id,
    decode_blob,
    encode_blob,
    frame_record,
    iter_frames,
    read_header,
)
from tiercheck.formats.manifest import pack_manifest, pack_record, unpack_manifest, unpack_record

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
