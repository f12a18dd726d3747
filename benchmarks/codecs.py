"""Codec throughput and compression ratio on real fp32 training state.

Trains a tiny transformer language model for a few AdamW steps on random tokens, takes the
weights and Adam's ``exp_avg`` after two consecutive steps as base and new, cuts each into
4 MiB chunks, and runs every codec over the chunks (median of 3 runs):

    python benchmarks/codecs.py [--steps 6] [--out benchmarks/results/codecs.json]

Encode and decode rates are raw (logical) bytes per second on one thread; decode includes
the BLAKE3 verification every real read does. Writes a table to stdout and JSON to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import zstandard
from torch import nn

from tiercheck.formats import Codec, chunk_id, chunk_ids, decode_blob, encode_blob

CHUNK = 4 << 20


def train_snapshots(steps: int, seed: int = 0) -> dict[str, tuple[bytes, bytes]]:
    """``{"weights": (step k, step k+1), "exp_avg": (...)}`` as fp32 byte strings."""
    torch.manual_seed(seed)
    vocab, d, layers, seq, batch = 8192, 384, 4, 64, 8
    layer = nn.TransformerEncoderLayer(d, 6, 4 * d, dropout=0.0, batch_first=True)
    model = nn.ModuleDict(
        {
            "emb": nn.Embedding(vocab, d),
            "body": nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            "head": nn.Linear(d, vocab),
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def step() -> None:
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        hidden = model["body"](model["emb"](tokens[:, :-1]))
        loss = nn.functional.cross_entropy(
            model["head"](hidden).flatten(0, 1), tokens[:, 1:].flatten()
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    def snapshot() -> tuple[bytes, bytes]:
        params = [p for p in model.parameters()]
        weights = b"".join(p.detach().numpy().tobytes() for p in params)
        exp_avg = b"".join(opt.state[p]["exp_avg"].numpy().tobytes() for p in params)
        return weights, exp_avg

    for _ in range(steps - 1):
        step()
    w0, m0 = snapshot()
    step()
    w1, m1 = snapshot()
    return {"weights": (w0, w1), "exp_avg": (m0, m1)}


def chunks_of(data: bytes) -> list[memoryview]:
    view = memoryview(data)
    return [view[i : i + CHUNK] for i in range(0, len(view), CHUNK)]


def timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def run_codec(
    name: str, codec: Codec, new: list[memoryview], base: list[memoryview], **kw: int
) -> dict[str, Any]:
    ids = chunk_ids(new)
    base_ids = chunk_ids(base)
    by_id = dict(zip(base_ids, (bytes(b) for b in base)))
    total = sum(len(c) for c in new)

    def encode_one(i: int) -> bytes:
        blob: bytes
        if codec is Codec.DELTA:
            blob = encode_blob(new[i], codec, base=base[i], base_id=base_ids[i], **kw)
        else:
            blob = encode_blob(new[i], codec, **kw)
        return blob

    enc_s, blobs = timed(lambda: [encode_one(i) for i in range(len(new))])
    with ThreadPoolExecutor(2) as pool:
        enc2_s, _ = timed(lambda: list(pool.map(encode_one, range(len(new)))))
    out = bytearray(CHUNK)

    def decode_all() -> None:
        for blob, cid in zip(blobs, ids):
            decode_blob(blob, cid, base_lookup=by_id.__getitem__, out=memoryview(out))

    dec_s, _ = timed(decode_all)
    stored = sum(len(b) for b in blobs)
    return {
        "codec": name,
        "raw_bytes": total,
        "stored_bytes": stored,
        "ratio": total / stored,
        "encode_GBps": total / enc_s / 1e9,
        "encode_2threads_GBps": total / enc2_s / 1e9,
        "decode_GBps": total / dec_s / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "codecs.json"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    load_before = os.getloadavg()
    snaps = train_snapshots(args.steps)
    rows: list[dict[str, Any]] = []
    unchanged: dict[str, int] = {}
    for what, (old, new) in snaps.items():
        new_c, old_c = chunks_of(new), chunks_of(old)
        cases: list[tuple[str, Codec, dict[str, int]]] = [
            ("raw", Codec.RAW, {}),
            ("zstd-1", Codec.ZSTD, {"level": 1}),
            ("zstd-3", Codec.ZSTD, {"level": 3}),
            ("delta-1 e=4", Codec.DELTA, {"level": 1, "elem_size": 4}),
            ("delta-3 e=4", Codec.DELTA, {"level": 3, "elem_size": 4}),
            ("delta-1 e=1", Codec.DELTA, {"level": 1, "elem_size": 1}),
        ]
        for name, codec, kw in cases:
            row = run_codec(name, codec, new_c, old_c, **kw)
            row["data"] = what
            rows.append(row)
        # Delta against the empty chunk is byte-shuffle + zstd with no base: what a
        # shuffled-zstd codec would give a base version.
        empty = [memoryview(b"")] * len(new_c)
        row = run_codec("shuf-zstd-1", Codec.DELTA, new_c, empty, level=1, elem_size=4)
        row["data"] = what
        rows.append(row)
        same = sum(a == b for a, b in zip(chunk_ids(old_c), chunk_ids(new_c)))
        unchanged[what] = same
        print(f"{what}: {len(new) / 1e6:.1f} MB, {len(new_c)} chunks, {same} unchanged")

    weights = snaps["weights"][1]
    hash1_s, _ = timed(lambda: [chunk_id(c) for c in chunks_of(weights)])
    hash_s, _ = timed(lambda: chunk_ids(chunks_of(weights)))
    hash_serial_s, _ = timed(lambda: chunk_ids(chunks_of(weights), threads=1))

    print(f"{'data':8} {'codec':12} {'ratio':>7} {'enc GB/s':>9} {'enc 2thr':>9} {'dec GB/s':>9}")
    for r in rows:
        print(
            f"{r['data']:8} {r['codec']:12} {r['ratio']:7.3f} {r['encode_GBps']:9.2f} "
            f"{r['encode_2threads_GBps']:9.2f} {r['decode_GBps']:9.2f}"
        )
    n = len(weights)
    print(
        f"chunk_ids on {n / 1e6:.0f} MB: all cores {n / hash_s / 1e9:.2f} GB/s, "
        f"1 thread {n / hash_serial_s / 1e9:.2f} GB/s"
    )
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
            "loadavg_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "setup": {
            "model": "TransformerEncoder 4x384, vocab 8192, AdamW lr 1e-3",
            "steps": args.steps,
            "chunk_bytes": CHUNK,
            "repeat": 3,
            "statistic": "median",
            "note": "encode/decode on one thread unless stated; decode includes BLAKE3 verify",
        },
        "unchanged_chunks": unchanged,
        "rows": rows,
        "hash_GBps": {
            "chunk_ids_all_cores": n / hash_s / 1e9,
            "chunk_ids_1_thread": n / hash_serial_s / 1e9,
            "chunk_id_loop": n / hash1_s / 1e9,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
