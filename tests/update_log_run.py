"""A small training run for the update-log tests, run by the test and again in a new process.

It has what makes exact resume hard: AdamW in fp32 with an LR schedule, gradient clipping,
a ``torch.amp.GradScaler`` on CPU, dropout (so the RNG matters) and a step the scaler
skips. ``write_log`` stores a log version the way SPEC.md section 12 lays it out (a shard
manifest with its ``log`` key and the stream it describes); the engine does not write log
versions yet, so the small leaves go to a file of their own next to it.

    python tests/update_log_run.py resume STORE LOGDIR OUT

restores the base version from the store at STORE in a new process, replays the log in
LOGDIR, trains ``AFTER`` more steps and writes digests of the whole state to OUT (JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import blake3
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import TinyGPT

import tiercheck
from tiercheck.core.entries import torch_dtype
from tiercheck.formats import chunk_id
from tiercheck.formats.manifest import (
    ChunkRef,
    ShardManifest,
    pack_manifest,
    unpack_manifest,
)
from tiercheck.logversions.replay import replay
from tiercheck.logversions.update_log import LoggedSteps, plan_log

BASE_STEP = 2  # the full version is saved after this step
LOG_STEPS = 4  # then these steps are logged; the second is skipped by the scaler
SKIP_AT = BASE_STEP + 2
AFTER = 3  # steps trained after resuming
CHUNK = 4096


class Run:
    """Model, AdamW, a schedule, a GradScaler, the data order and the RNG."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = TinyGPT()
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False
        )
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=5e-3, total_steps=50)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        self.data = torch.Generator().manual_seed(seed + 1)
        self.corpus = torch.randint(0, 32, (4096,), generator=torch.Generator().manual_seed(7))
        self.loader = {"position": 0}
        self.steps = 0

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optim": self.opt,
            "sched": self.sched,
            "scaler": self.scaler,
            "loader": self.loader,
            "data_rng": self.data.get_state(),
            "rng": tiercheck.rng_state(),
        }

    def leaves(self) -> dict[str, Any]:
        """What a log version stores in full: everything the replay does not reproduce."""
        return {
            "sched": self.sched.state_dict(),
            "scaler": self.scaler.state_dict(),
            "loader": dict(self.loader),
            "data_rng": self.data.get_state(),
            "rng": tiercheck.rng_state(),
            "steps": self.steps,
        }

    def load_leaves(self, leaves: dict[str, Any]) -> None:
        self.sched.load_state_dict(leaves["sched"])
        self.scaler.load_state_dict(leaves["scaler"])
        self.loader = dict(leaves["loader"])
        self.data.set_state(leaves["data_rng"])
        tiercheck.set_rng_state(leaves["rng"])
        self.steps = leaves["steps"]

    def step(self) -> None:
        self.steps += 1
        idx = torch.randint(0, len(self.corpus) - 17, (4,), generator=self.data)
        batch = torch.stack([self.corpus[i : i + 17] for i in idx.tolist()])
        self.loader["position"] += 4
        self.opt.zero_grad()
        logits = self.model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), batch[:, 1:].reshape(-1))
        self.scaler.scale(loss).backward()
        if self.steps == SKIP_AT:  # an overflow: the scaler must skip this step
            next(self.model.parameters()).grad.view(-1)[0] = float("inf")
        self.scaler.unscale_(self.opt)
        nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()

    def digests(self) -> dict[str, str]:
        """BLAKE3 of every tensor of the model and optimizer, and of the other state."""
        out: dict[str, str] = {}
        for k, v in self.model.state_dict().items():
            out[f"model/{k}"] = _digest(v)
        sd = self.opt.state_dict()
        for pid, st in sd["state"].items():
            for k, v in st.items():
                out[f"optim/{pid}/{k}"] = _digest(v)
        out["param_groups"] = repr(sd["param_groups"])
        out["sched"] = repr(self.sched.state_dict())
        out["scaler"] = repr(self.scaler.state_dict())
        out["loader"] = repr(self.loader)
        return out


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return f"{t.dtype}{list(t.shape)}:" + blake3.blake3(raw.numpy().data).hexdigest()


def write_log(logged: LoggedSteps, leaves: dict[str, Any], out: Path) -> None:
    """The log version's shard manifest and stream (SPEC.md section 12), and the leaves."""
    layout = plan_log(logged, CHUNK)
    stream = bytearray(layout.end)
    for offset, data in layout.segments:
        stream[offset : offset + len(data)] = data
    chunks = tuple(ChunkRef(chunk_id(bytes(stream[o : o + n])), o, n) for o, n in layout.windows)
    manifest = ShardManifest(
        version=2,
        rank=0,
        world_size=1,
        chunk_size=CHUNK,
        stream_bytes=layout.end,
        entries=layout.entries,
        chunks=chunks,
        tree=None,
        log=layout.replay,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.msgpack").write_bytes(pack_manifest(manifest))
    (out / "stream.bin").write_bytes(bytes(stream))
    torch.save(leaves, out / "leaves.pt")


def read_log(logdir: Path) -> tuple[ShardManifest, bytes]:
    manifest = unpack_manifest((logdir / "manifest.msgpack").read_bytes())
    stream = (logdir / "stream.bin").read_bytes()
    for c in manifest.chunks:
        assert chunk_id(stream[c.offset : c.offset + c.length]) == c.id, "stream damaged"
    return manifest, stream


def gradients(manifest: ShardManifest, stream: bytes) -> Any:
    def gradient(i: int) -> torch.Tensor:
        e = manifest.entries[i]
        raw = torch.frombuffer(bytearray(stream[e.offset : e.offset + e.nbytes]), dtype=torch.uint8)
        return raw.view(torch_dtype(e.dtype)).reshape(e.shape)

    return gradient


def open_store(path: Path) -> tiercheck.Checkpointer:
    return tiercheck.Checkpointer(path, tiers=[f"file://{path / 'tier'}"])


def resume(store: Path, logdir: Path, out: Path) -> None:
    run = Run(seed=99)  # a different init: everything must come from the checkpoint
    state = run.state()
    with open_store(store) as ckpt:
        ckpt.restore(state, step=BASE_STEP)
    manifest, stream = read_log(logdir)
    assert manifest.log is not None
    report = replay(run.opt, manifest.log, gradients(manifest, stream), scaler=run.scaler)
    run.load_leaves(torch.load(logdir / "leaves.pt", weights_only=False))
    for _ in range(AFTER):
        run.step()
    result = {"digests": run.digests(), "steps": report.steps, "skipped": report.skipped}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] != ["resume"] or len(sys.argv) != 5:
        sys.exit(__doc__)
    resume(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
