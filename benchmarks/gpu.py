"""Saving a state that lives on a GPU: tiercheck against ``dcp.async_save`` on the same GPU.

    python benchmarks/gpu.py                       # 1 GiB on the current GPU, 5 repeats
    python benchmarks/gpu.py --device cuda:1       # on another GPU
    python benchmarks/gpu.py --out gpu.json        # also write the numbers (JSON)
    python benchmarks/gpu.py --device cpu --state-mib 4 --repeats 1   # the same path, no GPU

The state is ``bench_lib.make_state``'s model + AdamW moments moved to the device, with each
parameter's ``step`` left on the CPU as ``torch.optim.AdamW`` keeps it: a mixed state, so
both staging paths run (device-to-host copies on a side stream of the tensor's own device
into a pinned buffer, and CPU copies). Every number is the median of ``--repeats`` runs
in this process, one system after the other, the state changed densely between saves:

- ``copy_to_host_s``: every tensor copied into host tensors allocated beforehand (pinned,
  non-blocking, then one synchronize: ``bench_lib.copy_warm``): the floor for staging;
- ``tc_blocked_s``, ``tc_staged_s``, ``tc_committed_shm_s``: a store with the shm tier
  alone (every save a base, raw), ``save()`` returning / staged / committed;
- ``tc_committed_default_s``: the default store (shm + LMDB), in its steady state;
- ``tc_restore_shm_s``: restore from shm into the state's own device tensors;
- ``dcp_load_disk_s``: ``dcp.load`` into the same device tensors from a ``dcp.save``
  directory on disk (the page cache warm, as right after the save);
- ``dcp_async_blocked_s``, ``dcp_async_staged_s``, ``dcp_async_committed_disk_s``:
  ``dcp.async_save`` with DCP's ``DefaultStager`` (pinned memory and non-blocking copies
  where CUDA is there) to disk, returning / staged / durable; on torch before 2.13 a
  fresh stager for each save (a reused one fails there, pytorch/pytorch#183413).

Without ``--device cpu`` it needs CUDA and says so; with it, the same code runs on the CPU
(the test suite does that, so this script keeps working where no GPU is at hand).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_lib import (
    MIB,
    BenchState,
    copy_warm,
    dcp_async,
    dcp_save_load,
    dcp_stager,
    default_store_warmup,
    disk_dir,
    make_state,
    median,
    one_tier,
    private_disk_dir,
    scratch,
    store,
    tc_restores,
    tc_saves,
    timed_async_save,
)
from torch.torch_version import TorchVersion

import tiercheck
from tiercheck.store.lifecycle import shm_root_left_as_found

# name: (tiercheck metric, peer metric)
COMPARISONS = {
    "staged vs a plain copy to pinned host memory": ("tc_staged_s", "copy_to_host_s"),
    "staged vs DCP async staged": ("tc_staged_s", "dcp_async_staged_s"),
    "blocked vs DCP async blocked": ("tc_blocked_s", "dcp_async_blocked_s"),
    "committed at shm vs DCP async committed (disk)": (
        "tc_committed_shm_s",
        "dcp_async_committed_disk_s",
    ),
    "committed, default store vs DCP async committed (disk)": (
        "tc_committed_default_s",
        "dcp_async_committed_disk_s",
    ),
    "restore from shm vs dcp.load (disk)": ("tc_restore_shm_s", "dcp_load_disk_s"),
}


def cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device (``set_device`` and
    the per-device streams need the index; ``torch.device("cuda")`` has none)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.device("cuda", index)


def stager_per_save() -> bool:
    """Whether DCP's ``DefaultStager`` must be made anew for each ``async_save``: on torch
    before 2.13 a reused one fails (``KeyError: <class 'type'>``, pytorch/pytorch#183413)."""
    return TorchVersion(torch.__version__) < "2.13"


def dcp_async_stager_per_save(bs: BenchState, where: Path, repeats: int) -> dict[str, Any]:
    """``dcp.async_save`` as ``bench_lib.dcp_async`` measures it (``blocked``, ``staged``,
    ``committed``, the first call apart), with a fresh ``DefaultStager`` for every save
    (torch's workaround for #183413); each stager is closed once its save is durable."""

    blocked, staged, committed = [], [], []
    with scratch(where) as d:
        for i in range(repeats + 1):
            bs.mutate()
            path = d / f"async-{i}"
            stager = dcp_stager()
            try:
                b, s, c = timed_async_save(bs.state, path, stager)
                blocked.append(b)
                staged.append(s)
                committed.append(c)
            finally:
                stager.close()
            shutil.rmtree(path, ignore_errors=True)
    return {
        "blocked_first": blocked[0],
        "staged_first": staged[0],
        "blocked": blocked[1:],
        "staged": staged[1:],
        "committed": committed[1:],
    }


def on_device(bs: BenchState, device: torch.device) -> BenchState:
    """``bs`` with its tensors moved to ``device``, except AdamW's per-parameter ``step``
    (0-dimensional), which stays on the CPU as torch's AdamW keeps it."""
    moved = {id(t): (t if t.dim() == 0 else t.to(device)) for t in bs.tensors}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return moved[id(node)]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return BenchState(walk(bs.state), bs.params, bs.nbytes, [moved[id(t)] for t in bs.tensors])


def measure(bs: BenchState, repeats: int) -> dict[str, list[float]]:
    m: dict[str, list[float]] = {"copy_to_host_s": copy_warm(bs, repeats)}
    tp = tiercheck.TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
    tiers, policy = one_tier("shm", "shm://tc-gpu-{uid}", tp)
    with store(tiers, policy) as ckpt:
        r = tc_saves(ckpt, bs, repeats, warm=1)
        m["tc_blocked_s"], m["tc_staged_s"] = r["blocked"], r["staged"]
        m["tc_committed_shm_s"] = r["committed"]
        m["tc_restore_shm_s"] = tc_restores(ckpt, bs, repeats, "shm")["runs"]
    with store(None, tiercheck.Policy(base_every=1, gc_grace_seconds=0)) as ckpt:
        r = tc_saves(ckpt, bs, repeats, warm=default_store_warmup())
        m["tc_committed_default_s"] = r["committed"]
    m["dcp_load_disk_s"] = dcp_save_load(bs, disk_dir(), repeats, load=True)["load"]
    if stager_per_save():
        r = dcp_async_stager_per_save(bs, disk_dir(), repeats)
    else:
        r = dcp_async(bs, disk_dir(), repeats)
    m["dcp_async_blocked_s"] = r["blocked"]
    m["dcp_async_staged_s"] = r["staged"]
    m["dcp_async_committed_disk_s"] = r["committed"]
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument("--state-mib", type=float, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the numbers here (JSON)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("no CUDA device here: run it on a GPU machine, or pass --device cpu")
        device = cuda_device(device)
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    bs = on_device(make_state(int(args.state_mib * MIB)), device)
    load0 = os.getloadavg()[0]
    with private_disk_dir(), shm_root_left_as_found():
        m = measure(bs, args.repeats)
    load1 = os.getloadavg()[0]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"state {bs.nbytes / MIB:.0f} MiB on {device} ({name}), {args.repeats} repeats, "
        f"load average {load0:.1f} -> {load1:.1f}"
    )
    for k, runs in m.items():
        print(f"  {k:28s} {median(runs) * 1e3:9.1f} ms   {[round(x * 1e3, 1) for x in runs]}")
    ratios = {}
    restore_gbs = bs.nbytes / median(m["tc_restore_shm_s"]) / 1e9
    print(f"restore from shm into the {device} tensors: {restore_gbs:.2f} GB/s")
    for label, (tc, peer) in COMPARISONS.items():
        ratios[label] = median(m[tc]) / median(m[peer])
        print(f"{label}: {ratios[label]:.2f}x")
    if args.out is not None:
        out = {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device),
            "device_name": name,
            "torch": torch.__version__,
            "dcp_stager_per_save": stager_per_save(),
            "state_bytes": bs.nbytes,
            "repeats": args.repeats,
            "load": [load0, load1],
            "metrics": {k: {"median": median(v), "runs": v, "unit": "s"} for k, v in m.items()},
            "ratios": ratios,
            "restore_shm_gb_per_s": restore_gbs,
        }
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
