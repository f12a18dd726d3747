"""Generate the format v1 golden vectors in this directory. Run once, by hand, and commit.

    python tests/golden/make_golden.py

The fixed inputs are built by the ``fixed_*`` functions below (tests/test_golden.py
imports them to re-encode and compare); the raw chunk inputs are also written out as
files, so the vectors do not depend on any random number generator staying stable.
Regenerating is a format change: it must come with a SPEC.md change and a version bump,
unless only the libzstd version changed (see SPEC.md section 11).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import zstandard

from tiercheck.formats import Codec, chunk_id, encode_blob, frame_record
from tiercheck.formats.manifest import (
    AbortRecord,
    ChunkRef,
    CommitRecord,
    DropRecord,
    Entry,
    LogRecord,
    PrepareRecord,
    ShardManifest,
    VersionInfo,
    pack_manifest,
    pack_record,
)

HERE = Path(__file__).resolve().parent


def fixed_chunks() -> tuple[bytes, bytes]:
    """``(base, new)``: fp32 "weights" before and after a small update, plus a 3-byte tail.

    ``new`` is 4099 bytes (1024 float32 and 3 odd bytes); ``base`` is shorter (1000
    float32), so the delta vector exercises the XOR rule's copied tail and the shuffle's
    unshuffled tail.
    """
    base_vals = [math.sin(i * 0.37) * 0.05 for i in range(1000)]
    new_vals = [(base_vals[i] if i < 1000 else 0.0) - 1e-4 * math.cos(i * 1.3) for i in range(1024)]
    base = struct.pack("<1000f", *base_vals)
    new = struct.pack("<1024f", *new_vals) + b"\x01\x02\x03"
    return base, new


def fixed_blobs(base: bytes, new: bytes) -> dict[str, bytes]:
    """The blob vectors, by file name."""
    return {
        "blob_raw.bin": encode_blob(new, Codec.RAW),
        "blob_zstd.bin": encode_blob(new, Codec.ZSTD, level=3),
        "blob_delta.bin": encode_blob(
            new, Codec.DELTA, base=base, base_id=chunk_id(base), elem_size=4, level=1
        ),
        "blob_empty_zstd.bin": encode_blob(b"", Codec.ZSTD),
    }


def fixed_manifest(base: bytes, new: bytes) -> ShardManifest:
    """A two-rank version's rank-1 shard: two tensors, a msgpack leaf, two 4 KiB chunks."""
    return ShardManifest(
        version=7,
        rank=1,
        world_size=2,
        chunk_size=4096,
        stream_bytes=4096 + 4099,
        entries=(
            Entry("model/w", "tensor", "float32", (32, 32), 0, 4096),
            Entry("model/b", "tensor", "bfloat16", (3,), 4096, 6),
            Entry("step", "msgpack", "", (), 4160, 1),
        ),
        chunks=(ChunkRef(chunk_id(base[:4096]), 0, 4096), ChunkRef(chunk_id(new), 4096, 4099)),
        tree={
            "d": [["model", {"o": {"d": [["w", {"e": 0}], ["b", {"e": 1}]]}}], ["step", {"e": 2}]]
        },
        extra={"writer": "golden"},
    )


def fixed_records(manifest_id: str, base: bytes, new: bytes) -> list[LogRecord]:
    """One record of every type, in log order."""
    return [
        PrepareRecord(
            version=7,
            rank=1,
            step=700,
            role="diff",
            base=5,
            manifest=manifest_id,
            chunks_written=2,
            bytes_written=8259,
            time=1700000000.25,
            deltas={chunk_id(new): chunk_id(base)},
        ),
        CommitRecord(
            VersionInfo(
                id=7,
                step=700,
                role="diff",
                base=5,
                world_size=2,
                shards=(chunk_id(b"rank 0 manifest"), manifest_id),
                time=1700000001.5,
                logical_bytes=16518,
                metadata={"loss": 1.25, "tags": ["golden"]},
            )
        ),
        AbortRecord(version=8, reason="rank 1 failed to prepare"),
        DropRecord(version=5, time=1700000002.0),
    ]


def main() -> None:
    base, new = fixed_chunks()
    files: dict[str, bytes] = {"input_base.bin": base, "input_new.bin": new}
    files |= fixed_blobs(base, new)
    manifest = pack_manifest(fixed_manifest(base, new))
    files["manifest.msgpack"] = manifest
    records = [pack_record(r) for r in fixed_records(chunk_id(manifest), base, new)]
    log = b"".join(frame_record(r) for r in records)
    files["log.bin"] = log
    # A crash mid-append: the last frame is cut short, so a reader returns 4 records.
    files["log_torn.bin"] = log + frame_record(records[0])[:-5]
    for name, data in files.items():
        (HERE / name).write_bytes(data)

    index: dict[str, Any] = {
        "format": [1, 0],
        "zstd_version": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "inputs": {
            "base": {"file": "input_base.bin", "id": chunk_id(base)},
            "new": {"file": "input_new.bin", "id": chunk_id(new)},
        },
        "blobs": [
            {"file": "blob_raw.bin", "codec": "raw", "id": chunk_id(new), "input": "new"},
            {
                "file": "blob_zstd.bin",
                "codec": "zstd",
                "level": 3,
                "id": chunk_id(new),
                "input": "new",
            },
            {
                "file": "blob_delta.bin",
                "codec": "delta",
                "level": 1,
                "elem_size": 4,
                "id": chunk_id(new),
                "input": "new",
                "base": chunk_id(base),
            },
            {
                "file": "blob_empty_zstd.bin",
                "codec": "zstd",
                "level": 1,
                "id": chunk_id(b""),
                "input": None,
            },
        ],
        "manifest": {"file": "manifest.msgpack", "id": chunk_id(manifest)},
        "log": {
            "file": "log.bin",
            "records": len(records),
            "record_ids": [chunk_id(r) for r in records],
        },
        "log_torn": {"file": "log_torn.bin", "records": len(records)},
        "blake3": {name: chunk_id(data) for name, data in sorted(files.items())},
    }
    (HERE / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"wrote {len(files)} files and index.json to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
