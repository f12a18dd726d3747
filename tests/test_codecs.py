"""Property tests for chunk ids and the blob codecs (formats/SPEC.md sections 2-4)."""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiercheck.formats.ids as ids_module
from tiercheck.errors import BlobCorrupt, ConfigError, FormatVersionError, NotFound
from tiercheck.formats import (
    BLOB_HEADER_SIZE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    Codec,
    chunk_id,
    chunk_ids,
    decode_blob,
    delta_or_raw,
    encode_blob,
    encode_blob_parts,
    read_header,
)
from tiercheck.formats.codecs import _header_check

FAST = settings(max_examples=40, deadline=None)
SLOW = settings(max_examples=15, deadline=None)

ELEM_SIZES = [1, 2, 3, 4, 8, 16]
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
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
]

payloads = st.binary(min_size=0, max_size=3000)


def _encode(raw: bytes, codec: Codec, base: bytes, elem_size: int) -> bytes:
    blob: bytes
    if codec is Codec.DELTA:
        blob = encode_blob(raw, codec, base=base, base_id=chunk_id(base), elem_size=elem_size)
    else:
        blob = encode_blob(raw, codec)
    return blob


def _lookup(base: bytes) -> Callable[[str], bytes]:
    bid = chunk_id(base)

    def lookup(wanted: str) -> bytes:
        assert wanted == bid
        return base

    return lookup


def _rewrite_header(blob: bytes, **fields: int) -> bytes:
    """Change header fields at their SPEC offsets and recompute the header check."""
    offsets = {"major": (4, "B"), "minor": (5, "B"), "codec": (6, "B"), "elem": (7, "B")}
    offsets |= {"raw_length": (16, "<Q"), "payload_length": (24, "<Q")}
    buf = bytearray(blob)
    for name, value in fields.items():
        at, fmt = offsets[name]
        struct.pack_into(fmt, buf, at, value)
    buf[12:16] = _header_check(bytes(buf[:BLOB_HEADER_SIZE]))
    return bytes(buf)


# --- ids -----------------------------------------------------------------------------


@FAST
@given(st.lists(st.binary(max_size=5000), max_size=20), st.sampled_from([None, 1, 2, 3]))
def test_chunk_ids_match_blake3(chunks: list[bytes], threads: int | None) -> None:
    want = [blake3.blake3(c).hexdigest() for c in chunks]
    assert chunk_ids(chunks, threads=threads) == want
    assert [chunk_id(c) for c in chunks] == want


def test_chunk_ids_large_and_many_small() -> None:
    rng = np.random.default_rng(0)
    big = [rng.bytes(1 << 21) for _ in range(3)]
    small = [rng.bytes(64 << 10) for _ in range(160)]  # > the pool threshold in total
    mixed = [*big, *small, b""]
    want = [blake3.blake3(c).hexdigest() for c in mixed]
    assert chunk_ids(mixed) == want
    assert chunk_ids(mixed, threads=2) == want
    assert chunk_ids(mixed, threads=1) == want


def test_chunk_id_accepts_buffers() -> None:
    arr = np.arange(1000, dtype=np.float32)
    raw = arr.tobytes()
    want = blake3.blake3(raw).hexdigest()
    assert len(want) == 64 and want == want.lower()
    assert chunk_id(raw) == want
    assert chunk_id(bytearray(raw)) == want
    assert chunk_id(arr.data) == want  # format 'f'
    assert chunk_id(arr.reshape(10, 100).data) == want  # 2-D
    assert chunk_ids([arr.data], threads=2) == [want]
    with pytest.raises(ValueError):
        chunk_id(arr.data[::2])
    with pytest.raises(ValueError):
        chunk_ids([raw], threads=0)


# --- codec names -------------------------------------------------------------------


def test_codec_names() -> None:
    assert [c.label for c in Codec] == ["raw", "zstd", "delta"]
    assert [int(c) for c in Codec] == [0, 1, 2]
    for c in Codec:
        assert Codec.from_name(c.label) is c
    assert Codec.from_name("ZSTD") is Codec.ZSTD
    with pytest.raises(ConfigError, match="lz4"):
        Codec.from_name("lz4")


# --- round trips -------------------------------------------------------------------


@FAST
@given(
    raw=payloads,
    base=payloads,
    codec=st.sampled_from(list(Codec)),
    elem_size=st.sampled_from(ELEM_SIZES),
)
def test_round_trip(raw: bytes, base: bytes, codec: Codec, elem_size: int) -> None:
    blob = _encode(raw, codec, base, elem_size)
    hdr = read_header(blob)
    assert (hdr.major, hdr.minor, hdr.codec) == (FORMAT_MAJOR, FORMAT_MINOR, codec)
    assert hdr.raw_length == len(raw)
    assert hdr.header_size == BLOB_HEADER_SIZE == 64
    assert len(blob) == hdr.header_size + hdr.payload_length
    assert hdr.base_id == (chunk_id(base) if codec is Codec.DELTA else None)
    assert hdr.elem_size == (elem_size if codec is Codec.DELTA else 1)
    got = decode_blob(blob, chunk_id(raw), base_lookup=_lookup(base))
    assert got.format == "B" and bytes(got) == raw
    parts = encode_blob_parts(
        raw,
        codec,
        base=base if codec is Codec.DELTA else None,
        base_id=chunk_id(base) if codec is Codec.DELTA else None,
        elem_size=elem_size,
    )
    assert b"".join(parts) == blob


@FAST
@given(
    raw=payloads,
    base=payloads,
    codec=st.sampled_from(list(Codec)),
    elem_size=st.sampled_from(ELEM_SIZES),
    slack=st.integers(0, 9),
)
def test_decode_into_out(raw: bytes, base: bytes, codec: Codec, elem_size: int, slack: int) -> None:
    blob = _encode(raw, codec, base, elem_size)
    out = bytearray(b"\xaa" * (len(raw) + slack))
    got = decode_blob(
        blob,
        chunk_id(raw),
        base_lookup=_lookup(base),
        out=memoryview(out),
    )
    assert bytes(got) == raw
    assert bytes(out[: len(raw)]) == raw
    assert bytes(out[len(raw) :]) == b"\xaa" * slack  # nothing past raw_length is touched
    if codec is not Codec.RAW or not raw:
        return
    out[0] ^= 1  # the result is out's memory, not a copy
    assert got[0] == out[0]


def test_out_buffer_errors() -> None:
    raw = b"x" * 100
    blob = encode_blob(raw, Codec.RAW)
    with pytest.raises(ValueError, match="holds 99"):
        decode_blob(blob, chunk_id(raw), out=memoryview(bytearray(99)))
    with pytest.raises(ValueError, match="read-only"):
        decode_blob(blob, chunk_id(raw), out=memoryview(bytes(100)))


def test_decode_into_typed_out() -> None:
    arr = np.linspace(-1, 1, 257, dtype=np.float32)
    base = (arr * 0.999).astype(np.float32)
    blob = encode_blob(
        arr.tobytes(),
        Codec.DELTA,
        base=base.tobytes(),
        base_id=chunk_id(base.tobytes()),
        elem_size=4,
    )
    dst = np.zeros_like(arr)
    decode_blob(blob, chunk_id(arr.tobytes()), base_lookup=lambda _: base.tobytes(), out=dst.data)
    assert np.array_equal(dst, arr)


def _dtype_bytes(dtype: torch.dtype, n: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        if dtype.is_complex:
            t = t + 1j * torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (n,), generator=gen)
        t = t.to(dtype)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@SLOW
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 700),
    base_n=st.integers(0, 700),
    seed=st.integers(0, 2**16),
    codec=st.sampled_from(list(Codec)),
)
def test_torch_dtypes(dtype: torch.dtype, n: int, base_n: int, seed: int, codec: Codec) -> None:
    raw = _dtype_bytes(dtype, n, seed)
    base = _dtype_bytes(dtype, base_n, seed + 1)
    elem = dtype.itemsize
    assert len(raw) == n * elem
    blob = _encode(raw, codec, base, elem)
    out = bytearray(len(raw))
    got = decode_blob(blob, chunk_id(raw), base_lookup=_lookup(base), out=memoryview(out))
    assert bytes(got) == raw
    restored = torch.frombuffer(out, dtype=torch.uint8).view(dtype) if raw else None
    if restored is not None:
        original = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
        assert torch.equal(restored.view(torch.uint8), original.view(torch.uint8))


@FAST
@given(
    raw=st.binary(min_size=1, max_size=2000),
    relation=st.sampled_from(["shorter", "longer", "equal", "empty"]),
    elem_size=st.sampled_from(ELEM_SIZES),
    flips=st.lists(st.integers(0, 10**6), max_size=5),
)
def test_delta_base_lengths(raw: bytes, relation: str, elem_size: int, flips: list[int]) -> None:
    base = bytearray(raw)
    for f in flips:
        base[f % len(base)] ^= 0x5A
    if relation == "shorter":
        base = base[: len(base) // 2]
    elif relation == "longer":
        base += b"\x01\x02\x03" * 50
    elif relation == "empty":
        base = bytearray()
    blob = encode_blob(raw, Codec.DELTA, base=base, base_id=chunk_id(base), elem_size=elem_size)
    got = decode_blob(blob, chunk_id(raw), base_lookup=lambda _: bytes(base))
    assert bytes(got) == raw


def test_delta_is_xor_then_shuffle_then_zstd() -> None:
    """SPEC 4.3 worked example, checked against the encoder's zstd payload."""
    import zstandard

    raw = bytes(range(10, 20))  # 10 bytes, elem_size 4: two elements and a 2-byte tail
    base = bytes([1, 2, 3, 4, 5, 6])  # shorter: XOR over 6 bytes, the rest copied
    xored = bytes(r ^ b for r, b in zip(raw, base)) + raw[6:]
    assert xored == bytes.fromhex("0B090F090B0910111213")
    shuffled = bytes(xored[i] for i in (0, 4, 1, 5, 2, 6, 3, 7, 8, 9))
    assert shuffled == bytes.fromhex("0B0B09090F1009111213")
    blob = encode_blob(raw, Codec.DELTA, base=base, base_id=chunk_id(base), elem_size=4)
    hdr = read_header(blob)
    payload = blob[hdr.header_size :]
    assert zstandard.ZstdDecompressor().decompress(payload) == shuffled


def test_delta_of_similar_weights_is_smaller() -> None:
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(1 << 16).astype(np.float32)
    w1 = (w0 + rng.standard_normal(w0.size).astype(np.float32) * 1e-4).astype(np.float32)
    codec, blob = delta_or_raw(w1.tobytes(), w0.tobytes(), chunk_id(w0.tobytes()), 4, 1)
    assert codec is Codec.DELTA
    assert len(blob) < w1.nbytes / 1.1
    assert (
        bytes(decode_blob(blob, chunk_id(w1.tobytes()), base_lookup=lambda _: w0.tobytes()))
        == w1.tobytes()
    )
    noise = rng.bytes(w0.nbytes)
    codec, blob = delta_or_raw(noise, w0.tobytes(), chunk_id(w0.tobytes()), 4, 1)
    assert codec is Codec.RAW
    assert read_header(blob).codec is Codec.RAW
    assert bytes(decode_blob(blob, chunk_id(noise))) == noise


# --- damage and version errors --------------------------------------------------------


def _sample_blobs() -> list[tuple[bytes, bytes, bytes]]:
    rng = np.random.default_rng(2)
    raw = rng.standard_normal(600).astype(np.float32).tobytes()
    base = (np.frombuffer(raw, np.float32) * 1.001).astype(np.float32).tobytes()
    return [(_encode(raw, c, base, 4), raw, base) for c in Codec]


@FAST
@given(which=st.integers(0, 2), pos=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_flipped_bit_never_returns_wrong_data(which: int, pos: int, bit: int) -> None:
    """A flipped bit is reported as damage, or it changed nothing the decoder reads.

    Some bits of a zstd frame do not affect its output (the window size of a small frame,
    for one): such a blob still decodes to the bytes that hash to its id, which is not
    corruption. Whatever the flip, wrong bytes are never returned.
    """
    blob, raw, base = _sample_blobs()[which]
    damaged = bytearray(blob)
    damaged[pos % len(blob)] ^= 1 << bit
    try:
        out = decode_blob(bytes(damaged), chunk_id(raw), base_lookup=lambda _: base)
    except FormatVersionError:
        # only the major byte (offset 4) can read as "newer version"; all else is corruption
        assert pos % len(blob) == 4
    except BlobCorrupt:
        pass
    else:
        assert bytes(out) == raw
        assert Codec(which) is not Codec.RAW, "every bit of a raw blob's payload is data"


@FAST
@given(which=st.integers(0, 2), cut=st.integers(0, 10**6))
def test_truncated_blob_is_corrupt(which: int, cut: int) -> None:
    blob, raw, base = _sample_blobs()[which]
    short = blob[: cut % len(blob)]
    with pytest.raises(BlobCorrupt) as info:
        decode_blob(short, chunk_id(raw), base_lookup=lambda _: base)
    assert info.value.key == chunk_id(raw)


def test_trailing_bytes_are_corrupt() -> None:
    blob, raw, _ = _sample_blobs()[0]
    with pytest.raises(BlobCorrupt, match="trailing"):
        decode_blob(blob + b"\0", chunk_id(raw))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_wrong_expected_id(which: int) -> None:
    blob, raw, base = _sample_blobs()[which]
    wrong = chunk_id(raw + b"!")
    with pytest.raises(BlobCorrupt) as info:
        decode_blob(blob, wrong, base_lookup=lambda _: base)
    assert info.value.key == wrong and wrong in str(info.value)
    # verify=False skips only the id check
    assert bytes(decode_blob(blob, wrong, base_lookup=lambda _: base, verify=False)) == raw


def test_wrong_base_is_corrupt() -> None:
    blob, raw, base = _sample_blobs()[2]
    with pytest.raises(BlobCorrupt, match="wrong base"):
        decode_blob(blob, chunk_id(raw), base_lookup=lambda _: base[:-4] + b"\0\0\0\1")


def test_delta_without_lookup() -> None:
    blob, raw, base = _sample_blobs()[2]
    with pytest.raises(NotFound) as info:
        decode_blob(blob, chunk_id(raw))
    assert info.value.key == chunk_id(base)
    assert "base_lookup" in str(info.value)


def test_bad_magic() -> None:
    blob, raw, _ = _sample_blobs()[0]
    with pytest.raises(BlobCorrupt, match="magic"):
        decode_blob(b"XXXX" + blob[4:], chunk_id(raw))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_newer_major(which: int) -> None:
    blob, raw, base = _sample_blobs()[which]
    newer = _rewrite_header(blob, major=FORMAT_MAJOR + 1)
    with pytest.raises(FormatVersionError, match=r"format v2; this tiercheck reads v1; upgrade"):
        decode_blob(newer, chunk_id(raw), base_lookup=lambda _: base)
    with pytest.raises(FormatVersionError):
        read_header(newer[:6])  # the major is judged before anything else


def test_newer_minor_is_read() -> None:
    blob, raw, _ = _sample_blobs()[1]
    newer = _rewrite_header(blob, minor=FORMAT_MINOR + 1)
    assert read_header(newer).minor == FORMAT_MINOR + 1
    assert bytes(decode_blob(newer, chunk_id(raw))) == raw


def test_unknown_codec() -> None:
    blob, raw, _ = _sample_blobs()[0]
    same_minor = _rewrite_header(blob, codec=9)
    with pytest.raises(BlobCorrupt, match="unknown codec 9"):
        decode_blob(same_minor, chunk_id(raw))
    newer_minor = _rewrite_header(blob, codec=9, minor=FORMAT_MINOR + 1)
    with pytest.raises(FormatVersionError, match="codec 9"):
        decode_blob(newer_minor, chunk_id(raw))


def test_zstd_frame_variants() -> None:
    """SPEC 4.2: accept frames with or without content size and checksum; one frame only."""
    import zstandard

    raw = b"tiercheck " * 300

    def blob_with(payload: bytes) -> bytes:
        header = encode_blob(raw, Codec.ZSTD)[:BLOB_HEADER_SIZE]
        return _rewrite_header(header, payload_length=len(payload)) + payload

    frame = zstandard.ZstdCompressor().compress(raw)
    for ok in (
        frame,
        zstandard.ZstdCompressor(write_content_size=False).compress(raw),
        zstandard.ZstdCompressor(write_checksum=True).compress(raw),
    ):
        assert bytes(decode_blob(blob_with(ok), chunk_id(raw))) == raw
    for bad in (frame + frame, frame + b"\0", frame[:-1], b"", b"not zstd at all"):
        with pytest.raises(BlobCorrupt):
            decode_blob(blob_with(bad), chunk_id(raw))


def test_empty_chunk_id() -> None:
    assert chunk_id(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def test_header_fields_are_checked() -> None:
    blob, raw, _ = _sample_blobs()[0]
    with pytest.raises(BlobCorrupt, match="raw blob payload"):
        decode_blob(_rewrite_header(blob, raw_length=len(raw) - 1), chunk_id(raw))
    with pytest.raises(BlobCorrupt, match="element size"):
        decode_blob(_rewrite_header(blob, elem=0), chunk_id(raw))
    zblob, _, _ = _sample_blobs()[1]
    with pytest.raises(BlobCorrupt, match="zstd"):
        decode_blob(_rewrite_header(zblob, raw_length=len(raw) + 1), chunk_id(raw))
    dblob, _, _ = _sample_blobs()[2]
    no_base = bytearray(dblob)
    no_base[32:64] = bytes(32)
    with pytest.raises(BlobCorrupt, match="without a base"):
        read_header(_rewrite_header(bytes(no_base)))


def test_encode_argument_errors() -> None:
    with pytest.raises(ValueError, match="needs both"):
        encode_blob(b"abc", Codec.DELTA, base=b"abc")
    with pytest.raises(ValueError, match="only used by the delta"):
        encode_blob(b"abc", Codec.ZSTD, base=b"abc", base_id=chunk_id(b"abc"))
    with pytest.raises(ValueError, match="base_id"):
        encode_blob(b"abc", Codec.DELTA, base=b"abc", base_id="ABC")
    with pytest.raises(ValueError, match="elem_size"):
        encode_blob(b"abc", Codec.DELTA, base=b"a", base_id=chunk_id(b"a"), elem_size=0)


def test_chunk_ids_with_a_thread_count_build_no_pool_per_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``threads=N`` hands large chunks to N threads; it never asks blake3 for a pool of its
    own per chunk (``max_threads=N`` builds N threads per hasher and tears them down)."""
    rng = np.random.default_rng(1)
    big = [rng.bytes(1 << 20) for _ in range(6)]
    want = [blake3.blake3(c).hexdigest() for c in big]
    real = blake3.blake3
    asked: list[int] = []

    def recording(*args: object, max_threads: int = 1, **kwargs: object) -> object:
        asked.append(max_threads)
        return real(*args, max_threads=max_threads, **kwargs)

    monkeypatch.setattr(ids_module.blake3, "blake3", recording)
    with ThreadPoolExecutor(2, thread_name_prefix="lane") as pool:
        assert chunk_ids(big, threads=3, pool=pool) == want
    assert len(asked) == len(big) and set(asked) == {1}
    asked.clear()
    assert chunk_ids(big, threads=2) == want  # no pool: one made for the call
    assert set(asked) == {1}


def test_chunk_ids_do_not_wait_for_a_busy_pool() -> None:
    """The caller's thread hashes every chunk itself when the pool's threads are all busy
    (or the caller is one of them): it never waits for a lane that has not started."""
    rng = np.random.default_rng(2)
    big = [rng.bytes(1 << 20) for _ in range(4)]
    want = [blake3.blake3(c).hexdigest() for c in big]
    release = threading.Event()
    got: list[list[str]] = []
    with ThreadPoolExecutor(1) as pool:
        pool.submit(release.wait)  # the pool's one thread, busy until released
        caller = threading.Thread(target=lambda: got.append(chunk_ids(big, 2, pool=pool)))
        caller.start()
        caller.join(timeout=30)
        finished = not caller.is_alive()
        release.set()
        caller.join()
    assert finished, "chunk_ids waited for a pool thread that never came"
    assert got == [want]
