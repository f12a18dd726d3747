"""Format v1: chunk ids, blob codecs, manifest and log-record schemas. See SPEC.md."""

from .codecs import (
    BLOB_HEADER_SIZE,
    BLOB_MAGIC,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    BlobHeader,
    Codec,
    decode_blob,
    delta_or_raw,
    encode_blob,
    encode_blob_parts,
    read_header,
)
from .framing import FRAME_HEADER, frame_record, iter_frames, unframe_record
from .ids import chunk_id, chunk_ids

__all__ = [
    "BLOB_HEADER_SIZE",
    "BLOB_MAGIC",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "FRAME_HEADER",
    "BlobHeader",
    "Codec",
    "chunk_id",
    "chunk_ids",
    "decode_blob",
    "delta_or_raw",
    "encode_blob",
    "encode_blob_parts",
    "frame_record",
    "iter_frames",
    "read_header",
    "unframe_record",
]
