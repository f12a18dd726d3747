"""Restoring a state into its live tensors: tiercheck from shm against the libraries a user
would pick instead, each reading from /dev/shm, side by side in one process.

    python benchmarks/restore.py                    # 1 GiB (64 x 16 MiB fp32), 5 repeats
    python benchmarks/restore.py --quick            # 64 MiB, 3 repeats (CI)
    python benchmarks/restore.py --out restore.json # also write the numbers (JSON)
    python benchmarks/restore.py --device cuda      # the live tensors on the GPU
    python benchmarks/restore.py --no-restart       # in this process only (no fresh ones)

Every system restores into the same live tensors (a dict of ``--tensors`` fp32 tensors on
``--device``), so each pays for putting the bytes where the trainer has them:

- ``memcpy_s``: one copy of the state's bytes (host to host, or host to device): the floor;
- ``tc_shm_s``: ``restore(state)`` from a store whose only tier is shm (raw blobs), every
  byte verified (against its chunk's XXH3-128 check, which the save took before the
  BLAKE3 id: shm's copies never left this host's memory) and the restore all or nothing;
- ``tc_shm_prepared_s``: the same from a shm-only store the trainer prepared
  (``ckpt.prepare(state)``) before its save, as a training loop does (or any store from its
  third save on): shm wrote the blobs into segments it keeps mapped, and a restore in the
  process that wrote them reads through those mappings (no mapping made, no page faulted);
- ``tc_default_s``: the same from the default store (shm + LMDB), served from shm;
- ``tc_module_s``: the same bytes as the parameters of an ``nn.Module``, restored as
  ``restore({"model": module})`` from a shm-only store: a trainer's model (it loads by
  reference, no undo copy);
- ``dcp_load_s``: ``dcp.load(state)`` from a ``dcp.save`` directory in /dev/shm;
- ``torch_load_s``: ``torch.load`` of a ``torch.save`` file in /dev/shm, then ``copy_``
  into the live tensors; ``torch_load_mmap_s`` the same with ``mmap=True``;
- ``safetensors_s``: ``safetensors.torch.load_file`` from /dev/shm, then ``copy_``;
- ``tc_shm_restart_s``, ``tc_module_restart_s`` and ``dcp_load_restart_s``: the restore
  of a restarted trainer, each
  run in a fresh process (tiercheck opening the store read-only) into freshly made live
  tensors; only the restore call is timed, not the interpreter's start or its imports.

The repeats run round robin (one of each system, then again), so a busy machine slows
them alike; the numbers are medians. Ratios are tiercheck's over each peer's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_lib import MIB, SHM, median, one_tier, private_disk_dir, store

import tiercheck
from tiercheck.store.lifecycle import shm_root_left_as_found


def make_state(tensors: int, tensor_mib: float, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = int(tensor_mib * MIB) // 4
    return {f"layer{i:03d}.weight": torch.randn(n, generator=g).to(device) for i in range(tensors)}


def make_module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model whose parameters are copies of ``state``'s tensors."""
    return torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in state.values()])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_into(live: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in live.items():
            t.copy_(loaded[k])


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    gc.collect()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def shm_store_of(ckpt: tiercheck.Checkpointer) -> tuple[str, str]:
    """Where a restarted process finds ``ckpt``'s store: its root and its shm tier's URL."""
    shm = ckpt.tierset.get("shm").tier
    assert shm is not None
    return str(ckpt.root), shm.url


def restarted(kind: str, where: str, url: str, tensors: int, tensor_mib: float) -> float:
    """One restore in a fresh process (this script's ``--child``): seconds of the call."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, where, url, str(tensors), str(tensor_mib)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"the restarted {kind} restore failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.split()[-1])


def child(kind: str, where: str, url: str, tensors: int, tensor_mib: float) -> None:
    """A restarted trainer's restore: fresh live tensors (made, so touched, as a model's
    are), then one timed restore; prints its seconds."""
    live = make_state(tensors, tensor_mib, CPU)  # initialized, as a new model's are
    if kind in ("tc", "tc_module"):
        tp = tiercheck.TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
        tiers, policy = one_tier("shm", url, tp)
        ckpt = tiercheck.Checkpointer(where, tiers=tiers, policy=policy, read_only=True)
        target: dict[str, Any] = live if kind == "tc" else {"model": make_module(live)}
        del live  # a restarted trainer holds its model once
        t0 = time.perf_counter()
        ckpt.restore(target)
        seconds = time.perf_counter() - t0
        ckpt.close()
    else:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.load(live, checkpoint_id=where, no_dist=True)
        seconds = time.perf_counter() - t0
    print(seconds)


CPU = torch.device("cpu")


def measure(
    live: dict[str, torch.Tensor],
    repeats: int,
    device: torch.device,
    default: bool,
    restart: tuple[int, float] | None = None,
) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    nbytes = sum(t.numel() * t.element_size() for t in live.values())
    src = torch.cat([t.detach().reshape(-1).cpu() for t in live.values()])
    if device.type == "cuda":
        src = src.pin_memory()
    # what was saved: views of the one host copy (no second copy of the state)
    saved = dict(
        zip(
            live,
            (
                v.view(t.shape)
                for v, t in zip(src.split([t.numel() for t in live.values()]), live.values())
            ),
        )
    )
    dst = torch.empty(src.numel(), dtype=src.dtype, device=device)
    work = Path(tempfile.mkdtemp(prefix="tc-bench-restore-", dir=SHM))
    runs: dict[str, list[float]] = {}
    systems: dict[str, Callable[[], Any]] = {}
    try:
        systems["memcpy_s"] = lambda: dst.copy_(src, non_blocking=True)
        dcp.save(live, checkpoint_id=work / "dcp", no_dist=True)
        systems["dcp_load_s"] = lambda: dcp.load(live, checkpoint_id=work / "dcp", no_dist=True)
        torch.save(saved, work / "state.pt")

        def torch_load(mmap: bool) -> None:
            copy_into(live, torch.load(work / "state.pt", mmap=mmap, weights_only=True))

        systems["torch_load_s"] = lambda: torch_load(False)
        systems["torch_load_mmap_s"] = lambda: torch_load(True)
        save_file(saved, str(work / "state.safetensors"))
        systems["safetensors_s"] = lambda: copy_into(
            live, load_file(str(work / "state.safetensors"))
        )
        tp = tiercheck.TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
        tiers, policy = one_tier("shm", "shm://tc-restore-{uid}", tp)
        prepared_tiers, _ = one_tier("shm", "shm://tc-restore-prepared-{uid}", tp)
        with store(tiers, policy) as shm_only, store(prepared_tiers, policy) as prepared:
            shm_only.save(1, live).wait()
            systems["tc_shm_s"] = lambda: shm_only.restore(live)
            prepared.prepare(live)
            prepared.save(1, live).wait()
            systems["tc_shm_prepared_s"] = lambda: prepared.restore(live)
            if restart is not None:
                where, url = shm_store_of(shm_only)
                systems["tc_shm_restart_s"] = lambda: restarted("tc", where, url, *restart)
                systems["dcp_load_restart_s"] = lambda: restarted(
                    "dcp", str(work / "dcp"), "", *restart
                )
            model = make_module(live)
            tiers, policy = one_tier("shm", "shm://tc-restore-model-{uid}", tp)
            with store(tiers, policy) as of_model:
                of_model.save(1, {"model": model}).wait()
                systems["tc_module_s"] = lambda: of_model.restore({"model": model})
                if restart is not None:
                    m_where, m_url = shm_store_of(of_model)
                    systems["tc_module_restart_s"] = lambda: restarted(
                        "tc_module", m_where, m_url, *restart
                    )
                if default:
                    with store(None, tiercheck.Policy(base_every=1, gc_grace_seconds=0)) as dflt:
                        dflt.save(1, live).wait()
                        systems["tc_default_s"] = lambda: dflt.restore(live)
                        rounds(systems, runs, repeats, device)
                else:
                    rounds(systems, runs, repeats, device)
            check(live, saved)
            check(dict(zip(live, model)), saved)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runs["state_bytes"] = [float(nbytes)]
    return runs


def rounds(
    systems: dict[str, Callable[[], Any]],
    runs: dict[str, list[float]],
    repeats: int,
    device: torch.device,
) -> None:
    for name, fn in systems.items():  # one warm-up each: first-touch page faults, imports
        if not name.endswith("_restart_s"):  # (a fresh process each time: nothing to warm)
            fn()
    for _ in range(repeats):
        for name, fn in systems.items():
            runs.setdefault(name, []).append(
                fn() if name.endswith("_restart_s") else timed(fn, device)
            )


def check(live: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    for k, t in live.items():
        if not torch.equal(t.cpu(), saved[k]):
            raise SystemExit(f"restored {k} differs from what was saved")


LABELS = {
    "memcpy_s": "one copy of the state's bytes (the floor)",
    "tc_shm_s": "tiercheck restore, shm-only store (verified, all or nothing)",
    "tc_shm_prepared_s": "tiercheck restore, shm-only store prepared before its save",
    "tc_default_s": "tiercheck restore, default store (from shm)",
    "dcp_load_s": "dcp.load from /dev/shm",
    "torch_load_s": "torch.load from /dev/shm + copy_",
    "torch_load_mmap_s": "torch.load(mmap=True) from /dev/shm + copy_",
    "safetensors_s": "safetensors load_file from /dev/shm + copy_",
    "tc_shm_restart_s": "tiercheck restore, shm-only store, in a fresh process",
    "tc_module_s": "tiercheck restore of the same bytes as an nn.Module, shm-only store",
    "tc_module_restart_s": "the same nn.Module restore, in a fresh process",
    "dcp_load_restart_s": "dcp.load from /dev/shm, in a fresh process",
}


def section(path: Path = Path(__file__).parent / "results" / "restore.json") -> str:
    """The "Restore into live tensors" section of docs/benchmarks.md, from this script's
    JSON (``--out benchmarks/results/restore.json``); empty if it has not been run."""
    if not path.exists():
        return ""
    doc = json.loads(path.read_text())
    nbytes = doc["state_bytes"]
    rows = [
        f"| {LABELS.get(k, k)} | {m * 1e3:,.0f} ms | {nbytes / m / 1e9:.2f} GB/s |"
        for k, m in ((k, v["median"]) for k, v in doc["metrics"].items())
    ]

    def over(key: str) -> str:
        mine, peer = key.split(" / ")
        label = LABELS.get(peer, peer)
        return label if mine == "tc_shm_s" else f"({LABELS.get(mine, mine)}) / ({label})"

    ratios = [f"| {over(k)} | {r:.2f}x |" for k, r in doc["ratios"].items()]
    return (
        "## Restore into live tensors\n\n"
        "`python benchmarks/restore.py --out benchmarks/results/restore.json` restores a state of "
        f"{doc['tensors']} fp32 tensors ({nbytes / 2**30:.2f} GiB) on {doc['device']} into its own "
        "live tensors, each system reading from /dev/shm, the repeats round robin; run on "
        f"{doc['created']}, torch {doc['torch']}, median of {doc['repeats']}, load average "
        f"{doc['load'][0]:.1f} at the start and {doc['load'][1]:.1f} at the end.\n\n"
        "| system | median | throughput |\n|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "| tiercheck (shm) over | ratio |\n|---|---|\n" + "\n".join(ratios) + "\n\n"
        "tiercheck verifies every chunk of the version where the shm tier holds it, against "
        "the chunk's XXH3-128 check that its manifest records (the save took it from the same "
        "bytes before their BLAKE3 id; SPEC.md section 7.2) ("
        "segment mapped read-only while the restore pins the tier: no put rewrites a deleted "
        "blob's pages until it ends; in the process that saved it, read through the mapping "
        "shm keeps of the segment for its puts, whose pages are already in the page tables, "
        "or, for a blob a save staged straight into shm, where its staging range maps it), "
        "one chunk per core at a time; only when every chunk is "
        "verified does it copy each entry into its live tensor, from the segment, on one "
        "thread per core: per byte one check and one copy, no staging buffer, no allocation. "
        "Tensors outside stateful objects get no undo copy (they are written last, when "
        "nothing can fail any more), nor do those of a module or optimizer that loads by "
        "reference (torch's own, no load hooks: written last too); an object of another "
        "kind has its tensors copied before the load, since its `load_state_dict` may raise "
        "half way. `safetensors` and "
        "`torch.load(mmap=True)` map the file and copy once, verifying nothing. The restarted "
        "rows are what a trainer pays after a crash: a fresh process, whose every new page "
        "costs a fault (on this VM a fresh GiB costs 2-3 s of system time, "
        "docs/benchmarks.md's trainer-overhead section); tiercheck touches no new page but "
        "the mappings, `dcp.load` reads into buffers of its own.\n\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--tensor-mib", type=float, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-default-store", action="store_true", help="shm-only store alone")
    p.add_argument("--quick", action="store_true", help="64 x 1 MiB, 3 repeats")
    p.add_argument("--out", type=Path, default=None, help="write the numbers here (JSON)")
    p.add_argument(
        "--no-restart", action="store_true", help="no restores in fresh processes (CPU only)"
    )
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, where, url, tensors, tensor_mib = args.child
        child(kind, where, url, int(tensors), float(tensor_mib))
        return 0
    if args.quick:
        args.tensor_mib, args.repeats = 1, 3
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("no CUDA device here: run it on a GPU machine, or pass --device cpu")
        device = torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
        torch.cuda.set_device(device)
    live = make_state(args.tensors, args.tensor_mib, device)
    load0 = os.getloadavg()[0]
    with private_disk_dir(), shm_root_left_as_found():
        restart = (
            None if args.no_restart or device.type != "cpu" else (args.tensors, args.tensor_mib)
        )
        m = measure(live, args.repeats, device, not args.no_default_store, restart)
    load1 = os.getloadavg()[0]
    nbytes = int(m.pop("state_bytes")[0])
    print(
        f"restore of {nbytes / MIB:.0f} MiB ({args.tensors} fp32 tensors) into live tensors on "
        f"{device}, {args.repeats} repeats, load average {load0:.1f} -> {load1:.1f}"
    )
    for k, runs in m.items():
        gbs = nbytes / median(runs) / 1e9
        print(
            f"  {k:20s} {median(runs) * 1e3:9.1f} ms {gbs:6.2f} GB/s  "
            f"{[round(x * 1e3, 1) for x in runs]}"
        )
    ratios = {
        f"tc_shm_s / {peer}": median(m["tc_shm_s"]) / median(m[peer])
        for peer in m
        if peer
        not in (
            "tc_shm_s",
            "tc_shm_prepared_s",
            "tc_shm_restart_s",
            "dcp_load_restart_s",
            "tc_module_restart_s",
        )
    }
    if "tc_shm_prepared_s" in m:
        ratios["tc_shm_prepared_s / dcp_load_s"] = median(m["tc_shm_prepared_s"]) / median(
            m["dcp_load_s"]
        )
    for mine in ("tc_shm_restart_s", "tc_module_restart_s"):
        if mine in m:
            ratios[f"{mine} / dcp_load_restart_s"] = median(m[mine]) / median(
                m["dcp_load_restart_s"]
            )
    for label, r in ratios.items():
        print(f"  {label}: {r:.2f}x")
    if args.out is not None:
        out = {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device),
            "torch": torch.__version__,
            "state_bytes": nbytes,
            "tensors": args.tensors,
            "repeats": args.repeats,
            "load": [load0, load1],
            "metrics": {k: {"median": median(v), "runs": v, "unit": "s"} for k, v in m.items()},
            "ratios": ratios,
        }
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
