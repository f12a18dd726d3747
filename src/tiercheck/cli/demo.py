"""Train, crash, recover, prove: ``python -m tiercheck.cli.demo``.

The demo trains a small GPT-style character model on the CPU (AdamW, warm-up + cosine
learning rate, dropout, a seeded data order) and checkpoints every step to the embedded
default tiers of a fresh store (host shared memory, LMDB, a ``file://`` "remote" tier), with
a base version at least every :data:`BASE_EVERY` versions; with the optimizer guarded, the
log planner writes a full version (a base, under dense training) whenever a log version
would cost more, so bases come more often: the demo prints the cadence it measured, over
every version it saved (retention drops log versions from the store's history). The
data-loader position and the RNG state are part of the checkpoint.

It runs three processes:

1. a *reference* run that trains ``--steps`` steps without checkpoints;
2. a *training* run that saves every step and reports each step as soon as its save is
   committed; when step ``--crash-at`` is committed the demo kills it with SIGKILL
   (whatever that process was doing at that moment: training, staging or writing the
   next version);
3. a *restarted* run on the same store that restores the newest restorable version from
   the fastest tier holding it, and continues to ``--steps``.

Both runs hash every tensor of the final model, optimizer and scheduler state (and the
loader position and RNG state). The demo exits 0 only if the restarted run's digests equal
the reference run's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import blake3
import torch
import torch.nn.functional as F
from torch import nn

import tiercheck
from tiercheck.cli.common import plain
from tiercheck.store.lifecycle import destroy_store, shm_root_left_as_found

__all__ = [
    "GPT",
    "CharLoader",
    "ModelConfig",
    "build_training",
    "main",
    "make_corpus",
    "state_digests",
    "train_step",
]

_TAG = "@tiercheck-demo "
_SEED = 1234
BASE_EVERY = 10
"""The policy's ``base_every``: the cadence the run has is measured (:func:`cadence`)."""

# --- the model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """A small decoder-only transformer over characters."""

    vocab: int = 64
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    ctx: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.triu(torch.ones(cfg.ctx, cfg.ctx, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_head)
        mask: torch.Tensor = self.mask  # type: ignore[assignment]
        att = att.masked_fill(mask[:t, :t], float("-inf"))
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        out: torch.Tensor = self.drop(self.proj(y))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` pre-norm blocks, a linear head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.ctx, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


# --- the data ----------------------------------------------------------------------------

_WORDS = {
    "det": ["the", "a", "every", "one", "that", "each"],
    "adj": ["small", "tired", "careful", "quick", "silent", "bright", "old", "restless"],
    "noun": ["node", "rank", "tier", "worker", "model", "shard", "chunk", "cluster", "disk"],
    "verb": ["saves", "restores", "hashes", "copies", "writes", "reads", "trusts", "waits for"],
    "adv": ["quietly", "twice", "again", "at once", "in order", "without fail"],
}


def make_corpus(seed: int = _SEED, chars: int = 120_000) -> str:
    """A deterministic text of simple generated sentences (no download needed)."""
    rng = random.Random(seed)
    parts: list[str] = []
    n = 0
    while n < chars:
        w = {k: rng.choice(v) for k, v in _WORDS.items()}
        obj = rng.choice(_WORDS["noun"])
        form = rng.randrange(3)
        if form == 0:
            s = f"{w['det']} {w['adj']} {w['noun']} {w['verb']} the {obj}."
        elif form == 1:
            s = f"{w['det']} {w['noun']} {w['verb']} {w['det']} {obj} {w['adv']}."
        else:
            s = f"when the {w['noun']} fails, {w['det']} {obj} {w['verb']} it {w['adv']}."
        s = s[0].upper() + s[1:] + ("\n" if rng.random() < 0.15 else " ")
        parts.append(s)
        n += len(s)
    return "".join(parts)


class CharLoader:
    """Batches of ``ctx``-character windows in a seeded order that changes every epoch.

    Its position (epoch, index) is all there is to save: the order of an epoch is a pure
    function of the seed and the epoch number.
    """

    def __init__(self, text: str, vocab: int, ctx: int, batch: int, seed: int) -> None:
        chars = sorted(set(text))
        if len(chars) > vocab:
            raise ValueError(f"corpus has {len(chars)} distinct characters, vocab is {vocab}")
        index = {ch: i for i, ch in enumerate(chars)}
        data = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        n = (len(data) - 1) // ctx
        self.x = data[: n * ctx].view(n, ctx)
        self.y = data[1 : n * ctx + 1].view(n, ctx)
        self.batch = batch
        self.seed = seed
        self.epoch = 0
        self.index = 0

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.x.shape[0], generator=g)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + self.batch > self.x.shape[0]:
            self.epoch += 1
            self.index = 0
        rows = self._order()[self.index : self.index + self.batch]
        self.index += self.batch
        return self.x[rows], self.y[rows]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])


@dataclass
class Training:
    """Everything a training run holds."""

    model: GPT
    optim: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    loader: CharLoader

    def state(self) -> dict[str, Any]:
        """The checkpointed state: model, optimizer, schedule, data position, RNGs."""
        return {
            "model": self.model,
            "optim": self.optim,
            "sched": self.sched,
            "loader": self.loader,
            "rng": tiercheck.rng_state(),
        }


def build_training(
    steps: int, *, cfg: ModelConfig | None = None, batch: int = 16, seed: int = _SEED
) -> Training:
    """A seeded model, AdamW with warm-up + cosine decay over ``steps``, and the loader."""
    cfg = cfg or ModelConfig()
    random.seed(seed)
    torch.manual_seed(seed)
    model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    loader = CharLoader(make_corpus(seed), cfg.vocab, cfg.ctx, batch, seed)
    return Training(model, optim, sched, loader)


def train_step(tr: Training) -> float:
    """One optimizer step; returns the loss."""
    x, y = tr.loader.next_batch()
    tr.model.train()
    logits = tr.model(x)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    tr.optim.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    tr.optim.step()
    tr.sched.step()
    return float(loss.item())


def state_digests(tr: Training) -> dict[str, str]:
    """BLAKE3 of every tensor (bytes, dtype, shape) and of the non-tensor state."""
    out: dict[str, str] = {}

    def tensor(key: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        h = blake3.blake3(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[key] = h.hexdigest()

    for k, v in tr.model.state_dict().items():
        tensor(f"model/{k}", v)
    osd = tr.optim.state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            tensor(f"optim/{pid}/{k}", v)
    out["optim/param_groups"] = blake3.blake3(
        json.dumps(osd["param_groups"], sort_keys=True).encode()
    ).hexdigest()
    other = {
        "sched": tr.sched.state_dict(),
        "loader": tr.loader.state_dict(),
        "rng_torch": torch.get_rng_state().tolist(),
        "rng_python": random.getstate()[1],
    }
    out["other"] = blake3.blake3(json.dumps(other, sort_keys=True).encode()).hexdigest()
    return out


def _deterministic() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


def _emit(lock: threading.Lock, event: str, **fields: Any) -> None:
    with lock:
        sys.stdout.write(_TAG + json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


# --- the worker processes ------------------------------------------------------------------


def _run_reference(steps: int) -> int:
    _deterministic()
    tr = build_training(steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(tr)
    lock = threading.Lock()
    _emit(lock, "final", digests=state_digests(tr), seconds=time.perf_counter() - t0)
    return 0


def _run_trainer(root: Path, steps: int) -> int:
    t_start = time.perf_counter()
    _deterministic()
    tr = build_training(steps)
    lock = threading.Lock()
    ckpt = tiercheck.Checkpointer(root, policy=tiercheck.Policy(base_every=BASE_EVERY))
    state = tr.state()
    ckpt.prepare(state)
    start = 0
    t_restore = time.time()
    # guarded before the restore: a log version replays into this optimizer
    unguard = ckpt.guard(tr.optim)
    info = ckpt.restore(state, missing_ok=True)  # None: an empty store, a first launch
    if info is None:
        _emit(lock, "fresh", params=sum(p.numel() for p in tr.model.parameters()))
    else:
        tiercheck.set_rng_state(state["rng"])
        start = info.step
        _emit(
            lock,
            "restored",
            version=info.version,
            step=info.step,
            role=info.role,
            source=info.source,
            chunks_from=dict(info.chunks_from),
            bytes_read=dict(info.bytes_read),
            restore_s=info.seconds,
            restore_started=t_restore,
            replayed_steps=info.replayed_steps,
        )
    acks: queue.Queue[tuple[tiercheck.SaveHandle, float, float] | None] = queue.Queue()

    def report() -> None:
        while (item := acks.get()) is not None:
            handle, loss, waited = item
            try:
                r = handle.wait()
            except tiercheck.errors.TiercheckError as exc:
                _emit(lock, "failed", step=handle.step, error=str(exc))
                continue
            _emit(
                lock,
                "committed",
                step=r.step,
                version=r.version,
                role=r.role,
                base=r.base,
                loss=loss,
                logical=r.logical_bytes,
                bytes_written=dict(r.bytes_written),
                tiers=dict(r.tiers),
                blocked_s=r.timings.get("blocked"),
                staged_s=r.timings.get("staged"),
                committed_s=r.timings.get("committed"),
                waited_s=waited,
            )

    reporter = threading.Thread(target=report, name="demo-acks", daemon=True)
    reporter.start()
    waited = 0.0
    for step in range(start + 1, steps + 1):
        # The guard makes optimizer.step() wait for the last save's staging; time it here.
        t0 = time.perf_counter()
        ckpt.wait_staged()
        waited = time.perf_counter() - t0
        loss = train_step(tr)
        handle = ckpt.save(step, tr.state(), metadata={"loss": round(loss, 4)})
        acks.put((handle, loss, waited))
    acks.put(None)
    reporter.join()
    unguard()
    ckpt.flush()
    ckpt.wait_migrations()
    ckpt.close()
    _emit(lock, "final", digests=state_digests(tr), seconds=time.perf_counter() - t_start)
    return 0


# --- the orchestrating parent --------------------------------------------------------------


def _spawn(args: Sequence[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "tiercheck.cli.demo", *args],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
    )


def _events(stream: IO[str]) -> Iterator[dict[str, Any]]:
    for line in stream:
        if line.startswith(_TAG):
            event: dict[str, Any] = json.loads(line[len(_TAG) :])
            yield event
        else:
            sys.stderr.write(line)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    if not ys:
        return float("nan")
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def saved_roles(committed: Sequence[Mapping[str, Any]], history: Sequence[Any]) -> list[str]:
    """The roles of every version a run saved, in order: those its save handles reported
    (``committed`` events), and those the history holds that were not reported (committed
    by the killed process after it was last heard). Retention drops log versions from the
    history, so the history alone would count too few of them."""
    roles = {v.id: v.role for v in history}
    roles.update((e["version"], e["role"]) for e in committed)
    return [roles[i] for i in sorted(roles)]


def cadence(roles: Sequence[str]) -> str:
    """The base cadence a run had, from the roles of its versions in order."""
    bases = sum(1 for r in roles if r == "base")
    if not bases:
        return f"Cadence: no base among {len(roles)} versions."
    return (
        f"Cadence: {bases} of {len(roles)} versions are bases, one every "
        f"{len(roles) / bases:.1f} (Policy.base_every={BASE_EVERY}; under dense training every "
        "full version is a base, and with the optimizer guarded the log planner writes a full "
        "version wherever a log version would cost more)."
    )


def _orchestrate(root: Path, steps: int, crash_at: int, console: Any) -> bool:
    from rich.table import Table

    t_demo = time.perf_counter()
    console.print(
        f"[bold]tiercheck demo[/bold]: a small GPT on the CPU, {steps} steps, a checkpoint "
        f"every step to the default tiers of [cyan]{plain(root)}[/cyan] (a base at least "
        f"every {BASE_EVERY} versions, sooner where the log planner finds a full version cheaper); "
        f"SIGKILL once step {crash_at} is committed."
    )
    reference = _spawn(["--worker", "reference", "--steps", str(steps)])
    committed: list[dict[str, Any]] = []

    first = _spawn(["--worker", "train", "--root", str(root), "--steps", str(steps)])
    assert first.stdout is not None
    t_kill: float | None = None
    for ev in _events(first.stdout):
        if ev["event"] == "fresh":
            console.print(f"\\[train] fresh start, {ev['params'] / 1e6:.2f} M parameters")
        elif ev["event"] == "committed":
            committed.append(ev)
            if ev["step"] % 10 == 0 or ev["step"] == crash_at:
                console.print(
                    f"\\[train] step {ev['step']:>4}  loss {ev['loss']:.3f}  committed "
                    f"v{ev['version']} ({ev['role']}) at "
                    f"{'+'.join(t for t, s in ev['tiers'].items() if s == 'committed')}"
                )
            if ev["step"] >= crash_at:
                first.send_signal(signal.SIGKILL)
                t_kill = time.time()
                break
        elif ev["event"] == "failed":
            console.print(f"[red]save of step {ev['step']} failed: {plain(ev['error'])}")
    first.stdout.close()
    rc = first.wait()
    if t_kill is None:
        console.print(f"[red]the training process ended (rc={rc}) before step {crash_at}")
        reference.kill()
        return False
    console.print(
        f"[bold red]SIGKILL[/bold red] sent to the training process (pid {first.pid}, "
        f"exit status {rc}) right after step {crash_at} was acknowledged"
    )

    second = _spawn(["--worker", "train", "--root", str(root), "--steps", str(steps)])
    assert second.stdout is not None
    restored: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    for ev in _events(second.stdout):
        if ev["event"] == "restored":
            restored = ev
            console.print(
                f"\\[restart] restored step {ev['step']} (version {ev['version']}, "
                f"{ev['role']}) from tier [bold green]{ev['source']}[/bold green] in "
                f"{_ms(ev['restore_s'])}; chunks from {ev['chunks_from']}"
            )
        elif ev["event"] == "committed":
            committed.append(ev)
            if ev["step"] % 10 == 0:
                console.print(
                    f"\\[restart] step {ev['step']:>4}  loss {ev['loss']:.3f}  committed "
                    f"v{ev['version']} ({ev['role']})"
                )
        elif ev["event"] == "failed":
            console.print(f"[red]save of step {ev['step']} failed: {plain(ev['error'])}")
        elif ev["event"] == "final":
            final = ev
    second.wait()
    assert reference.stdout is not None
    ref_final = next((e for e in _events(reference.stdout) if e["event"] == "final"), None)
    reference.wait()
    if restored is None or final is None or ref_final is None:
        console.print("[red]a worker process did not finish; see the errors above")
        return False

    # --- what a user wants to see --------------------------------------------------------
    ro = tiercheck.Checkpointer(root, read_only=True)
    try:
        history = ro.history()
        tier_names = [s.name for s in ro.config.tiers]
    finally:
        ro.close()
    table = Table(title="ckpt.history()  (MiB; a tier: committed ✔, dropped by retention)")
    for col in ("id", "step", "role", "base", "loss", "logical", "stored", *tier_names):
        table.add_column(col, justify="left" if col in ("role", *tier_names) else "right")
    mark = {
        "committed": "[green]✔",
        "dropped": "[dim]dropped",
        "missing": "[dim]·",
        "migrating": "[yellow]migrating",
    }
    keep = {v.id for v in history if v.role == "base"} | {v.id for v in history[-2:]}
    keep |= {restored["version"] + d for d in (-1, 0, 1)}
    keep |= {v.id for v in history if v.base is not None and v.id == v.base + 1}
    hidden = 0
    for v in history:
        if v.id not in keep:
            hidden += 1
            continue
        if hidden:
            table.add_row("⋮", "", f"[dim]{hidden} more", "", "", "", "", *("",) * len(tier_names))
            hidden = 0
        note = " ← restored" if v.id == restored["version"] else ""
        table.add_row(
            str(v.id),
            str(v.step),
            v.role + note,
            "-" if v.base is None else str(v.base),
            f"{v.metadata.get('loss', float('nan')):.3f}",
            f"{v.logical_bytes / (1 << 20):.1f}",
            f"{v.stored_bytes / (1 << 20):.1f}",
            *(mark.get(v.tiers[n], f"[red]{v.tiers[n]}") for n in tier_names),
        )
    console.print(table)
    console.print(cadence(saved_roles(committed, history)))

    saves = Table(title="Per save (both training processes)")
    for col in ("", "median", "max", "n"):
        saves.add_column(col, justify="right" if col else "left")
    for key, label in (
        ("blocked_s", "blocked in save()"),
        ("waited_s", "optimizer.step() waited for staging"),
        ("staged_s", "save() to staged"),
        ("committed_s", "save() to committed (sync tiers)"),
    ):
        xs = [float(e[key]) for e in committed if e.get(key) is not None]
        saves.add_row(label, _ms(_median(xs)), _ms(max(xs) if xs else None), str(len(xs)))
    console.print(saves)

    sizes = Table(title="Bytes written per version (median)")
    sync_tiers = [n for n in tier_names if any(n in e["bytes_written"] for e in committed)]
    for col in ("role", "logical", *sync_tiers, "versions"):
        sizes.add_column(col, justify="left" if col == "role" else "right")
    for role in ("base", "diff", "log"):
        rows = [e for e in committed if e["role"] == role]
        if not rows:
            continue
        per_tier = []
        for n in sync_tiers:
            xs = [float(e["bytes_written"][n]) for e in rows if n in e["bytes_written"]]
            per_tier.append(_mib(_median(xs)) if xs else "-")
        sizes.add_row(role, _mib(_median([e["logical"] for e in rows])), *per_tier, str(len(rows)))
    console.print(sizes)
    only_async = [
        float(v.stored_bytes)
        for v in history
        if v.role == "base"
        and len([s for s in v.tiers.values() if s == "committed"]) == 1
        and not any(n in sync_tiers for n, s in v.tiers.items() if s == "committed")
    ]
    migrated = f"{_mib(_median(only_async))} per base" if only_async else "not measured"
    console.print(
        "[dim]Dense training changes every chunk, so a diff version would cost a full copy in "
        "the raw shm tier; with the optimizer guarded, the versions between bases are log "
        "versions instead (the gradients of the steps since the base, replayed at restore); "
        "dedup pays for frozen weights and replicas (see docs/benchmarks.md). "
        f"Base versions also go to LMDB and are migrated to the remote tier in the "
        f"background (stored raw: the default remote is a local directory): {migrated}.[/dim]"
    )
    assert t_kill is not None
    startup = restored["restore_started"] - t_kill
    console.print(
        f"Recovery: SIGKILL -> state restored in a new process [bold]"
        f"{startup + restored['restore_s']:.2f} s[/bold]: starting Python, importing torch, "
        f"building the model and opening the store {startup:.2f} s, then "
        f"[bold]restore()[/bold] {_ms(restored['restore_s'])} from tier "
        f"[bold]{restored['source']}[/bold] (version {restored['version']}, step "
        f"{restored['step']}, {restored['role']}"
        + (
            f": its base, then {restored['replayed_steps']} optimizer "
            f"step{'' if restored['replayed_steps'] == 1 else 's'} replayed and verified"
            if restored.get("replayed_steps")
            else ""
        )
        + ")."
    )

    ref, got = ref_final["digests"], final["digests"]
    diff = sorted(k for k in set(ref) | set(got) if ref.get(k) != got.get(k))
    tensors = sum(1 for k in ref if k not in ("other", "optim/param_groups"))
    combined = blake3.blake3(json.dumps(got, sort_keys=True).encode()).hexdigest()[:16]
    elapsed = time.perf_counter() - t_demo
    if diff:
        console.print(
            f"[bold red]NOT bit-identical[/bold red]: {len(diff)} of {len(ref)} digests differ "
            f"(first: {diff[:5]})"
        )
        return False
    console.print(
        f"[bold green]PROOF: bit-identical[/bold green] — the crashed-and-restored run's final "
        f"weights, optimizer state, schedule, data position and RNG equal the uninterrupted "
        f"run's ({tensors} tensors, digest {combined}). Demo took {elapsed:.0f} s."
    )
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tiercheck.cli.demo",
        description="Train a small GPT, SIGKILL it, restore from the fastest tier, and "
        "prove the result is bit-identical to an uninterrupted run.",
    )
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--crash-at", type=int, default=None, help="kill after this step is committed")
    p.add_argument("--root", type=Path, default=None, help="store root (default: a fresh temp dir)")
    p.add_argument(
        "--keep", action="store_true", help="keep the store and its shm tier (else: deleted)"
    )
    p.add_argument("--worker", choices=("reference", "train"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "reference":
        return _run_reference(args.steps)
    if args.worker == "train":
        return _run_trainer(args.root, args.steps)

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 100)
    steps: int = args.steps
    crash_at: int = args.crash_at if args.crash_at is not None else (steps * 5) // 8
    if steps < 2 or not 1 <= crash_at < steps:
        p.error("need --steps >= 2 and 1 <= --crash-at < --steps")
    made_root = args.root is None
    root: Path = Path(tempfile.mkdtemp(prefix="tiercheck-demo-")) if made_root else args.root
    root = root.resolve()
    if (root / "tiercheck.toml").exists():
        p.error(f"{root} already holds a store; pass a new or empty --root")
    ok = False
    with shm_root_left_as_found():  # after the store's segments are gone
        try:
            ok = _orchestrate(root, steps, crash_at, console)
        finally:
            if not args.keep:
                if (root / "tiercheck.toml").exists():
                    destroy_store(root)  # the store and its shm segment: tiercheck rm
                if made_root:
                    shutil.rmtree(root, ignore_errors=True)
            else:
                console.print(f"store kept at {plain(root)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
