"""Generate the format v1 golden vectors in this directory. Run once, by hand, and commit.

    python tests/golden/make_golden.py

The fixed inputs are built by the ``fixed_*`` functions below (tests/test_golden.py
imports them to re-encode and compare); the raw chunk inputs are also written out as
files, so the vectors do not depend on any random number generator staying stable.
Regenerating is a format change: it must come with a SPEC.md change and a version bump,
unless only the libzstd version changed (see SPEC.md section 11). The vectors of older
schema versions live in ``v1_0/`` and ``v1_1/`` and are never regenerated: they are what a
newer reader must keep reading.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import zstandard

from tiercheck.core.entries import encode_scalar
from tiercheck.formats import Codec, chunk_id, encode_blob, frame_record
from tiercheck.formats.ids import chunk_check
from tiercheck.formats.manifest import (
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    AbortRecord,
    ChunkRef,
    CommitRecord,
    DropRecord,
    Entry,
    Fingerprint,
    GroupOptions,
    LogRecord,
    LogStep,
    ParamSpec,
    PrepareRecord,
    ReplayLog,
    ShardManifest,
    ShardPlacement,
    SmallTensor,
    VersionInfo,
    pack_manifest,
    pack_record,
)
from tiercheck.logversions.fingerprint import wsum64_reference

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
        chunks=(
            ChunkRef(chunk_id(base[:4096]), 0, 4096, chunk_check(base[:4096])),
            ChunkRef(chunk_id(new), 4096, 4099, chunk_check(new)),
        ),
        tree={
            "d": [["model", {"o": {"d": [["w", {"e": 0}], ["b", {"e": 1}]]}}], ["step", {"e": 2}]]
        },
        extra={"writer": "golden"},
    )


def fixed_sharded_stream(base: bytes) -> bytes:
    """The stream of :func:`fixed_sharded_manifest`: a 16x32 float32 piece, a replicated
    float32 (4,), padding to 64, the msgpack int 3."""
    return base[:2048] + base[2048:2064] + bytes(48) + b"\x03"


def fixed_sharded_manifest(base: bytes) -> ShardManifest:
    """Rank 1 of two: rows 16..31 of a (32, 32) tensor sharded on dim 0, a replicated (4,)
    tensor, and a plain leaf (SPEC.md section 14)."""
    stream = fixed_sharded_stream(base)
    return ShardManifest(
        version=9,
        rank=1,
        world_size=2,
        chunk_size=4096,
        stream_bytes=len(stream),
        entries=(
            Entry("model/w", "tensor", "float32", (16, 32), 0, 2048),
            Entry("model/r", "tensor", "float32", (4,), 2048, 16),
            Entry("step", "msgpack", "", (), 2112, 1),
        ),
        chunks=(ChunkRef(chunk_id(stream), 0, len(stream)),),
        tree={
            "d": [["model", {"o": {"d": [["w", {"s": 0}], ["r", {"s": 1}]]}}], ["step", {"e": 2}]]
        },
        sharded={
            0: ShardPlacement((32, 32), (32, 1), (2,), ("S(0)",), (16, 0)),
            1: ShardPlacement((4,), (1,), (2,), ("R",), (0,)),
        },
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


ADAMW_OPTIONS: dict[str, Any] = {
    "lr": 0.001,
    "betas": (0.9, 0.999),
    "eps": 1e-08,
    "weight_decay": 0.01,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


def _options(**changes: Any) -> bytes:
    """One param group's options, packed as SPEC.md section 12.2 says (section 8 msgpack)."""
    opts = {k: v for k, v in {**ADAMW_OPTIONS, **changes}.items() if v is not _TENSOR}
    return encode_scalar([opts], "param_groups", allow_pickle=False)[1]


_TENSOR = object()  # marks an option that is tensor-valued (left out of the packed map)


def fixed_log_stream(new: bytes) -> bytes:
    """The byte stream of the log version below (SPEC.md section 12.3, chunk size 128).

    Step 0 holds a float32 (4, 8) gradient (new[0:128]) at 0 and a bfloat16 (3,) gradient
    (new[128:134]) at 128; step 1 was skipped; step 2 starts at 192 with a float32 (4, 8)
    gradient (new[256:384]). The leaves start at 320: a float32 (4,) buffer (new[400:416])
    and a msgpack scheduler state at 384.
    """
    stream = bytearray(384)
    stream[0:134] = new[0:134]
    stream[192:320] = new[256:384]
    stream[320:336] = new[400:416]
    return bytes(stream) + fixed_sched_leaf()


def fixed_sched_leaf() -> bytes:
    return encode_scalar({"last_epoch": 3, "base_lrs": [0.001]}, "sched", allow_pickle=False)[1]


def fixed_log_manifest(base: bytes, new: bytes) -> ShardManifest:
    """A log version's shard: three steps (one skipped), a mirror, replayed leaves in the
    tree, two leaves of its own; every kind of field of SPEC.md section 12.2."""
    stream = fixed_log_stream(new)
    leaf = fixed_sched_leaf()
    # segments [0, 192) (step 0 and its padding), [192, 192) (step 1, skipped),
    # [192, 320) (step 2), [320, 416) (the leaves), each cut every 128 bytes
    windows = [(0, 128), (128, 64), (192, 128), (320, len(stream) - 320)]
    assert len(stream) == 416
    scalar = struct.pack("<f", 0.0005)
    lr_tensor = (0, "lr", SmallTensor("float32", (), scalar))
    replay = ReplayLog(
        optimizer="torch.optim.adamw.AdamW",
        torch="2.13.0+cpu",
        device="cpu",
        flags=({"foreach": None, "capturable": False, "differentiable": False, "fused": None},),
        params=(ParamSpec(0, "float32", (4, 8)), ParamSpec(0, "bfloat16", (3,))),
        mirrors=((0, "bfloat16"),),
        steps=(
            LogStep(
                index=0,
                skipped=False,
                grads=(0, 1),
                options=GroupOptions(_options()),
                counter=4.0,
                scaler={"scale": 1024.0, "growth_tracker": 3},
            ),
            LogStep(
                index=1,
                skipped=True,
                grads=(),
                options=None,
                scaler={"scale": 1024.0, "growth_tracker": 4},
            ),
            LogStep(
                index=2,
                skipped=False,
                grads=(2, None),
                options=GroupOptions(_options(lr=_TENSOR), (lr_tensor,)),
                attrs={
                    "grad_scale": SmallTensor("float32", (), struct.pack("<f", 1 / 1024)),
                    "found_inf": SmallTensor("float32", (), struct.pack("<f", 0.0)),
                },
                counter=5.0,
                scaler={"scale": 512.0, "growth_tracker": 0},
            ),
        ),
        options=GroupOptions(_options(lr=_TENSOR), (lr_tensor,)),
        fingerprints={
            "param/0": Fingerprint("blake3", fixed_fingerprints(base, new)["base"]["blake3"]),
            "param/1": Fingerprint("wsum64", fixed_fingerprints(base, new)["new"]["wsum64"]),
            "state/0/step": Fingerprint("value", encode_scalar(6.0, "", allow_pickle=False)[1]),
            "mirror/0": Fingerprint("wsum64", fixed_fingerprints(base, new)["base"]["wsum64"]),
        },
        scaler={
            "scale": 512.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 0,
        },
    )
    return ShardManifest(
        version=9,
        rank=0,
        world_size=1,
        chunk_size=128,
        stream_bytes=len(stream),
        entries=(
            Entry("/log/0/0", "tensor", "float32", (4, 8), 0, 128),
            Entry("/log/0/1", "tensor", "bfloat16", (3,), 128, 6),
            Entry("/log/2/0", "tensor", "float32", (4, 8), 192, 128),
            Entry("model/running_mean", "tensor", "float32", (4,), 320, 16),
            Entry("sched", "msgpack", "", (), 384, len(leaf)),
        ),
        chunks=tuple(ChunkRef(chunk_id(stream[o : o + n]), o, n) for o, n in windows),
        tree={
            "d": [
                [
                    "model",
                    {
                        "o": {
                            "d": [
                                ["w", {"r": "param/0"}],
                                ["b", {"r": "param/1"}],
                                ["running_mean", {"e": 3}],
                            ]
                        }
                    },
                ],
                ["model_bf16", {"d": [["w", {"r": "mirror/0"}]]}],
                ["sched", {"e": 4}],
            ]
        },
        extra={"writer": "golden"},
        log=replay,
    )


def fixed_log_records(manifest_id: str) -> list[LogRecord]:
    """The prepare and commit records of the log version (role ``log``, base 7)."""
    return [
        PrepareRecord(
            version=9,
            rank=0,
            step=903,
            role="log",
            base=7,
            manifest=manifest_id,
            chunks_written=3,
            bytes_written=500,
            time=1700000003.0,
        ),
        CommitRecord(
            VersionInfo(
                id=9,
                step=903,
                role="log",
                base=7,
                world_size=1,
                shards=(manifest_id,),
                time=1700000003.5,
                logical_bytes=16518,
            )
        ),
    ]


def fixed_fingerprints(base: bytes, new: bytes) -> dict[str, dict[str, bytes]]:
    """SPEC.md section 12.4 fingerprints of the fixed inputs, from their definitions."""
    import blake3

    return {
        name: {"blake3": blake3.blake3(data).digest(length=16), "wsum64": wsum64_reference(data)}
        for name, data in (("base", base), ("new", new))
    }


V1_1_FILES = (
    "manifest.msgpack",
    "log.bin",
    "log_version_manifest.msgpack",
    "log_version_records.bin",
    "sharded_manifest.msgpack",
)


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
    log_manifest = pack_manifest(fixed_log_manifest(base, new))
    files["log_version_manifest.msgpack"] = log_manifest
    files["log_version_stream.bin"] = fixed_log_stream(new)
    log_records = [pack_record(r) for r in fixed_log_records(chunk_id(log_manifest))]
    files["log_version_records.bin"] = b"".join(frame_record(r) for r in log_records)
    sharded_manifest = pack_manifest(fixed_sharded_manifest(base))
    files["sharded_manifest.msgpack"] = sharded_manifest
    files["sharded_stream.bin"] = fixed_sharded_stream(base)
    for name, data in files.items():
        (HERE / name).write_bytes(data)

    index: dict[str, Any] = {
        "format": {"blobs": [1, 0], "schema": [SCHEMA_MAJOR, SCHEMA_MINOR]},
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
        "log_version": {
            "manifest": {"file": "log_version_manifest.msgpack", "id": chunk_id(log_manifest)},
            "stream": "log_version_stream.bin",
            "records": {
                "file": "log_version_records.bin",
                "record_ids": [chunk_id(r) for r in log_records],
            },
        },
        "sharded": {
            "manifest": {"file": "sharded_manifest.msgpack", "id": chunk_id(sharded_manifest)},
            "stream": "sharded_stream.bin",
        },
        "fingerprints": {
            name: {algo: digest.hex() for algo, digest in fps.items()}
            for name, fps in fixed_fingerprints(base, new).items()
        },
        "v1_0": {
            name: {"file": f"v1_0/{name}", "blake3": chunk_id((HERE / "v1_0" / name).read_bytes())}
            for name in ("manifest.msgpack", "log.bin", "manifest_1_0.py")
        },
        # schema 1.1, before each chunk's check (1.2): what a 1.2 reader keeps reading
        "v1_1": {
            name: {"file": f"v1_1/{name}", "blake3": chunk_id((HERE / "v1_1" / name).read_bytes())}
            for name in V1_1_FILES
        },
        "blake3": {name: chunk_id(data) for name, data in sorted(files.items())},
    }
    (HERE / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"wrote {len(files)} files and index.json to {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
