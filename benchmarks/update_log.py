"""The update log on real dense training: bytes per logged step, capture cost, replay time.

Trains a GPT-like transformer (random tokens, real backward passes) in three setups:

- ``fp32``: fp32 parameters, AdamW, a LambdaLR schedule, gradient clipping;
- ``mixed``: bf16 parameters with fp32 master weights (the common "bf16 params, fp32
  master" setup: the optimizer steps the masters with fp32 copies of the bf16 gradients,
  then the bf16 weights are re-cast; they are registered as *mirrors*, so a log version
  does not store them);
- ``autocast``: fp32 parameters, forward under ``torch.autocast(bfloat16)``: the gradients
  the optimizer reads are full fp32.

For each it measures, against the state a full version stores (every tensor and leaf of
``{"model", "optim", "sched", ...}``, plus the masters in ``mixed``):

- bytes per logged step (the gradients as the optimizer read them), raw and as
  byte-shuffle + zstd blobs (the delta codec against the empty chunk, level 1) and plain
  zstd, and the whole log version of one step (gradients + shard manifest + the leaves
  the replay does not reproduce);
- trainer-visible capture cost per step (the update log's pre- and post-hook, timed by
  hooks registered around them), once the ring has grown (the steady state: from the
  second interval between full versions on) and while it grows, and per saved version
  (``take`` and the fingerprints), against a warm full staging copy of the state
  (``StagingBuffer.stage``);
- replay time of 1, 5 and 20 steps (including verification), against restoring a full
  version of the same state from an shm tier (fp32 only).

    python benchmarks/update_log.py [--scale 1.0] [--out benchmarks/results/update_log.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zstandard
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import disk_dir, one_tier, store

import tiercheck
from tiercheck.core.chunking import plan_layout
from tiercheck.core.entries import flatten
from tiercheck.engine.staging import StagingBuffer
from tiercheck.formats import Codec, chunk_id, encode_blob
from tiercheck.formats.manifest import ChunkRef, ShardManifest, pack_manifest
from tiercheck.logversions.fingerprint import fingerprints
from tiercheck.logversions.replay import replay
from tiercheck.logversions.update_log import (
    LoggedSteps,
    UpdateLog,
    estimate_replay_seconds,
    plan_log,
    replayed_leaves,
    replayed_tensors,
)

CHUNK = 4 << 20
EMPTY_ID = chunk_id(b"")
REPLAY_STEPS = (1, 5, 20)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# --- the training setups ----------------------------------------------------------------


@dataclass
class Setup:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    step: Callable[[], None]
    state: Callable[[], dict[str, Any]]
    mirrors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _gpt(vocab: int, d: int, layers: int) -> nn.ModuleDict:
    layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    return nn.ModuleDict(
        {
            "emb": nn.Embedding(vocab, d),
            "body": nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            "head": nn.Linear(d, vocab),
        }
    )


def make_setup(name: str, scale: float, seed: int = 0) -> Setup:
    torch.manual_seed(seed)
    vocab, d, layers = int(8192 * scale), int(256 * scale) // 4 * 4, 4
    model = _gpt(vocab, d, layers)
    data = torch.Generator().manual_seed(seed + 1)
    loader = {"position": 0}

    def batch() -> torch.Tensor:
        loader["position"] += 4
        return torch.randint(0, vocab, (4, 65), generator=data)

    def loss_of(m: nn.ModuleDict, tokens: torch.Tensor) -> torch.Tensor:
        logits = m["head"](m["body"](m["emb"](tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    if name == "mixed":
        model = model.to(torch.bfloat16)
        masters = [p.detach().float().requires_grad_(True) for p in model.parameters()]
        opt: torch.optim.Optimizer = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
        pairs = list(zip(masters, model.parameters()))

        def step() -> None:
            loss = loss_of(model, batch())
            model.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            for master, p in pairs:
                master.grad = p.grad.float()  # exact: every bf16 value is an fp32 value
            nn.utils.clip_grad_norm_(masters, 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                for master, p in pairs:
                    p.copy_(master)

        def state() -> dict[str, Any]:
            return {
                "model": model,
                "master": masters,
                "optim": opt,
                "sched": sched,
                "loader": loader,
                "rng": tiercheck.rng_state(),
            }

        return Setup(name, model, opt, sched, step, state, mirrors=pairs)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    autocast = name == "autocast"

    def step() -> None:
        tokens = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    def state() -> dict[str, Any]:
        return {
            "model": model,
            "optim": opt,
            "sched": sched,
            "loader": loader,
            "rng": tiercheck.rng_state(),
        }

    return Setup(name, model, opt, sched, step, state)


# --- measuring ----------------------------------------------------------------------------


def attach_timed(setup: Setup, ulog: UpdateLog) -> tuple[list[float], list[Any]]:
    """Attach ``ulog`` between timing hooks; returns the seconds its hooks take per step."""
    marks: dict[str, float] = {}
    per_step: list[float] = []

    def mark(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            marks[name] = time.perf_counter()
            if name == "post1":
                per_step.append(marks["pre1"] - marks["pre0"] + marks["post1"] - marks["post0"])

        return hook

    opt = setup.opt
    handles = [opt.register_step_pre_hook(mark("pre0")), opt.register_step_post_hook(mark("post0"))]
    ulog.attach(opt, mirrors=setup.mirrors)  # hooks run in the order they were registered
    handles += [
        opt.register_step_pre_hook(mark("pre1")),
        opt.register_step_post_hook(mark("post1")),
    ]
    return per_step, handles


def state_bytes(state: dict[str, Any]) -> int:
    _, leaves = flatten(state)
    return sum(leaf.nbytes for leaf in leaves)


def compressed_bytes(logged: LoggedSteps, elem_size: int) -> dict[str, list[int]]:
    """Per step: bytes of its gradient chunks as shuffle+zstd blobs and as zstd blobs; and
    shuffle+zstd of the gradients other than the embedding's alone (``dense``), raw and
    compressed: with random tokens only the rows of the tokens seen have a gradient, which
    flatters the whole-step ratio."""
    out: dict[str, list[int]] = {"shuffle_zstd": [], "zstd": [], "dense_raw": [], "dense": []}

    def shuffled(raw: memoryview) -> int:
        return len(encode_blob(raw, Codec.DELTA, base=b"", base_id=EMPTY_ID, elem_size=elem_size))

    for step in logged.steps:
        if step.skipped:
            continue
        data = step.data
        pieces = [data[off : off + CHUNK] for off in range(0, len(data), CHUNK)]
        out["shuffle_zstd"].append(sum(shuffled(p) for p in pieces))
        out["zstd"].append(sum(len(encode_blob(p, Codec.ZSTD)) for p in pieces))
        emb = step.grads[0]  # the embedding is the first parameter
        dense = data[emb.offset + emb.nbytes :] if emb is not None else data
        out["dense_raw"].append(len(dense))
        out["dense"].append(
            sum(shuffled(dense[off : off + CHUNK]) for off in range(0, len(dense), CHUNK))
        )
    return out


def log_version_bytes(setup: Setup, logged: LoggedSteps) -> dict[str, int]:
    """A log version of ``logged``: its gradient stream, leaves and shard manifest."""
    _, leaves = flatten(setup.state())
    replayed = replayed_leaves(leaves, replayed_tensors(setup.opt, setup.mirrors))
    own = [leaf for leaf in leaves if leaf.key not in replayed]
    layout = plan_log(logged, CHUNK)
    leaf_layout = plan_layout(own, CHUNK)
    manifest = ShardManifest(
        version=1,
        rank=0,
        world_size=1,
        chunk_size=CHUNK,
        stream_bytes=layout.end + leaf_layout.stream_bytes,
        entries=layout.entries + leaf_layout.entries,
        chunks=tuple(ChunkRef(EMPTY_ID, o, n) for o, n in layout.windows)
        + tuple(ChunkRef(EMPTY_ID, layout.end + o, n) for o, n in leaf_layout.windows),
        tree=None,
        log=layout.replay,
    )
    return {
        "gradients": logged.nbytes,
        "leaves": leaf_layout.stream_bytes,
        "manifest": len(pack_manifest(manifest)),
        "replayed_leaves": len(replayed),
        "own_leaves": len(own),
    }


def staging_copy_seconds(setup: Setup, repeats: int) -> list[float]:
    _, leaves = flatten(setup.state())
    layout = plan_layout(leaves, CHUNK)
    buf = StagingBuffer()
    buf.stage(leaves, layout)  # warm
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.stage(leaves, layout)
        out.append(time.perf_counter() - t0)
    return out


def gradient_source(logged: LoggedSteps) -> Any:
    """``gradient(i)`` over the ring's buffers, in the entry order of ``plan_log``."""
    layout = plan_log(logged, CHUNK)
    data = [d for _, d in layout.segments]
    starts = [o for o, _ in layout.segments]

    def gradient(i: int) -> torch.Tensor:
        e = layout.entries[i]
        seg = max(j for j, s in enumerate(starts) if s <= e.offset)
        view = data[seg][e.offset - starts[seg] : e.offset - starts[seg] + e.nbytes]
        raw = torch.frombuffer(view, dtype=torch.uint8)
        return raw.view(getattr(torch, e.dtype)).reshape(e.shape)

    return layout, gradient


def run_setup(name: str, scale: float, steps: int, repeats: int) -> dict[str, Any]:
    setup = make_setup(name, scale)
    ulog = UpdateLog()
    hook_seconds, handles = attach_timed(setup, ulog)
    for _ in range(2):
        setup.step()
    # The first interval between full versions grows the ring (first-touch allocations);
    # from the next one on, every step copies into a warm buffer: time both.
    ulog.reset()
    hook_seconds.clear()
    for _ in range(steps):
        setup.step()
    cold = list(hook_seconds)
    base = copy.deepcopy({"model": setup.model.state_dict(), "opt": setup.opt.state_dict()})
    ulog.reset()
    hook_seconds.clear()
    takes: dict[int, LoggedSteps] = {}
    take_s: list[float] = []
    fp_s: list[float] = []
    for k in range(1, steps + 1):
        setup.step()
        if k in REPLAY_STEPS:
            t0 = time.perf_counter()
            logged = ulog.take(fingerprint=False)
            t1 = time.perf_counter()
            fps = fingerprints(replayed_tensors(setup.opt, setup.mirrors))
            take_s.append(t1 - t0)
            fp_s.append(time.perf_counter() - t1)
            takes[k] = logged.with_fingerprints(fps)
    for h in handles:
        h.remove()
    sbytes = state_bytes(setup.state())
    last = takes[max(takes)]
    comp = compressed_bytes(last, elem_size=4)
    version = log_version_bytes(setup, takes[min(takes)])
    raw = median([float(s.nbytes) for s in last.steps])
    shuffled = median([float(x) for x in comp["shuffle_zstd"]])
    zstd_only = median([float(x) for x in comp["zstd"]])
    dense_ratio = median([c / r for c, r in zip(comp["dense"], comp["dense_raw"])])
    rest = version["leaves"] + version["manifest"]
    out: dict[str, Any] = {
        "setup": name,
        "params": sum(
            p.numel() for p, _ in [(p, 0) for g in setup.opt.param_groups for p in g["params"]]
        ),
        "state_bytes": sbytes,
        "grad_bytes_per_step": raw,
        "grad_bytes_shuffle_zstd_per_step": shuffled,
        "grad_bytes_zstd_per_step": zstd_only,
        "log_version_1_step": version,
        "ratio_grads_raw": raw / sbytes,
        "ratio_grads_shuffle_zstd": shuffled / sbytes,
        "ratio_grads_zstd": zstd_only / sbytes,
        "shuffle_zstd_ratio_without_embedding": dense_ratio,
        "ratio_grads_shuffle_zstd_if_all_dense": raw * dense_ratio / sbytes,
        "ratio_log_version_raw": (raw + rest) / sbytes,
        "ratio_log_version_shuffle_zstd": (shuffled + rest) / sbytes,
        "capture_hooks_s_per_step": median(hook_seconds),
        "capture_hooks_s_per_step_cold_ring": median(cold),
        "take_s": median(take_s),
        "fingerprint_s": median(fp_s),
        "staging_copy_s": median(staging_copy_seconds(setup, repeats)),
        "steps_logged": max(takes),
    }
    if name == "fp32":
        out["replay"] = {
            str(k): replay_seconds(name, scale, base, logged, repeats=1)
            for k, logged in sorted(takes.items())
        }
        out["restore_full_shm_s"] = restore_full_seconds(setup, repeats)
    for logged in takes.values():
        ulog.release(logged)
    ulog.detach()
    return out


def replay_seconds(
    name: str, scale: float, base: dict[str, Any], logged: LoggedSteps, repeats: int
) -> dict[str, float]:
    runs = []
    fresh = make_setup(name, scale, seed=1)
    layout, gradient = gradient_source(logged)
    for _ in range(repeats):
        b = copy.deepcopy(base)
        fresh.model.load_state_dict(b["model"])
        fresh.opt.load_state_dict(b["opt"])
        gc.collect()
        report = replay(fresh.opt, layout.replay, gradient, mirrors=fresh.mirrors)
        runs.append(report.seconds)
    return {
        "seconds": median(runs),
        "estimate_s": estimate_replay_seconds(logged, state_bytes(fresh.state())),
        "steps": report.steps,
        "verified": report.verified,
    }


def restore_full_seconds(setup: Setup, repeats: int) -> float:
    tiers, policy = one_tier(
        "shm",
        "shm://tc-ulog-{uid}",
        tiercheck.TierPolicy(codec="raw", versions="all", mode="sync", keep_bases=1),  # type: ignore[arg-type]
    )
    runs = []
    disk_dir().mkdir(parents=True, exist_ok=True)  # where store() puts the store's root
    with store(tiers, policy) as ckpt:
        ckpt.save(0, setup.state(), role="base").wait()
        for _ in range(repeats):
            gc.collect()
            t0 = time.perf_counter()
            ckpt.restore(setup.state(), tiers=["shm"])
            runs.append(time.perf_counter() - t0)
    return median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="model width multiplier")
    ap.add_argument("--steps", type=int, default=max(REPLAY_STEPS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--setups", default="fp32,mixed,autocast")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "update_log.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name in args.setups.split(","):
        print(f"{name}: {args.steps} steps", file=sys.stderr, flush=True)
        r = run_setup(name, args.scale, args.steps, args.repeats)
        results.append(r)
        print(
            f"  state {r['state_bytes'] / 2**20:.1f} MiB; per logged step: grads "
            f"{r['ratio_grads_raw']:.3f}x raw, {r['ratio_grads_shuffle_zstd']:.3f}x "
            f"shuffle+zstd ({r['ratio_grads_shuffle_zstd_if_all_dense']:.3f}x if every "
            f"gradient compressed as the non-embedding ones), {r['ratio_grads_zstd']:.3f}x zstd;"
            " log version of 1 step "
            f"{r['ratio_log_version_raw']:.3f}x raw / {r['ratio_log_version_shuffle_zstd']:.3f}x"
            f"\n  capture {r['capture_hooks_s_per_step'] * 1e3:.2f} ms/step (growing the "
            f"ring: {r['capture_hooks_s_per_step_cold_ring'] * 1e3:.2f}), take "
            f"{r['take_s'] * 1e3:.2f} ms + fingerprints {r['fingerprint_s'] * 1e3:.1f} ms "
            f"per version; full staging copy {r['staging_copy_s'] * 1e3:.1f} ms",
            file=sys.stderr,
        )
        if "replay" in r:
            reps = ", ".join(f"{k} steps {v['seconds']:.3f} s" for k, v in r["replay"].items())
            print(
                f"  replay {reps}; full restore from shm {r['restore_full_shm_s']:.3f} s",
                file=sys.stderr,
            )
    doc = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
            "load_avg_1m": os.getloadavg()[0],
        },
        "setup": {
            "scale": args.scale,
            "steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
            "chunk_size": CHUNK,
            "compression": "delta codec vs the empty chunk (byte-shuffle, elem 4) + zstd 1",
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
