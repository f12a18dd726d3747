"""Blobs: the stored form of a chunk. A fixed header, then the payload of one codec.

SPEC.md sections 3 and 4 define the bytes; this module is the reference implementation.
Decoding always ends with the id check: bytes that do not hash to the expected chunk id
are reported as :class:`~tiercheck.errors.BlobCorrupt`, never returned.
"""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import blake3
import numpy as np
import numpy.typing as npt
import zstandard

from tiercheck.errors import BlobCorrupt, ConfigError, FormatVersionError, NotFound

from .ids import Buffer, as_byte_view, chunk_id

__all__ = [
    "BLOB_HEADER_SIZE",
    "BLOB_MAGIC",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "BlobHeader",
    "Codec",
    "decode_blob",
    "delta_if_smaller",
    "delta_or_raw",
    "encode_blob",
    "encode_blob_parts",
    "raw_header",
    "raw_payload",
    "read_header",
]

FORMAT_MAJOR = 1
FORMAT_MINOR = 0

BLOB_MAGIC = b"TCKB"
# magic, major, minor, codec, elem_size, header_size, reserved, header check,
# raw_length, payload_length, base id
_HEADER = struct.Struct("<4sBBBBHH4sQQ32s")
BLOB_HEADER_SIZE = _HEADER.size  # 64
_CHECK_AT = 12
_CHECK_LEN = 4
_NO_BASE = bytes(32)
_MAX_HEADER_SIZE = 4096

U8Array = npt.NDArray[np.uint8]


class Codec(enum.IntEnum):
    """How a blob's payload encodes the chunk. The value is the header's codec byte."""

    RAW = 0
    ZSTD = 1
    DELTA = 2

    @property
    def label(self) -> str:
        """The codec's name in configuration and reports: "raw", "zstd" or "delta"."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> Codec:
        """Return the codec called ``name`` ("raw", "zstd", "delta"; case-insensitive)."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            known = ", ".join(c.label for c in cls)
            raise ConfigError(f"unknown codec {name!r}; known codecs: {known}") from None


@dataclass(frozen=True)
class BlobHeader:
    """The decoded header of a blob. ``base_id`` is None unless the codec is delta."""

    major: int
    minor: int
    codec: Codec
    elem_size: int
    raw_length: int
    payload_length: int
    base_id: str | None
    header_size: int


# --- zstd objects, one per thread --------------------------------------------------
# ZstdCompressor/ZstdDecompressor are not thread-safe, and building one per call costs
# more than compressing a small chunk, so each encoding thread keeps its own.


class _ZstdCache(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor: zstandard.ZstdDecompressor | None = None
        # Scratch for the delta transform, reused: a fresh 4 MiB buffer per chunk costs
        # more in first-touch page faults than the XOR and shuffle themselves.
        self.scratch: dict[int, U8Array] = {}


_zstd = _ZstdCache()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    comp = _zstd.compressors.get(level)
    if comp is None:
        try:
            comp = zstandard.ZstdCompressor(
                level=level, write_checksum=False, write_content_size=True, threads=0
            )
        except zstandard.ZstdError as exc:
            raise ValueError(f"invalid zstd level {level}: {exc}") from None
        _zstd.compressors[level] = comp
    return comp


def _scratch(slot: int, n: int) -> U8Array:
    """This thread's scratch buffer number ``slot``, at least ``n`` bytes; first ``n`` returned."""
    buf = _zstd.scratch.get(slot)
    if buf is None or len(buf) < n:
        buf = np.empty(n, dtype=np.uint8)
        _zstd.scratch[slot] = buf
    return buf[:n]


def _decompressor() -> zstandard.ZstdDecompressor:
    if _zstd.decompressor is None:
        _zstd.decompressor = zstandard.ZstdDecompressor()
    return _zstd.decompressor


# --- byte transforms -----------------------------------------------------------------


def _u8(view: memoryview) -> U8Array:
    return np.frombuffer(view, dtype=np.uint8)


def _xor_into(dst: U8Array, src: U8Array, base: U8Array) -> None:
    """dst = src XOR base over their common prefix; dst = src beyond it (SPEC 4.3)."""
    k = min(len(src), len(base))
    np.bitwise_xor(src[:k], base[:k], out=dst[:k])
    if k < len(src) and dst is not src:
        dst[k:] = src[k:]


def _shuffle_into(dst: U8Array, src: U8Array, elem_size: int) -> None:
    """Byte-shuffle ``src`` into ``dst``: byte j of every element is contiguous (SPEC 4.3)."""
    m = len(src) // elem_size
    body = m * elem_size
    if elem_size == 1 or m == 0:
        dst[:] = src
        return
    dst[:body].reshape(elem_size, m)[...] = src[:body].reshape(m, elem_size).T
    dst[body:] = src[body:]


def _unshuffle_into(dst: U8Array, src: U8Array, elem_size: int) -> None:
    """Inverse of :func:`_shuffle_into`."""
    m = len(src) // elem_size
    body = m * elem_size
    if elem_size == 1 or m == 0:
        dst[:] = src
        return
    planes = src[:body].reshape(elem_size, m)
    if elem_size in (2, 4):
        # A strided scatter into narrow elements is slow in numpy (0.6 GB/s for 2-byte
        # elements); assembling little-endian words from the planes is 2-6x faster.
        word_t = np.dtype(f"<u{elem_size}")
        words = dst[:body].view(word_t)
        np.copyto(words, planes[0], casting="unsafe")
        tmp = np.empty(m, dtype=word_t)
        for j in range(1, elem_size):
            np.copyto(tmp, planes[j], casting="unsafe")
            np.left_shift(tmp, 8 * j, out=tmp)
            np.bitwise_or(words, tmp, out=words)
    else:
        dst[:body].reshape(m, elem_size)[...] = planes.T
    dst[body:] = src[body:]


def _delta_stream(raw: memoryview, base: memoryview, elem_size: int) -> U8Array:
    """The delta codec's pre-zstd byte stream: shuffle(raw XOR base), in thread scratch."""
    src = _u8(raw)
    xored = _scratch(0, len(src))
    _xor_into(xored, src, _u8(base))
    if elem_size == 1:
        return xored
    shuffled = _scratch(1, len(src))
    _shuffle_into(shuffled, xored, elem_size)
    return shuffled


# --- header --------------------------------------------------------------------------


def _header_check(header: Buffer) -> bytes:
    view = as_byte_view(header)
    h = blake3.blake3(view[:_CHECK_AT])
    h.update(bytes(_CHECK_LEN))
    h.update(view[_CHECK_AT + _CHECK_LEN :])
    return h.digest(length=_CHECK_LEN)


def _pack_header(
    codec: Codec,
    elem_size: int,
    raw_length: int,
    payload_length: int,
    base: bytes,
    header_size: int = BLOB_HEADER_SIZE,
) -> bytes:
    header = bytearray(header_size)  # the extension bytes past the first 64 stay zero
    _HEADER.pack_into(
        header,
        0,
        BLOB_MAGIC,
        FORMAT_MAJOR,
        FORMAT_MINOR,
        int(codec),
        elem_size,
        header_size,
        0,
        bytes(_CHECK_LEN),
        raw_length,
        payload_length,
        base,
    )
    header[_CHECK_AT : _CHECK_AT + _CHECK_LEN] = _header_check(header)
    return bytes(header)


def raw_header(length: int, header_size: int = BLOB_HEADER_SIZE) -> bytes:
    """The header of a raw blob of ``length`` bytes, ``header_size`` long (64 to 4096; the
    bytes past the first 64 are zero extension bytes, SPEC section 2). A header of a page
    puts the payload at a page offset of the blob's file: shm stages a chunk straight
    into such a file and makes it the blob (``StageArea``, backends/_shm_segments.py)."""
    if not BLOB_HEADER_SIZE <= header_size <= _MAX_HEADER_SIZE:
        raise ValueError(f"header_size must be {BLOB_HEADER_SIZE}..{_MAX_HEADER_SIZE}")
    return _pack_header(Codec.RAW, 1, length, length, _NO_BASE, header_size)


def read_header(blob: Buffer, *, expected_id: str = "") -> BlobHeader:
    """Parse and check the header at the start of ``blob``.

    ``blob`` may be the whole blob or just its first ``header_size`` bytes; the payload is
    not looked at. ``expected_id`` only names the chunk in error messages.

    Raises :class:`BlobCorrupt` for a short header, a bad magic, a failed header check or
    an invalid field, and :class:`FormatVersionError` for a newer major version, or for an
    unknown codec in a blob whose minor version is newer than this reader's.
    """
    view = as_byte_view(blob)

    def corrupt(why: str) -> BlobCorrupt:
        return BlobCorrupt(f"blob header: {why}", key=expected_id)

    if len(view) < 6:
        raise corrupt(f"truncated: {len(view)} bytes, a header is {BLOB_HEADER_SIZE}")
    if bytes(view[:4]) != BLOB_MAGIC:
        raise corrupt(f"bad magic {bytes(view[:4])!r}, expected {BLOB_MAGIC!r}")
    major, minor = view[4], view[5]
    if major > FORMAT_MAJOR:
        what = f"blob {expected_id}" if expected_id else "blob"
        raise FormatVersionError(
            f"{what} was written by format v{major}; this tiercheck reads "
            f"v{FORMAT_MAJOR}; upgrade tiercheck"
        )
    if major < 1:
        raise corrupt(f"format major {major} does not exist")
    if len(view) < BLOB_HEADER_SIZE:
        raise corrupt(f"truncated: {len(view)} bytes, a header is {BLOB_HEADER_SIZE}")
    (_, _, _, codec_b, elem_size, header_size, _, check, raw_len, payload_len, base) = (
        _HEADER.unpack_from(view, 0)
    )
    if not BLOB_HEADER_SIZE <= header_size <= _MAX_HEADER_SIZE:
        raise corrupt(f"header size {header_size} out of range")
    if len(view) < header_size:
        raise corrupt(f"truncated: {len(view)} bytes, the header is {header_size}")
    if _header_check(view[:header_size]) != check:
        raise corrupt("header check mismatch")
    try:
        codec = Codec(codec_b)
    except ValueError:
        if minor > FORMAT_MINOR:
            what = f"blob {expected_id}" if expected_id else "blob"
            raise FormatVersionError(
                f"{what} uses codec {codec_b}, added by format v{major}.{minor}; this "
                f"tiercheck reads v{FORMAT_MAJOR}.{FORMAT_MINOR}; upgrade tiercheck"
            ) from None
        raise corrupt(f"unknown codec {codec_b}") from None
    if elem_size < 1:
        raise corrupt("element size 0")
    has_base = base != _NO_BASE
    if codec is Codec.DELTA and not has_base:
        raise corrupt("delta blob without a base chunk id")
    return BlobHeader(
        major=major,
        minor=minor,
        codec=codec,
        elem_size=elem_size,
        raw_length=raw_len,
        payload_length=payload_len,
        base_id=base.hex() if codec is Codec.DELTA else None,
        header_size=header_size,
    )


# --- encode --------------------------------------------------------------------------


def _check_elem_size(elem_size: int) -> None:
    if not 1 <= elem_size <= 255:
        raise ValueError(f"elem_size must be in 1..255, got {elem_size}")


def _base_bytes(base_id: str) -> bytes:
    try:
        raw = bytes.fromhex(base_id)
    except ValueError:
        raw = b""
    if len(raw) != 32 or base_id != base_id.lower() or raw == _NO_BASE:
        raise ValueError(f"base_id must be a 64-character lowercase hex chunk id: {base_id!r}")
    return raw


def encode_blob_parts(
    raw: Buffer,
    codec: Codec,
    *,
    base: Buffer | None = None,
    base_id: str | None = None,
    elem_size: int = 1,
    level: int = 1,
) -> list[Buffer]:
    """Encode ``raw`` as a blob given as parts whose concatenation is the blob.

    The first part is the header. For the raw codec the second part is a view of ``raw``
    itself (no copy), so the caller must not modify ``raw`` until the parts are written;
    a tier can write header and payload with one vectored write. See :func:`encode_blob`
    for the arguments.
    """
    codec = Codec(codec)
    view = as_byte_view(raw)
    if codec is Codec.DELTA:
        if base is None or base_id is None:
            raise ValueError("the delta codec needs both base (raw bytes) and base_id")
        _check_elem_size(elem_size)
        base_raw = _base_bytes(base_id)
        stream = _delta_stream(view, as_byte_view(base), elem_size)
        payload = _compressor(level).compress(stream.data)
        header = _pack_header(codec, elem_size, len(view), len(payload), base_raw)
        return [header, payload]
    if base is not None or base_id is not None:
        raise ValueError(f"base and base_id are only used by the delta codec, not {codec.label}")
    _check_elem_size(elem_size)
    if codec is Codec.ZSTD:
        payload = _compressor(level).compress(view)
        return [_pack_header(codec, 1, len(view), len(payload), _NO_BASE), payload]
    return [_pack_header(codec, 1, len(view), len(view), _NO_BASE), view]


def encode_blob(
    raw: Buffer,
    codec: Codec,
    *,
    base: Buffer | None = None,
    base_id: str | None = None,
    elem_size: int = 1,
    level: int = 1,
) -> bytes:
    """Encode the chunk ``raw`` as a blob with ``codec`` and return its bytes.

    - raw: header + ``raw`` (one copy).
    - zstd: header + one zstd frame of ``raw`` at ``level``.
    - delta: header + one zstd frame (``level``) of ``shuffle(raw XOR base, elem_size)``.
      ``base`` is the raw bytes of the chunk named ``base_id``; the caller vouches that
      they match (a wrong base is only caught when the blob is decoded and verified).
      ``elem_size`` (1..255) is the element size of the data, e.g. 4 for float32.

    ``elem_size`` is recorded only for delta; raw and zstd blobs record 1.
    """
    return b"".join(
        encode_blob_parts(raw, codec, base=base, base_id=base_id, elem_size=elem_size, level=level)
    )


def delta_or_raw(
    raw: Buffer,
    base: Buffer,
    base_id: str,
    elem_size: int = 1,
    level: int = 1,
    min_ratio: float = 1.1,
) -> tuple[Codec, bytes]:
    """Return a delta blob of ``raw`` against ``base`` if it pays, else a raw blob.

    The delta blob is chosen when ``len(raw blob) / len(delta blob) >= min_ratio``.
    """
    delta = delta_if_smaller(raw, base, base_id, elem_size, level, min_ratio)
    if delta is not None:
        return Codec.DELTA, b"".join(delta)
    return Codec.RAW, encode_blob(raw, Codec.RAW)


def delta_if_smaller(
    raw: Buffer,
    base: Buffer,
    base_id: str,
    elem_size: int = 1,
    level: int = 1,
    min_ratio: float = 1.1,
) -> list[Buffer] | None:
    """The delta blob of ``raw`` against ``base`` as parts (see :func:`encode_blob_parts`)
    if ``len(raw blob) / len(delta blob) >= min_ratio``, else None (nothing else is
    encoded: the caller picks the other codec)."""
    parts = encode_blob_parts(
        raw, Codec.DELTA, base=base, base_id=base_id, elem_size=elem_size, level=level
    )
    if BLOB_HEADER_SIZE + len(as_byte_view(raw)) >= min_ratio * sum(len(p) for p in parts):
        return parts
    return None


# --- decode --------------------------------------------------------------------------


def _zstd_into(payload: memoryview, dst: memoryview, expected_id: str) -> None:
    """Decompress the single zstd frame ``payload`` into exactly ``dst``."""
    n = len(dst)
    try:
        params = zstandard.get_frame_parameters(payload)
        if params.content_size not in (n, zstandard.CONTENTSIZE_UNKNOWN):
            raise BlobCorrupt(
                f"zstd frame holds {params.content_size} bytes, the header says {n}",
                key=expected_id,
            )
        reader = _decompressor().stream_reader(payload, read_across_frames=False)
        with reader:
            pos = 0
            while pos < n:
                got = reader.readinto(dst[pos:])
                if not got:
                    break
                pos += got
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise BlobCorrupt(f"zstd payload does not decode: {exc}", key=expected_id) from None
    if pos != n or extra:
        raise BlobCorrupt(
            f"zstd payload decodes to {'more' if extra else pos} bytes, the header says {n}",
            key=expected_id,
        )


def raw_payload(
    header: Buffer, payload: memoryview, size: int, expected_id: str, *, verify: bool = True
) -> memoryview | None:
    """The chunk of a blob read in two parts, if it is a plain raw blob; else None.

    ``size`` is the blob's length; its first :data:`BLOB_HEADER_SIZE` bytes were read into
    ``header`` and the rest into ``payload`` (a tier's ``get_parts``). A raw blob returns
    its chunk, ``payload[:raw_length]`` (with a longer header, past the header's extension
    bytes at the start of ``payload``), checked as :func:`decode_blob` checks (header,
    lengths, and with ``verify`` the id): the payload was decoded where it landed. Any
    other codec, or a payload longer than ``payload``, returns None: the caller decodes the
    whole blob with :func:`decode_blob`. Raises what :func:`decode_blob` raises for a
    damaged or newer blob (the header check of a longer header is checked once the
    extension bytes are at hand, at the start of ``payload``).
    """
    hview = as_byte_view(header)
    head: Buffer = hview[: min(size, len(hview))]
    skip = 0  # the header's bytes at the start of ``payload`` (its extension)
    if len(head) >= 10:
        declared = int.from_bytes(head[8:10], "little")  # header_size (SPEC section 2)
        if len(head) < declared <= min(size, _MAX_HEADER_SIZE):
            skip = declared - len(head)
            if skip > len(payload):
                return None
            head = bytes(head) + bytes(payload[:skip])  # checked whole by read_header
    hdr = read_header(head, expected_id=expected_id)
    if hdr.codec is not Codec.RAW:
        return None
    n = size - hdr.header_size
    if skip + max(n, 0) > len(payload):
        return None
    if hdr.payload_length != n:
        what = "truncated" if n < hdr.payload_length else "has trailing bytes"
        raise BlobCorrupt(
            f"blob {what}: {size} bytes, header + payload is "
            f"{hdr.header_size + hdr.payload_length}",
            key=expected_id,
        )
    if hdr.raw_length != n:
        raise BlobCorrupt(
            f"raw blob payload is {n} bytes, the header says {hdr.raw_length}", key=expected_id
        )
    result = payload[skip : skip + n]
    if verify:
        _check_id(result, expected_id)
    return result


def _check_id(chunk: Buffer, expected_id: str) -> None:
    """Raise :class:`BlobCorrupt` unless ``chunk`` hashes to ``expected_id``."""
    got = chunk_id(chunk)
    if got != expected_id:
        raise BlobCorrupt(
            f"decoded chunk hashes to {got}, not its id (damaged blob or wrong base)",
            key=expected_id,
        )


def decode_blob(
    blob: Buffer,
    expected_id: str,
    *,
    base_lookup: Callable[[str], Buffer] | None = None,
    out: memoryview | None = None,
    verify: bool = True,
) -> memoryview:
    """Decode ``blob`` and return the chunk's raw bytes as a flat byte memoryview.

    With ``out`` (a writable buffer of at least ``raw_length`` bytes) the chunk is written
    into ``out[:raw_length]`` and that view is returned; a raw blob is then copied once.
    Without it a new buffer is returned, except that a raw blob returns a view into
    ``blob`` itself. A delta blob fetches its base chunk's raw bytes with
    ``base_lookup(base_id)``; without ``base_lookup`` it raises :class:`NotFound` naming
    the base id, and whatever ``base_lookup`` raises propagates.

    With ``verify`` (the default) the result must hash to ``expected_id``; anything that
    does not is :class:`BlobCorrupt`, as are a damaged header, a truncated or overlong
    blob and an undecodable payload. Format errors are described under
    :func:`read_header`.
    """
    view = as_byte_view(blob)
    hdr = read_header(view, expected_id=expected_id)
    payload_end = hdr.header_size + hdr.payload_length
    if len(view) != payload_end:
        what = "truncated" if len(view) < payload_end else "has trailing bytes"
        raise BlobCorrupt(
            f"blob {what}: {len(view)} bytes, header + payload is {payload_end}",
            key=expected_id,
        )
    payload = view[hdr.header_size :]
    n = hdr.raw_length

    dst: memoryview | None = None
    if out is not None:
        dst = as_byte_view(out)
        if dst.readonly:
            raise ValueError("out buffer is read-only")
        if len(dst) < n:
            raise ValueError(f"out buffer holds {len(dst)} bytes, the chunk is {n}")
        dst = dst[:n]

    if hdr.codec is Codec.RAW:
        if hdr.payload_length != n:
            raise BlobCorrupt(
                f"raw blob payload is {hdr.payload_length} bytes, the header says {n}",
                key=expected_id,
            )
        if dst is None:
            result = payload
        else:
            dst[:] = payload
            result = dst
    elif hdr.codec is Codec.ZSTD:
        result = dst if dst is not None else memoryview(bytearray(n))
        _zstd_into(payload, result, expected_id)
    else:
        assert hdr.base_id is not None  # read_header guarantees it for delta
        if base_lookup is None:
            raise NotFound(
                "delta blob needs its base chunk; pass base_lookup to decode it",
                key=hdr.base_id,
            )
        base = as_byte_view(base_lookup(hdr.base_id))
        result = dst if dst is not None else memoryview(bytearray(n))
        res = _u8(result)
        if hdr.elem_size == 1 or n < hdr.elem_size:
            _zstd_into(payload, result, expected_id)
        else:
            stream = _scratch(0, n)
            _zstd_into(payload, stream.data, expected_id)
            _unshuffle_into(res, stream, hdr.elem_size)
        _xor_into(res, res, _u8(base))

    if verify:
        _check_id(result, expected_id)
    return result
