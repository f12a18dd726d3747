"""Measurement helpers for ``benchmarks/run.py``: the benchmark state, timers, a peak-RSS
sampler, the peers (torch.save/load, DCP, DCP async_save, safetensors) and tiercheck stores.

Every function here measures one thing on the state it is given and returns plain numbers
(seconds, bytes); ``run.py`` decides what to run, how often, and what to write.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

import tiercheck
from tiercheck.core.sizes import tree_bytes
from tiercheck.store.config import TierSpec
from tiercheck.store.lifecycle import destroy_store

MIB = 1 << 20
GIB = 1 << 30
SHM = Path("/dev/shm")

warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch")


# --- the state ------------------------------------------------------------------------------


@dataclass
class BenchState:
    """A GPT-like model's weights plus AdamW state, as the nested dict trainers save."""

    state: dict[str, Any]
    params: int
    nbytes: int
    tensors: list[torch.Tensor] = field(repr=False)

    def mutate(self) -> None:
        """Change every byte-chunk, as a dense training step does (outside any timing)."""
        with torch.no_grad():
            for t in self.tensors:
                if t.is_floating_point() and t.dim() > 0:
                    t.add_(1e-3)
                else:
                    t.add_(1)

    def flat(self) -> dict[str, torch.Tensor]:
        """One level of ``name -> tensor`` (what safetensors takes)."""
        out: dict[str, torch.Tensor] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, torch.Tensor):
                out[prefix] = node
            elif isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)

        walk("", self.state)
        return out


def make_state(target_bytes: int, seed: int = 0) -> BenchState:
    """A transformer's parameters (embedding + blocks) and AdamW moments of ~``target_bytes``.

    At 1.03 GiB this is d_model 768, 12 blocks, vocab 8192: 92 M parameters, as in
    BACKGROUND.md. Smaller and larger states change the number of blocks (and, for tiny
    ones, the width).
    """
    g = torch.Generator().manual_seed(seed)
    params_target = max(target_bytes // 12, 4096)
    d, vocab = (768, 8192) if params_target > 30_000_000 else (256, 2048)
    if params_target < 1_000_000:
        d, vocab = 64, 256
    per_block = 12 * d * d + 13 * d
    layers = max(1, round((params_target - vocab * d) / per_block))
    shapes: dict[str, tuple[int, ...]] = {"tok.weight": (vocab, d)}
    for i in range(layers):
        p = f"blocks.{i}."
        shapes |= {
            p + "ln1.weight": (d,),
            p + "ln1.bias": (d,),
            p + "attn.qkv.weight": (3 * d, d),
            p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d),
            p + "attn.proj.bias": (d,),
            p + "ln2.weight": (d,),
            p + "ln2.bias": (d,),
            p + "mlp.fc.weight": (4 * d, d),
            p + "mlp.fc.bias": (4 * d,),
            p + "mlp.proj.weight": (d, 4 * d),
            p + "mlp.proj.bias": (d,),
        }
    shapes |= {"ln.weight": (d,), "ln.bias": (d,)}
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    tensors: list[torch.Tensor] = []
    for i, (name, shape) in enumerate(shapes.items()):
        w = torch.randn(shape, generator=g) * 0.02
        m = torch.randn(shape, generator=g) * 1e-3
        v = torch.rand(shape, generator=g) * 1e-6
        step = torch.tensor(100.0)
        model[name] = w
        optim_state[str(i)] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        tensors += [w, m, v, step]
    params = sum(t.numel() for t in model.values())
    groups = [
        {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "params": list(range(len(model)))}
    ]
    state = {"model": model, "optim": {"state": optim_state, "param_groups": groups}}
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return BenchState(state, params, nbytes, tensors)


# --- timing and memory ----------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class PeakRSS:
    """Samples this process's RSS every ``interval`` seconds in a thread; ``extra`` is the
    peak minus the RSS at ``start``."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.base = 0
        self.peak = 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


def cpu_seconds() -> float:
    """CPU time of this process, every thread (user + system)."""
    t = psutil.Process().cpu_times()
    return float(t.user + t.system)


@contextmanager
def scratch(where: Path) -> Iterator[Path]:
    """A fresh directory under ``where``, removed afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="tc-bench-", dir=where))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def private_disk_dir() -> Iterator[Path]:
    """A directory of this run's own under :func:`disk_dir`, which :func:`disk_dir` returns
    until the context exits and the directory is removed: concurrent runs (a CI smoke run
    beside a full one) never remove each other's files. torch's cache directory (made in
    /tmp the first time an optimizer is built) goes in it too, unless the caller set one."""
    base = disk_dir()
    base.mkdir(parents=True, exist_ok=True)
    own = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    env = {"TIERCHECK_BENCH_DISK": str(own), "TORCHINDUCTOR_CACHE_DIR": str(own / "torch")}
    previous = {k: os.environ.get(k) for k in env}
    os.environ["TIERCHECK_BENCH_DISK"] = env["TIERCHECK_BENCH_DISK"]
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", env["TORCHINDUCTOR_CACHE_DIR"])
    try:
        yield own
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(own, ignore_errors=True)
        try:
            base.rmdir()  # only if no other run is using it
        except OSError:
            pass


def disk_dir() -> Path:
    """A directory on the machine's real disk (not tmpfs)."""
    return Path(os.environ.get("TIERCHECK_BENCH_DISK", Path.home() / ".cache" / "tc-bench"))


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dir_bytes(root: Path) -> int:
    return tree_bytes(root, apparent=True)


# --- plain copies ---------------------------------------------------------------------------


def copy_warm(bs: BenchState, repeats: int) -> list[float]:
    """``dst.copy_(src)`` into host tensors allocated (and touched) once beforehand; from a
    GPU, into pinned ones with non-blocking copies and one synchronize at the end."""
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in bs.tensors]
    for d in dst:
        d.zero_()
    cuda = any(t.is_cuda for t in bs.tensors)
    runs = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for d, s in zip(dst, bs.tensors):
            d.copy_(s, non_blocking=s.is_cuda)
        if cuda:
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return runs[1:]  # the first pass warms caches and TLB (and the copy engines)


def copy_fresh(bs: BenchState, repeats: int) -> list[float]:
    """``src.clone()``: a copy into freshly allocated memory (first-touch page faults)."""
    runs = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = [t.clone() for t in bs.tensors]
        runs.append(time.perf_counter() - t0)
        del out
    return runs


# --- peers ---------------------------------------------------------------------------------


def torch_save(bs: BenchState, where: Path, repeats: int, *, fsync: bool) -> dict[str, Any]:
    """torch.save of the whole state to one file in ``where`` (fsync'ed if asked)."""
    runs, cpu, rss = [], [], []
    with scratch(where) as d:
        for i in range(repeats):
            path = d / f"ckpt-{i}.pt"
            c0 = cpu_seconds()
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                with open(path, "wb") as f:
                    torch.save(bs.state, f)
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
                runs.append(time.perf_counter() - t0)
            cpu.append(cpu_seconds() - c0)
            rss.append(mem.extra)
            nbytes = path.stat().st_size
            path.unlink()
    return {"runs": runs, "cpu": cpu, "rss": rss, "bytes": nbytes}


def disk_floor(bs: BenchState, where: Path, repeats: int, *, threads: int = 2) -> list[float]:
    """The disk's floor: the state's bytes as they lie in memory, written by ``threads``
    threads to one file each (vectored writes, no serialization, no metadata) and fsynced.

    Any save that makes the state durable on this disk pays at least this; the durable
    paths (``dcp.save``, a migration, LMDB) are reported against it as well as against each
    other, so a ratio near 1 between two of them can be told apart from both being slow.
    """
    from tiercheck.backends._fsspec.local import write_all

    views = [t.detach().reshape(-1).view(torch.uint8).numpy() for t in bs.tensors if t.numel()]
    groups: list[list[Any]] = [[] for _ in range(threads)]
    sizes = [0] * threads
    for v in sorted(views, key=len, reverse=True):  # balanced by bytes, as DCP's writers
        i = sizes.index(min(sizes))
        groups[i].append(v)
        sizes[i] += len(v)

    def write(path: Path, group: list[Any]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, [memoryview(v) for v in group])  # the file tier's own writer
            os.fsync(fd)
        finally:
            os.close(fd)

    runs = []
    with scratch(where) as d, ThreadPoolExecutor(threads) as pool:
        for i in range(repeats):
            paths = [d / f"floor-{i}-{k}" for k in range(threads)]
            t0 = time.perf_counter()
            list(pool.map(write, paths, groups))
            runs.append(time.perf_counter() - t0)
            for path in paths:
                path.unlink()
    return runs


def torch_load(bs: BenchState, where: Path, repeats: int) -> list[float]:
    """torch.load of a file in ``where`` (into new tensors: that is what torch.load does)."""
    runs = []
    with scratch(where) as d:
        path = d / "ckpt.pt"
        torch.save(bs.state, path)
        for _ in range(repeats):
            gc.collect()
            t0 = time.perf_counter()
            out = torch.load(path, weights_only=True)
            runs.append(time.perf_counter() - t0)
            del out
    return runs


def safetensors_save_load(bs: BenchState, where: Path, repeats: int) -> dict[str, list[float]]:
    from safetensors.torch import load_file, save_file

    flat = bs.flat()
    save_runs, load_runs = [], []
    with scratch(where) as d:
        for i in range(repeats):
            path = d / f"s{i}.safetensors"
            t0 = time.perf_counter()
            save_file(flat, str(path))
            save_runs.append(time.perf_counter() - t0)
            gc.collect()
            t0 = time.perf_counter()
            out = load_file(str(path))
            load_runs.append(time.perf_counter() - t0)
            del out
            path.unlink()
    return {"save": save_runs, "load": load_runs}


def dcp_save_load(
    bs: BenchState, where: Path, repeats: int, *, load: bool, threads: int = 2
) -> dict[str, Any]:
    """dcp.save with FileSystemWriter (fsync on, ``threads`` writer threads); dcp.load into
    the state's own tensors (in place, as DCP does)."""
    import torch.distributed.checkpoint as dcp

    save_runs, load_runs, cpu, rss = [], [], [], []
    with scratch(where) as d:
        for i in range(repeats):
            path = d / f"dcp-{i}"
            c0 = cpu_seconds()
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                dcp.save(
                    bs.state,
                    storage_writer=dcp.FileSystemWriter(path, thread_count=threads),
                    no_dist=True,
                )
                save_runs.append(time.perf_counter() - t0)
            cpu.append(cpu_seconds() - c0)
            rss.append(mem.extra)
            nbytes = dir_bytes(path)
            if load:
                gc.collect()
                t0 = time.perf_counter()
                dcp.load(bs.state, checkpoint_id=path, no_dist=True)
                load_runs.append(time.perf_counter() - t0)
            shutil.rmtree(path)
    return {"save": save_runs, "load": load_runs, "cpu": cpu, "rss": rss, "bytes": nbytes}


def dcp_stager() -> Any:
    """DCP's DefaultStager with async staging into shared memory (no accelerator here, so
    no pinned memory and no non-blocking copies)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=torch.cuda.is_available(),
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=torch.cuda.is_available(),
        )
    )


def timed_async_save(state: Any, path: Path, stager: Any) -> tuple[float, float, float]:
    """One ``dcp.async_save`` of ``state`` to ``path`` (two writer threads) through
    ``stager``: seconds until it returned, until staging completed, until the upload did."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    resp = dcp.async_save(
        state,
        storage_writer=dcp.FileSystemWriter(path, thread_count=2),
        async_stager=stager,
        no_dist=True,
    )
    blocked = time.perf_counter() - t0
    staging = getattr(resp, "staging_completion", None)
    upload = getattr(resp, "upload_completion", resp)
    if staging is not None:
        staging.result()
    staged = time.perf_counter() - t0
    upload.result()
    return blocked, staged, time.perf_counter() - t0


def dcp_async(bs: BenchState, where: Path, repeats: int) -> dict[str, Any]:
    """dcp.async_save with a DefaultStager (one stager for every call, as a trainer keeps
    it); ``blocked`` = async_save returning, ``staged`` = staging_completion, ``committed`` =
    upload_completion (FileSystemWriter, fsync on). The first call is reported apart.
    Peak extra RSS is relative to before the stager was made (as tiercheck's is relative
    to before ``prepare``); the stager's shared-memory copy counts once touched."""

    blocked, staged, committed, cpu, rss = [], [], [], [], []
    gc.collect()
    base_rss = psutil.Process().memory_info().rss  # before the stager: its copy counts
    stager = dcp_stager()
    try:
        with scratch(where) as d:
            for i in range(repeats + 1):
                bs.mutate()
                path = d / f"async-{i}"
                c0 = cpu_seconds()
                with PeakRSS() as mem:
                    mem.base = base_rss
                    b, s, c = timed_async_save(bs.state, path, stager)
                    blocked.append(b)
                    staged.append(s)
                    committed.append(c)
                cpu.append(cpu_seconds() - c0)
                rss.append(mem.extra)
                shutil.rmtree(path, ignore_errors=True)
    finally:
        stager.close()
    return {
        "blocked_first": blocked[0],
        "staged_first": staged[0],
        "blocked": blocked[1:],
        "staged": staged[1:],
        "committed": committed[1:],
        "cpu": cpu[1:],
        "rss": rss,
    }


# --- tiercheck ------------------------------------------------------------------------------


def destroy(ckpt: tiercheck.Checkpointer) -> None:
    """Close ``ckpt`` and delete its store with its shm segments (tiercheck rm)."""
    ckpt.close(wait_migrations=False)
    destroy_store(ckpt.root)


@contextmanager
def store(
    tiers: list[TierSpec] | None,
    policy: tiercheck.Policy,
    root: Path | None = None,
) -> Iterator[tiercheck.Checkpointer]:
    """A fresh Checkpointer (default tiers when ``tiers`` is None), deleted afterwards with
    its shm segments."""
    root = root or Path(tempfile.mkdtemp(prefix="tc-bench-store-", dir=disk_dir()))
    if tiers is not None:
        uid = uuid.uuid4().hex[:10]
        tiers = [
            TierSpec(s.name, s.url.replace("{uid}", uid).replace("{root}", str(root)), s.options)
            for s in tiers
        ]
    ckpt = tiercheck.Checkpointer(root, tiers=tiers, policy=policy)
    try:
        yield ckpt
    finally:
        try:
            ckpt.close(wait_migrations=False)
        finally:
            destroy_store(root)  # the root and its shm segments (tiercheck rm)


def default_store_warmup() -> int:
    """Saves before a new default store reaches its steady state: until then every save
    grows the LMDB file (new disk blocks, page faults on fresh pages of the map); from the
    save after LMDB's retained bases on, each reuses the pages of the base it dropped, as
    every save of a long training run does."""
    from tiercheck.backends._lmdb import LmdbTier
    from tiercheck.store.policy import default_tier_policy

    return (default_tier_policy(LmdbTier.CAPABILITIES).keep_bases or 1) + 1


def tc_saves(
    ckpt: tiercheck.Checkpointer,
    bs: BenchState,
    repeats: int,
    *,
    migrated: bool = False,
    warm: int = 0,
) -> dict[str, Any]:
    """``repeats`` saves of the (densely changed) state, each waited for.

    ``prepare`` runs first (the staging buffer is allocated before the first save, as the
    issue asks). Records per save: blocked (``save`` returning), staged, committed (at the
    synchronous tiers), per-tier commit times, optionally migrated (``wait_migrated``) and the
    migration alone (migrated minus committed),
    background CPU seconds and peak extra RSS (relative to before ``prepare``: the staging
    buffer counts).
    """
    out: dict[str, Any] = {
        "blocked": [],
        "staged": [],
        "committed": [],
        "migrated": [],
        "migration": [],
        "cpu": [],
        "rss": [],
        "tiers": {},
        "bytes": [],
        "blocked_all": [],
        "committed_first": None,
        "committed_warm": [],
        "timings": [],
    }
    gc.collect()
    base_rss = psutil.Process().memory_info().rss
    ckpt.prepare(bs.state)
    for i in range(warm + repeats):
        bs.mutate()
        c0 = cpu_seconds()
        with PeakRSS() as mem:
            mem.base = base_rss
            t0 = time.perf_counter()
            h = ckpt.save(i, bs.state)
            blocked = time.perf_counter() - t0
            r = h.wait()
            if migrated:
                r = h.wait_migrated()
            t_end = time.perf_counter() - t0
        out["blocked_all"].append(blocked)
        if i == 0:
            out["committed_first"] = r.timings["committed"]
        if i < warm:
            out["committed_warm"].append(r.timings["committed"])
            continue
        out["blocked"].append(blocked)
        out["staged"].append(r.timings["staged"])
        out["committed"].append(r.timings["committed"])
        out["timings"].append(dict(r.timings))
        if migrated:
            out["migrated"].append(t_end)
            # the migration starts when the version is committed (the migrator is idle:
            # every save here waits for the previous one's migration)
            out["migration"].append(t_end - r.timings["committed"])
        out["cpu"].append(cpu_seconds() - c0)
        out["rss"].append(mem.extra)
        out["bytes"].append(dict(r.bytes_written))
        for k, v in r.timings.items():
            if k.startswith("committed:"):
                out["tiers"].setdefault(k.split(":", 1)[1], []).append(v)
    return out


def tc_restores(
    ckpt: tiercheck.Checkpointer, bs: BenchState, repeats: int, tier: str
) -> dict[str, Any]:
    runs, sources = [], []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        info = ckpt.restore(bs.state, tiers=[tier])
        runs.append(time.perf_counter() - t0)
        sources.append(info.source)
    return {"runs": runs, "source": sources[-1]}


def one_tier(
    name: str, url: str, tp: tiercheck.TierPolicy, **options: Any
) -> tuple[list[TierSpec], tiercheck.Policy]:
    """A single-tier store where every save is a base written synchronously."""
    return [TierSpec(name, url, options)], tiercheck.Policy(
        base_every=1, gc_grace_seconds=0, tiers={name: tp}
    )


def summarize(xs: Mapping[str, list[float]]) -> dict[str, float]:
    return {k: median(v) for k, v in xs.items()}


def time_fn(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
