"""Crash harness: a trainer saving every step is SIGKILLed at chosen points; a fresh process
then restores and checks that nothing acknowledged was lost or is silently wrong.

Run by ``tests/test_crash_engine.py``; also usable by hand::

    python tests/crash_harness.py run --root /tmp/x --seed 1 --iterations 500

``run`` is a *zygote*: it imports torch and tiercheck once, opens nothing and starts no
thread, then for each iteration forks

1. a **trainer**: opens the store (shm + LMDB + a ``file://`` remote tier, all under
   ``--root``; base every 3 versions; GC grace 0; the LMDB tier's codec is zstd, or
   ``TIERCHECK_CRASH_LMDB_CODEC``), restores the newest version (step ``s``),
   then saves steps ``s+1, s+2, ...`` and writes ``ACK step`` to a pipe after each
   ``handle.wait()`` returns. It dies by SIGKILL either at a named **kill point** (it kills
   itself the Nth time a code point is reached: staging, hashing, manifest building,
   placement, a tier's put/get/append/delete before or after the call, commit, retention,
   GC, migration), or from the zygote after a random number of acknowledgements
   (plus a random extra wait for the trainer's next output, so the kill lands anywhere);
2. a **verifier**: a fresh process that opens ``Checkpointer(root)``, restores the newest
   version and checks that its step is at least the last acknowledged one, that its
   contents are bit-identical to :func:`state_at` of that step, and that every blob of every
   version each tier holds decodes and hashes to its id (:func:`check_store`).

Kill points and counts come from ``random.Random(seed)``. The summary is one JSON line on
stdout; the exit status is 1 if any check failed. ``trainer`` and ``verify`` sub-commands
run one trainer / one verifier directly (without fork), for the test that kills from pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import blake3
import torch

import tiercheck.maintenance as maintenance_mod
import tiercheck.migrating as migrating_mod
import tiercheck.saving as saving_mod
import tiercheck.tierset as tierset_mod
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.base import Tier
from tiercheck.errors import FormatVersionError, NoRestorableVersion
from tiercheck.faults import FaultEvent, FaultPlan, FaultyTier
from tiercheck.fetch import ChunkFetcher
from tiercheck.pipeline import ShardStream
from tiercheck.staging import StagingBuffer

CHUNK = 4096
TIERS = ("shm", "lmdb", "remote")
FUNCTION_POINTS = (
    "stage",
    "hash",
    "manifest",
    "place",
    "commit",
    "retention",
    "gc",
    "migrate",
)
TIER_OPS = ("put", "append", "delete", "get")
# The LMDB tier's codec (CI runs one zygote on zstd, one on delta). With "delta" a crashed
# save can leave a delta blob that no prepare record describes, which a later version
# reuses: GC keeps its base by reading the blob's header (retention.py; this lost data
# about once per 200 lives until it did).
LMDB_CODEC = cast(
    Literal["raw", "zstd", "delta"], os.environ.get("TIERCHECK_CRASH_LMDB_CODEC", "zstd")
)


# --- the trainer's state: a pure function of the step ------------------------------------


def state_at(step: int) -> dict[str, Any]:
    """The state the trainer saves at ``step`` (tiny; some chunks change every step)."""
    g = torch.Generator().manual_seed(step)
    w = torch.arange(4096, dtype=torch.float32) / 7
    lo = (step % 4) * 1024
    w[lo : lo + 64] += step  # one 4 KiB chunk of w changes per step
    return {
        "model": {
            "frozen": torch.linspace(0, 1, 2048),  # never changes: deduplicated
            "w": w,
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "step": step,
            "lr": 0.1 / (1 + step),
            "m": torch.randn(100, generator=g).to(torch.float16),
            "mask": torch.rand(17, generator=g) > 0.5,
        },
        "rng": blake3.blake3(step.to_bytes(8, "little")).digest(length=16),
        "name": f"step-{step}",
        "big": 2**65 + step,
    }


def bit_mismatch(got: Any, want: Any, key: str = "") -> str | None:
    """The first path where ``got`` differs from ``want`` (type, dtype, shape or bits)."""
    if type(got) is not type(want):
        return f"{key}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{key}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        if want.numel() == 0:
            return None

        def raw(t: torch.Tensor) -> torch.Tensor:
            # a fresh dense copy: contiguous() keeps the odd stride of a 1-element view,
            # which view(uint8) refuses
            return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)

        return None if torch.equal(raw(got), raw(want)) else f"{key}: tensor bits differ"
    if isinstance(want, dict):
        assert isinstance(got, dict)
        if list(got) != list(want):
            return f"{key}: keys {list(got)} != {list(want)}"
        for k in want:
            bad = bit_mismatch(got[k], want[k], f"{key}/{k}")
            if bad:
                return bad
        return None
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple))
        if len(got) != len(want):
            return f"{key}: length {len(got)} != {len(want)}"
        for i, (x, y) in enumerate(zip(got, want)):
            bad = bit_mismatch(x, y, f"{key}/{i}")
            if bad:
                return bad
        return None
    return None if got == want else f"{key}: {got!r} != {want!r}"


# --- the store ------------------------------------------------------------------------------


def store_specs(root: Path) -> list[TierSpec]:
    return [
        TierSpec("shm", "shm://crash", {"root": str(root / "shm")}),
        TierSpec("lmdb", f"lmdb://{root / 'lmdb'}"),
        TierSpec("remote", f"file://{root / 'remote'}", {"survives": "cluster", "shared": True}),
    ]


def store_policy() -> Policy:
    return Policy(
        base_every=3,
        chunk_size=CHUNK,
        gc_grace_seconds=0,
        hash_threads=1,
        tiers={
            "shm": TierPolicy(versions="all", codec="raw", keep_bases=1),
            "lmdb": TierPolicy(versions="all", codec=LMDB_CODEC, keep_bases=2, keep_diffs=2),
            "remote": TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=3),
        },
    )


def check_store(ckpt: Checkpointer) -> list[str]:
    """Problems with any blob of any version any tier holds (re-hashed from that tier)."""
    problems: list[str] = []
    catalog = ckpt.refresh()
    for slot in ckpt.tierset.open():
        tl = catalog.logs.get(slot.name)
        if tl is None:
            problems.append(f"{slot.name}: log unreadable ({catalog.unreachable})")
            continue
        fetcher = ChunkFetcher([slot], repair=False)  # this tier only, delta bases included
        for vid in tl.held():
            for mid in tl.committed[vid].shards:
                try:
                    manifest = fetcher.manifest(mid)
                    for ref in manifest.chunks:
                        fetcher.fetch(ref.id)
                except Exception as exc:
                    problems.append(f"{slot.name}: version {vid}: {type(exc).__name__}: {exc}")
    try:
        from tiercheck.history import verify
    except ImportError:  # verify lands with the history module
        return problems
    try:
        report = verify(ckpt)
    except FormatVersionError as exc:  # verify refuses a store with a newer-format blob
        return [*problems, f"verify: {exc}"]
    problems += [f"verify: {p.tier} {p.kind} {p.id} {p.detail}" for p in report.problems]
    return problems


# --- kill points ----------------------------------------------------------------------------


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wrap_function(module: Any, name: str, nth: int, after: bool) -> None:
    original = getattr(module, name)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth and not after:
            _die()
        out = original(*args, **kwargs)
        if calls[0] == nth and after:
            _die()
        return out

    setattr(module, name, wrapper)


def install_kill_point(point: str, nth: int) -> None:
    """Make this process SIGKILL itself the ``nth`` time ``point`` is reached.

    ``point`` is a function point (``stage``, ``hash``, ...), optionally suffixed ``:after``,
    or ``OP:TIER:before|after`` for a tier operation.
    """
    parts = point.split(":")
    if parts[0] in FUNCTION_POINTS:
        after = parts[1:] == ["after"]
        target: tuple[Any, str] = {
            "stage": (StagingBuffer, "stage"),
            # hashing hands each window to the tiers' writers: a kill here (or at a put)
            # lands in the middle of a streamed save
            "hash": (ShardStream, "hash"),
            "manifest": (saving_mod, "build_manifest"),
            "place": (saving_mod, "place_shard"),
            "commit": (saving_mod, "commit_on"),
            "retention": (maintenance_mod, "drop_versions"),
            "gc": (maintenance_mod, "collect_garbage"),
            "migrate": (migrating_mod, "migrate_shard"),
        }[parts[0]]
        _wrap_function(target[0], target[1], nth, after)
        return
    op, tier_name, when = parts
    original_open = tierset_mod.open_tier

    def open_with_hook(url: str, **options: Any) -> Tier:
        inner = original_open(url, **options)
        if not url.startswith("shm://" if tier_name == "shm" else f"{tier_name_scheme}://"):
            return inner
        plan = FaultPlan()

        def hook(event: FaultEvent) -> None:
            _die()

        plan.hook(hook, op, nth=nth, count=1, after=when == "after")  # type: ignore[arg-type,unused-ignore]
        return FaultyTier(inner, plan)

    tier_name_scheme = {"shm": "shm", "lmdb": "lmdb", "remote": "file"}[tier_name]
    tierset_mod.open_tier = open_with_hook  # type: ignore[assignment,unused-ignore]


def choose_kill(rng: random.Random, steps: int) -> tuple[str, int]:
    """A kill point and the call count at which it fires."""
    if rng.random() < 0.4:
        name = rng.choice(FUNCTION_POINTS)
        point = name + (":after" if rng.random() < 0.3 else "")
        per_step = {"gc": 3, "retention": 2, "commit": 2, "migrate": 1}.get(name, 1)
        return point, rng.randint(1, max(1, per_step * steps))
    op = rng.choice(TIER_OPS)
    tier = rng.choice(TIERS)
    when = rng.choice(("before", "after"))
    per_step = {"put": 3, "append": 3, "delete": 2, "get": 3}[op]
    return f"{op}:{tier}:{when}", rng.randint(1, per_step * steps)


# --- the two processes ---------------------------------------------------------------------


def check_restore(ckpt: Checkpointer, last_ack: int) -> dict[str, Any]:
    """Restore the newest version and check it against the last acknowledged step, then
    check every blob of the store."""
    errors: list[str] = []
    try:
        info = ckpt.restore(None)
    except NoRestorableVersion as exc:
        if last_ack >= 0:
            errors.append(f"nothing restorable after step {last_ack} was acknowledged: {exc}")
        return {"step": -1, "errors": errors}
    if info.step < last_ack:
        errors.append(f"restored step {info.step} < last acknowledged step {last_ack}")
    bad = bit_mismatch(info.state, state_at(info.step))
    if bad:
        errors.append(f"restored step {info.step} differs from what was saved: {bad}")
    errors += check_store(ckpt)
    return {"step": info.step, "version": info.version, "errors": errors}


def trainer(
    root: Path,
    steps: int,
    ack: Callable[[int], None],
    last_ack: int = -1,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Restore the newest version (checking it, when ``report`` is given: this process is
    the fresh process the check needs), then save ``steps`` more, acknowledging each."""
    torch.set_num_threads(1)
    ckpt = Checkpointer(root, tiers=store_specs(root), policy=store_policy(), threads=2)
    result = check_restore(ckpt, last_ack)
    if report is not None:
        report(result)
    step = result["step"] + 1
    for s in range(step, step + steps):
        ckpt.save(s, state_at(s), metadata={"step": s}).wait()
        ack(s)
    ckpt.close()


def verifier(root: Path, last_ack: int) -> dict[str, Any]:
    """Restore in this (fresh) process and check it against the last acknowledged step."""
    torch.set_num_threads(1)
    with Checkpointer(root, threads=2) as ckpt:
        return check_restore(ckpt, last_ack)


# --- the zygote -------------------------------------------------------------------------------


def _fork(body: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running ``body(write_fd)``; return ``(pid, read_fd)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        status = 0
        try:
            body(w)
        except BaseException:
            os.write(w, ("ERROR " + traceback.format_exc().replace("\n", "\\n") + "\n").encode())
            status = 3
        finally:
            os._exit(status)
    os.close(w)
    return pid, r


def _read(fd: int, timeout: float | None) -> tuple[str, bool]:
    """Text available on ``fd`` within ``timeout``; ``eof`` once the writer is gone."""
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return "", False
    data = os.read(fd, 1 << 16)
    return data.decode(), not data


class _Output:
    """What a trainer wrote to its pipe so far (``ACK``, ``CHECK``, ``DONE``, ``ERROR``)."""

    def __init__(self, last_ack: int) -> None:
        self.last_ack = last_ack
        self.acks = 0
        self.done = False
        self.last = ""
        self.check: dict[str, Any] | None = None
        self.errors: list[str] = []
        self._partial = ""

    def feed(self, text: str) -> None:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self.last = line
            if line.startswith("ACK "):
                self.last_ack = max(self.last_ack, int(line.split()[1]))
                self.acks += 1
            elif line.startswith("CHECK "):
                self.check = json.loads(line[6:])
            elif line == "DONE":
                self.done = True
            elif line.startswith("ERROR"):
                self.errors.append(line.replace("\\n", "\n"))


def _write(fd: int, text: str) -> None:
    data = text.encode()
    while data:
        data = data[os.write(fd, data) :]


def warm_up(scratch: Path) -> None:
    """One save and restore in this process, so that every child starts with imports done,
    lazy initialisation over and the allocator warm (halves a child's run time). Every
    thread it starts is joined by ``close``; the forks that follow are safe."""
    torch.set_num_threads(1)
    trainer(scratch, 2, lambda s: None)
    verifier(scratch, 1)


def run(root: Path, seed: int, iterations: int, steps: int) -> dict[str, Any]:
    """``iterations`` trainer lives, each killed at a point chosen by ``seed``; each life
    starts by restoring and checking what the previous one left (see the module doc)."""
    rng = random.Random(seed)
    warm_up(root.with_name(root.name + "-warm"))
    last_ack = -1
    kills: Counter[str] = Counter()
    reached = checked = acks = 0
    failures: list[dict[str, Any]] = []
    previous = "none"
    t0 = time.monotonic()
    for it in range(iterations + 1):
        final = it == iterations  # one more life that only restores and checks
        mode_ack = rng.random() < 0.35
        point, nth = ("ack", rng.randint(0, steps)) if mode_ack else choose_kill(rng, steps)

        def train(
            w: int,
            point: str = point,
            nth: int = nth,
            ack_mode: bool = mode_ack,
            ack: int = last_ack,
            final: bool = final,
        ) -> None:
            if final:
                _write(w, "CHECK " + json.dumps(verifier(root, ack)) + "\n")
                return
            if not ack_mode:
                install_kill_point(point, nth)
            trainer(
                root,
                steps,
                lambda s: _write(w, f"ACK {s}\n"),
                ack,
                lambda result: _write(w, "CHECK " + json.dumps(result) + "\n"),
            )
            _write(w, "DONE\n")

        t_it = time.monotonic()
        pid, fd = _fork(train)
        seen = _Output(last_ack)
        killed_by_us = False
        while True:
            text, eof = _read(fd, None)
            seen.feed(text)
            if mode_ack and not final and seen.acks >= nth and not killed_by_us and not eof:
                # let the trainer run on for a random while, so the kill lands anywhere
                text, eof = _read(fd, rng.uniform(0, 0.02))
                seen.feed(text)
                os.kill(pid, signal.SIGKILL)
                killed_by_us = True
            if eof:
                break
        os.close(fd)
        _, status = os.waitpid(pid, 0)
        errors = seen.errors
        if seen.check is not None:
            checked += 1
            errors += seen.check["errors"]
        last_ack = seen.last_ack
        acks += seen.acks
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        if sig == signal.SIGKILL and not final:
            reached += 1
            kills["ack" if mode_ack else point.split(":")[0]] += 1
        elif not (seen.done or final) or errors:
            errors.append(f"trainer exited with status {status} (last line {seen.last!r})")
        if final and seen.check is None:
            errors.append("the final check did not finish")
        if os.environ.get("CRASH_DEBUG"):
            print(f"{it} {point}#{nth} {time.monotonic() - t_it:.3f}s", file=sys.stderr)
        if errors:
            failures.append(
                {
                    "iteration": it,
                    "previous_kill": previous,
                    "kill": f"{point}#{nth}",
                    "last_ack": last_ack,
                    "restored": seen.check and seen.check.get("step"),
                    "errors": errors,
                }
            )
            break
        previous = f"{point}#{nth}" if sig == signal.SIGKILL else "none (ran to the end)"
    return {
        "seed": seed,
        "lmdb_codec": LMDB_CODEC,
        "iterations": min(it, iterations),
        "kills": reached,
        "kills_by_point": dict(sorted(kills.items())),
        "checked": checked,
        "acks": acks,
        "last_ack": last_ack,
        "seconds": round(time.monotonic() - t0, 1),
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", type=Path, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--iterations", type=int, default=100)
    r.add_argument("--steps", type=int, default=5)
    t = sub.add_parser("trainer")
    t.add_argument("--root", type=Path, required=True)
    t.add_argument("--steps", type=int, default=1000)
    v = sub.add_parser("verify")
    v.add_argument("--root", type=Path, required=True)
    v.add_argument("--last-ack", type=int, required=True)
    args = p.parse_args(argv)
    if args.cmd == "run":
        summary = run(args.root, args.seed, args.iterations, args.steps)
        print(json.dumps(summary), flush=True)
        return 1 if summary["failures"] else 0
    if args.cmd == "trainer":
        trainer(args.root, args.steps, lambda s: print(f"ACK {s}", flush=True))
        print("DONE", flush=True)
        return 0
    result = verifier(args.root, args.last_ack)
    print(json.dumps(result), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
