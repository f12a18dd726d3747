"""Real training for ``benchmarks/run.py``: bytes written per version (dense, frozen layers,
LoRA adapters on a frozen base) and the slowdown of checkpointing every step.

Both use the demo's GPT (``tiercheck.cli.demo``): 3.2 M parameters, AdamW, character data.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_lib import SHM, dcp_stager, destroy, dir_bytes, disk_dir, median
from torch import nn

import tiercheck
from tiercheck.cli.demo import GPT, CharLoader, ModelConfig, Training, make_corpus, train_step
from tiercheck.store.config import TierSpec

SEED = 7


def _lora(model: GPT, rank: int = 8) -> list[nn.Parameter]:
    """Freeze the model and add a rank-``rank`` adapter (x A B) to every Linear in the blocks."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = nn.ParameterList()
    for block in model.blocks:
        for lin in [m for m in block.modules() if isinstance(m, nn.Linear)]:
            a = nn.Parameter(torch.randn(lin.in_features, rank) * 0.01)
            b = nn.Parameter(torch.zeros(rank, lin.out_features))
            adapters.extend([a, b])

            def hook(_m: nn.Module, inp: Any, out: torch.Tensor, a: Any = a, b: Any = b) -> Any:
                return out + (inp[0] @ a) @ b

            lin.register_forward_hook(hook)
    model.adapters = adapters
    return list(adapters)


def build(scenario: str, steps: int, seed: int = SEED) -> Training:
    """``dense``: every parameter trains; ``frozen``: embeddings and all blocks but the last
    are frozen; ``lora``: the whole base is frozen, rank-8 adapters train."""
    torch.manual_seed(seed)
    cfg = ModelConfig()
    model = GPT(cfg)
    if scenario == "dense":
        trainable = list(model.parameters())
    elif scenario == "frozen":
        for mod in [model.tok, model.pos, *model.blocks[:-1]]:
            for p in mod.parameters():
                p.requires_grad_(False)
        trainable = [p for p in model.parameters() if p.requires_grad]
    elif scenario == "lora":
        trainable = _lora(model)
    else:
        raise ValueError(scenario)
    optim = torch.optim.AdamW(trainable, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    )
    loader = CharLoader(make_corpus(seed), cfg.vocab, cfg.ctx, 16, seed)
    return Training(model, optim, sched, loader)


def bytes_per_version(scenario: str, versions: int) -> dict[str, Any]:
    """Train ``versions`` steps saving every step; bytes each version wrote per tier.

    Tiers: the default shm (raw) and LMDB (bases) tiers, a memory tier with the delta codec
    standing in for the peer tier (DESIGN.md: delta+zstd toward peers), and the remote
    file tier (bases, zstd, migrated). Peers: the size of a torch.save file and of a DCP
    checkpoint of the same state (every version writes all of it).
    """
    tr = build(scenario, versions)
    root = Path(tempfile.mkdtemp(prefix="tc-bench-bpv-", dir=disk_dir()))
    tiers = [
        # budgets that hold every version: the table is what a version costs
        TierSpec("shm", f"shm://tc-bench-bpv-{root.name}", {"budget": "4GiB"}),
        TierSpec("delta", f"memory://bpv-{root.name}", {"budget": "4GiB"}),
        TierSpec("lmdb", f"lmdb://{root / 'lmdb'}"),
        TierSpec("remote", f"file://{root / 'remote'}", {"survives": "cluster", "shared": True}),
    ]
    policy = tiercheck.Policy(
        base_every=10,
        tiers={"delta": tiercheck.TierPolicy(versions="all", mode="sync", codec="delta")},
    )
    rows: list[dict[str, Any]] = []
    ckpt = tiercheck.Checkpointer(root, tiers=tiers, policy=policy)
    try:
        ckpt.guard(tr.optim, log=False)  # chunk-dedup diffs; log versions: log_versions.py
        for step in range(versions):
            train_step(tr)
            h = ckpt.save(step, tr.state())
            r = h.wait_migrated()
            rows.append(
                {"role": r.role, "logical": r.logical_bytes, "bytes": dict(r.bytes_written)}
            )
        ckpt.wait_migrations()
        bases_remote = sum(1 for v in ckpt.history() if v.tiers.get("remote") == "committed")
        remote_total = dir_bytes(root / "remote")
        with tempfile.TemporaryDirectory(dir=SHM) as d:
            torch.save({"model": tr.model.state_dict(), "optim": tr.optim.state_dict()}, f"{d}/x")
            torch_bytes = Path(f"{d}/x").stat().st_size
    finally:
        destroy(ckpt)
    trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    out: dict[str, Any] = {
        "scenario": scenario,
        "versions": versions,
        "params": sum(p.numel() for p in tr.model.parameters()),
        "trainable_params": trainable,
        "logical_bytes": rows[-1]["logical"],
        "torch_save_bytes": torch_bytes,
    }
    for role in ("base", "diff"):
        sel = [r for r in rows if r["role"] == role]
        for tier in ("shm", "delta", "lmdb"):
            xs = [float(r["bytes"][tier]) for r in sel if tier in r["bytes"]]
            out[f"{role}_{tier}_bytes"] = median(xs) if xs else None
    # the remote tier's bytes on disk (blobs, manifests, log) per base it holds
    out["base_remote_bytes"] = remote_total / bases_remote if bases_remote else None
    return out


def _dcp_state(tr: Training) -> dict[str, Any]:
    osd = tr.optim.state_dict()
    return {
        "model": tr.model.state_dict(),
        "optim": {"state": {str(k): v for k, v in osd["state"].items()}},
    }


def training_run(mode: str, steps: int) -> float:
    """Wall seconds for ``steps`` training steps of the demo model, checkpointing every step
    with ``mode``: ``none``, ``tiercheck`` (default tiers, base every 10, ``guard``) or
    ``dcp_async`` (async_save + DefaultStager to /dev/shm; staging awaited before the
    optimizer step, the previous upload before the next save). Includes waiting for the
    last checkpoint to be committed."""
    tr = build("dense", steps)
    train_step(tr)  # warm-up step, not timed (first-call allocations)
    if mode == "none":
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(tr)
        return time.perf_counter() - t0
    if mode == "tiercheck":
        root = Path(tempfile.mkdtemp(prefix="tc-bench-train-", dir=disk_dir()))
        ckpt = tiercheck.Checkpointer(root, policy=tiercheck.Policy(base_every=10))
        try:
            ckpt.prepare(tr.state())
            ckpt.guard(tr.optim)
            t0 = time.perf_counter()
            h = None
            for step in range(steps):
                train_step(tr)
                h = ckpt.save(step, tr.state())
            assert h is not None
            h.wait()
            return time.perf_counter() - t0
        finally:
            destroy(ckpt)
    if mode == "dcp_async":
        import torch.distributed.checkpoint as dcp

        stager = dcp_stager()
        d = Path(tempfile.mkdtemp(prefix="tc-bench-train-dcp-", dir=SHM))
        try:
            staging: Any = None
            upload: Any = None
            t0 = time.perf_counter()
            for step in range(steps):
                x, y = tr.loader.next_batch()
                logits = tr.model(x)
                loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
                tr.optim.zero_grad(set_to_none=True)
                loss.backward()
                if staging is not None:
                    staging.result()
                tr.optim.step()
                tr.sched.step()
                if upload is not None:
                    upload.result()
                    shutil.rmtree(d / f"s{step - 2}", ignore_errors=True)
                resp = dcp.async_save(
                    _dcp_state(tr),
                    storage_writer=dcp.FileSystemWriter(d / f"s{step}", thread_count=2),
                    async_stager=stager,
                    no_dist=True,
                )
                staging = getattr(resp, "staging_completion", None)
                upload = getattr(resp, "upload_completion", resp)
            upload.result()
            return time.perf_counter() - t0
        finally:
            stager.close()
            shutil.rmtree(d, ignore_errors=True)
    raise ValueError(mode)
