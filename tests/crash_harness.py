"""Crash harness: a trainer on the default store, saving every step, is SIGKILLed at chosen
points and at random moments; a fresh process then restores and checks that nothing
acknowledged was lost or is silently wrong.

Run by ``tests/test_crash_engine.py``; also usable by hand::

    python tests/crash_harness.py run --root /dev/shm/x --mode dense --seed 1 --iterations 500

**The store is the one users run**: ``Checkpointer(root)`` with no tiers and no policy, so
the embedded default (shm in /dev/shm under a segment name drawn for this store, LMDB and a
``file://`` remote tier under ``--root``), default retention, GC grace, base cadence and the
default memory budgets. Nothing is wrapped around a tier. At the end of a run the store is
destroyed (its shm segment, LMDB and root).

``run`` is a *zygote*: it imports torch and tiercheck once and warms up on a scratch store,
then for each iteration forks a **life** (one process, or two ranks of a gloo job with
``--mode dist``). A life builds a fresh model and AdamW optimizer, opens the store, restores
the newest version into them and checks it (below), then trains ``--steps`` steps, each
writing ``SAVE step digest`` to a pipe before ``ckpt.save(step, state).wait()`` and ``ACK
step`` after it; after every fourth ack it also restores in its own process (a trainer
rolling back to its last version: read where the saving process holds it, in ``staged``
from shm's staging ranges) and writes ``ROLLBACK step restored exact``: the step just
acknowledged, bit for bit, or the run fails, killed or not. Modes:

- ``dense``: every step changes every tensor (AdamW), a full save every step: the shm
  tier's default budget (two versions) makes room every other save;
- ``guarded``: the same, with ``ckpt.guard(optimizer)``: saves become log versions, and a
  restore replays logged steps into the fresh optimizer;
- ``staged``: ``dense`` with ``Policy(stage_in_shm="on")``: the default store, its saves
  staged straight into shm's segment files, which become the blobs (the default does so
  for states of 64 MiB or more; this model is 7 MiB);
- ``dist``: two ranks (``torch.distributed`` with gloo over loopback, the environment
  torchrun sets: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each saving
  its own shard; one rank is killed, and the other with it, as torchrun's agent does.

A life dies by SIGKILL in one of three ways (seeded by ``--seed``):

- a **kill point**: it kills itself the Nth time an engine function is reached, before or
  after it runs (:data:`POINTS`: staging, hashing, manifest, placement, commit, every log
  append, retention's drop, make-room and the drop it makes, GC, between GC's claim and its
  delete, log compaction, migration and its commit, restore). Kill points trace engine
  functions (the function is replaced by one that counts and then calls it); no tier is
  wrapped;
- **at random**: the zygote kills it after a random delay (up to the mean length of a
  life), counted from its start (the kill may land in the restore) or from its check
  (in its saves);
- **after an ack**: the zygote kills it a random while after its Nth acknowledgement.

**The check** (in the next life, a fresh process, before it trains): the restored step is
at least the last step every rank acknowledged; the restored model and optimizer are bit
for bit what was saved at that step (the digest its ``SAVE`` line carried; training is a
pure function of the step, so a step trained twice must give the same digest too); every
blob of every version each tier holds decodes and hashes to its id (:func:`check_store`).

The summary is one JSON line on stdout: kills (by point), acks, checks, exact restores
(the last acknowledged step, bit for bit), newer restores (a step saved but not yet
acknowledged), rollbacks (restores in the saving process), lost acks (a restore older
than the last ack) and the failures (the run stops at the first); the exit status is 1 if
any check failed. ``trainer`` and ``verify`` run one life and one check directly (without
fork), for the test that kills from pytest.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import faulthandler
import json
import os
import random
import select
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
from torch import nn

import tiercheck.engine.saving as saving_mod
import tiercheck.restore.loading as restore_mod
import tiercheck.restore.service as restoring_mod
import tiercheck.store.catalog as manifest_log_mod
import tiercheck.upkeep.migration as migrating_mod
import tiercheck.upkeep.retention as retention_mod
from tiercheck import Checkpointer, Policy
from tiercheck.engine.placing import ShardStream
from tiercheck.engine.staging import StagingBuffer
from tiercheck.errors import FormatVersionError, NoRestorableVersion
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.leases import GCFence
from tiercheck.store.lifecycle import destroy_store, shm_root_left_as_found
from tiercheck.upkeep.maintenance import Maintenance

MODES = ("dense", "guarded", "dist", "staged")
LIFE_TIMEOUT = float(os.environ.get("TIERCHECK_CRASH_LIFE_TIMEOUT", "60"))
WIDTH = 384  # two Linear(384, 384*2) layers: ~590k parameters, ~7 MiB with AdamW's state
ROLLBACK_EVERY = 4  # a life restores in its own process after every 4th step's ack


# --- the trainer: training is a pure function of the step ---------------------------------


class Run:
    """A model and its AdamW optimizer; :meth:`step` trains step ``s`` on data drawn from
    ``s`` alone, so a run restored bit for bit at ``s`` goes on as the killed one did."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.seed = seed
        self.model = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH)
        )
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False
        )

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def step(self, s: int) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + s)
        x = torch.randn(16, WIDTH, generator=g)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def digest(self) -> str:
        """BLAKE3 of every bit of the model's and the optimizer's state."""
        h = blake3.blake3()

        def add(key: str, value: Any) -> None:
            h.update(key.encode() + b"\0")
            if isinstance(value, torch.Tensor):
                t = torch.empty(value.shape, dtype=value.dtype).copy_(value)
                h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())

        for k, v in self.model.state_dict().items():
            add(f"model/{k}", v)
        sd = self.opt.state_dict()
        for pid in sorted(sd["state"]):
            for k, v in sorted(sd["state"][pid].items()):
                add(f"optim/{pid}/{k}", v)
        add("optim/param_groups", sd["param_groups"])
        return h.hexdigest()


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


def check_store(ckpt: Checkpointer) -> list[str]:
    """Problems with any blob of any version any tier holds (re-hashed from that tier).

    With several ranks, a tier of this rank's own (not shared) holds this rank's shard of
    each version only, and ``history.verify`` (which reads every shard from every tier) is
    left out: each rank checks its own shards and those in the shared tiers."""
    problems: list[str] = []
    catalog = ckpt.refresh()
    ranks = ckpt.world_size
    for slot in ckpt.tierset.open():
        tl = catalog.logs.get(slot.name)
        if tl is None:
            problems.append(f"{slot.name}: log unreadable ({catalog.unreachable})")
            continue
        own = ranks > 1 and slot.tier is not None and not slot.tier.capabilities.shared
        fetcher = ChunkFetcher([slot], repair=False)  # this tier only, delta bases included
        for vid in tl.held():
            shards = tl.committed[vid].shards
            for mid in shards[ckpt.rank : ckpt.rank + 1] if own else shards:
                try:
                    manifest = fetcher.manifest(mid)
                    for ref in manifest.chunks:
                        fetcher.fetch(ref.id)
                except Exception as exc:
                    problems.append(f"{slot.name}: version {vid}: {type(exc).__name__}: {exc}")
    if ranks > 1:
        return problems
    from tiercheck.history.verify import verify

    try:
        report = verify(ckpt)
    except FormatVersionError as exc:  # verify refuses a store with a newer-format blob
        return [*problems, f"verify: {exc}"]
    problems += [f"verify: {p.tier} {p.kind} {p.id} {p.detail}" for p in report.problems]
    return problems


# --- kill points: engine functions traced ---------------------------------------------------


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _replace_everywhere(original: Callable[..., Any], traced: Callable[..., Any]) -> None:
    """Put ``traced`` wherever a tiercheck module holds ``original`` (``from x import f``
    copies the name into each importer)."""
    for mod in list(sys.modules.values()):
        if mod is None or not mod.__name__.startswith("tiercheck"):
            continue
        for name, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, name, traced)


@dataclass
class KillPoint:
    """Die the ``nth`` time ``point`` is reached, ``before`` or after it runs."""

    point: str
    nth: int
    before: bool
    hits: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hit(self, before: bool) -> None:
        if before != self.before:
            return
        with self._lock:
            self.hits += 1
            if self.hits == self.nth:
                _die()

    def traced(self, original: Callable[..., Any], when: Callable[[], bool] | None = None) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            counts = when is None or when()
            if counts:
                self.hit(True)
            out = original(*args, **kwargs)
            if counts:
                self.hit(False)
            return out

        return traced

    def install(self) -> None:
        """Trace the engine function(s) of :attr:`point` in this process."""
        target = POINTS[self.point]
        if self.point == "make_room_drop":  # retention's drop, while make-room runs
            inside = threading.local()
            make_room = Maintenance._make_room

            def flagged(*args: Any, **kwargs: Any) -> Any:
                inside.on = True
                try:
                    return make_room(*args, **kwargs)
                finally:
                    inside.on = False

            Maintenance._make_room = flagged  # type: ignore[method-assign,unused-ignore]
            drop = retention_mod.drop_versions
            _replace_everywhere(drop, self.traced(drop, lambda: getattr(inside, "on", False)))
        elif isinstance(target, tuple):
            owner, name = target
            setattr(owner, name, self.traced(getattr(owner, name)))
        elif self.point == "migrate_commit":  # the commit record a migration appends
            migrating_mod.append_record = self.traced(migrating_mod.append_record)
        else:
            _replace_everywhere(target, self.traced(target))


#: Kill points: an engine method (class, name) or function (traced in every importer).
POINTS: dict[str, tuple[type, str] | Callable[..., Any]] = {
    "stage": (StagingBuffer, "stage"),
    "hash": (ShardStream, "hash"),  # windows go to the tiers' writers as they are hashed
    "manifest": saving_mod.build_manifest,
    "place": saving_mod.place_shard,
    "commit": saving_mod.commit_on,
    "append": manifest_log_mod.append_record,  # every log record: prepare, commit, drop, ...
    "retention": retention_mod.drop_versions,
    "make_room": (Maintenance, "_make_room"),
    "make_room_drop": retention_mod.drop_versions,
    "gc": retention_mod.collect_garbage,
    "gc_claim": (GCFence, "claim"),  # after it: claimed, not deleted yet
    "compact": manifest_log_mod.compact_log,
    "migrate": migrating_mod.migrate_shard,
    "migrate_commit": manifest_log_mod.append_record,
    "restore": (restoring_mod.RestoreService, "_read_shard"),
    "restore_load": restore_mod.load_stream,
}
#: About how often a point is reached per saved step (measured on a dense life of four
#: steps), so that the Nth hit is likely to come in a life; 0: once per life (restore).
PER_STEP = {
    "append": 4,
    "commit": 1.25,
    "place": 1.25,
    "gc": 3,
    "gc_claim": 3,
    "make_room_drop": 0.75,
    "retention": 0.75,
    "migrate": 0.25,
    "migrate_commit": 0.25,
    "compact": 0.05,
    "restore": 0,
    "restore_load": 0,
}


def choose_kill(rng: random.Random, steps: int) -> KillPoint:
    point = rng.choice(sorted(POINTS))
    nth = rng.randint(1, max(1, round(PER_STEP.get(point, 1) * steps)))
    return KillPoint(point, nth, before=rng.random() < 0.5)


# --- a life ------------------------------------------------------------------------------------


def _write(fd: int, text: str) -> None:
    data = text.encode()
    while data:
        data = data[os.write(fd, data) :]


def check_restore(
    ckpt: Checkpointer, run: Run, digests: dict[int, str], last_ack: int
) -> dict[str, Any]:
    """Restore the newest version into ``run`` and check it against the last acknowledged
    step and the digest saved for its step, then check every blob of the store."""
    errors: list[str] = []
    try:
        info = ckpt.restore(run.state())
    except NoRestorableVersion as exc:
        if last_ack >= 0:
            errors.append(f"nothing restorable after step {last_ack} was acknowledged: {exc}")
        return {"step": -1, "errors": errors, "exact": last_ack < 0}
    if info.step < last_ack:
        errors.append(
            f"lost ack: restored step {info.step} (version {info.version}, {info.role}) "
            f"< last acknowledged step {last_ack}"
        )
    want = digests.get(info.step)
    got = run.digest()
    if want is None:
        errors.append(f"restored step {info.step}, which no life saved")
    elif got != want:
        errors.append(f"restored step {info.step} ({info.role}) differs from what was saved")
    errors += check_store(ckpt)
    return {
        "step": info.step,
        "version": info.version,
        "role": info.role,
        "exact": not errors and info.step == last_ack,
        "newer": not errors and info.step > last_ack,
        "errors": errors,
    }


def life(
    root: Path,
    mode: str,
    seed: int,
    steps: int,
    out: Callable[[str], None],
    *,
    digests: dict[int, str] | None = None,
    last_ack: int = -1,
    kill: KillPoint | None = None,
) -> None:
    """Open the default store at ``root``, restore (and check, given ``digests``), then
    train and save ``steps`` steps, reporting each on ``out`` (module docstring)."""
    torch.set_num_threads(1)
    if kill is not None:
        kill.install()
    run = Run(seed)
    ckpt = Checkpointer(root, policy=Policy(stage_in_shm="on") if mode == "staged" else None)
    if mode == "guarded":
        ckpt.guard(run.opt)
    if digests is not None:
        result = check_restore(ckpt, run, digests, last_ack)
        out("CHECK " + json.dumps(result) + "\n")
        start = result["step"] + 1
    else:
        try:
            start = ckpt.restore(run.state()).step + 1
        except NoRestorableVersion:
            start = 0
    ckpt.prepare(run.state())  # as a trainer that prepares: a kill may land in its preallocation
    for s in range(start, start + steps):
        run.step(s)
        digest = run.digest()
        out(f"SAVE {s} {digest}\n")
        ckpt.save(s, run.state()).wait()
        out(f"ACK {s}\n")
        if s % ROLLBACK_EVERY == ROLLBACK_EVERY - 1:
            info = ckpt.restore(run.state())  # in this process: where it saved, read back
            out(f"ROLLBACK {s} {info.step} {int(run.digest() == digest)}\n")
    ckpt.close()
    out("DONE\n")


def _rank_env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )


# --- the zygote ----------------------------------------------------------------------------------


@dataclass
class _Output:
    """What one rank of a life wrote to its pipe so far."""

    last_ack: int
    acks: int = 0
    done: bool = False
    last: str = ""
    check: dict[str, Any] | None = None
    saves: list[tuple[int, str]] = field(default_factory=list)
    rollbacks: int = 0
    bad_rollbacks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    partial: str = ""
    # a read may end inside a character (an error message's emoji)
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )

    def feed(self, text: str) -> None:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.last = line
            if line.startswith("ACK "):
                self.last_ack = max(self.last_ack, int(line.split()[1]))
                self.acks += 1
            elif line.startswith("SAVE "):
                _, step, digest = line.split()
                self.saves.append((int(step), digest))
            elif line.startswith("CHECK "):
                self.check = json.loads(line[6:])
            elif line.startswith("ROLLBACK "):
                _, step, restored, exact = line.split()
                self.rollbacks += 1
                if restored != step or exact != "1":
                    self.bad_rollbacks.append(
                        f"a restore in the saving process after the ack of step {step} "
                        f"restored step {restored}, {'exact' if exact == '1' else 'not exact'}"
                    )
            elif line == "DONE":
                self.done = True
            elif line.startswith("ERROR"):
                self.errors.append(line.replace("\\n", "\n"))
            else:  # a hung life's stacks (faulthandler)
                self.other.append(line)


def _fork(body: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running ``body(write_fd)``; return ``(pid, read_fd)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        status = 0
        # a hung life writes every thread's stack to the pipe and exits: the run reports it
        faulthandler.dump_traceback_later(LIFE_TIMEOUT, exit=True, file=os.fdopen(w, "w"))
        try:
            body(w)
        except BaseException:
            _write(w, "ERROR " + traceback.format_exc().replace("\n", "\\n") + "\n")
            status = 3
        finally:
            os._exit(status)
    os.close(w)
    return pid, r


def warm_up(scratch: Path) -> None:
    """One life on a scratch store in this process, so that every child starts with imports
    done and lazy initialisation over; every thread it starts is joined by ``close``, so
    the forks that follow are safe. The scratch store is destroyed."""
    with shm_root_left_as_found():
        try:
            # dense, never guarded: a guarded save hashes fingerprints with BLAKE3's thread
            # pool (Rayon), which a forked child would inherit without its threads and
            # deadlock on
            life(scratch, "dense", 0, 2, lambda _: None)
            life(scratch, "dense", 0, 1, lambda _: None)
        finally:
            destroy_store(scratch)


@dataclass
class Ledger:
    """What the zygote knows across lives: per rank, the digest saved at each step and the
    last acknowledged step."""

    ranks: int
    digests: list[dict[int, str]]
    acked: list[int]

    @classmethod
    def empty(cls, ranks: int) -> Ledger:
        return cls(ranks, [{} for _ in range(ranks)], [-1] * ranks)

    @property
    def last_ack(self) -> int:
        """The last step every rank acknowledged."""
        return min(self.acked)


def run_life(
    root: Path,
    mode: str,
    seed: int,
    steps: int,
    ledger: Ledger,
    kill: tuple[str, int, float, KillPoint | None],
) -> tuple[list[_Output], list[int]]:
    """Fork one life (one process per rank), kill it as ``kill`` says (``(how, rank,
    value, point)``: ``point``, ``random`` after ``value`` seconds, ``random_save``
    ``value`` seconds after its check, ``ack`` after ``value`` acks, or ``none``), and
    return what each rank wrote and its wait status."""
    how, victim, value, point = kill
    world = ledger.ranks
    # the ranks meet through a file, not a port: a port picked free can be taken before
    # rank 0 listens on it (EADDRINUSE under a loaded test run)
    rdzv = root.parent / f"rdzv-{os.getpid()}-{time.monotonic_ns()}"
    pids, fds = [], []
    for rank in range(world):

        def body(w: int, rank: int = rank) -> None:
            if world > 1:
                _rank_env(rank, world)
                dist.init_process_group(
                    "gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world
                )
            life(
                root,
                mode,
                seed * 10 + rank,
                steps,
                lambda text: _write(w, text),
                digests=ledger.digests[rank],
                last_ack=ledger.last_ack,
                kill=point if how == "point" and rank == victim else None,
            )
            if world > 1:
                dist.destroy_process_group()

        pid, fd = _fork(body)
        pids.append(pid)
        fds.append(fd)
    outs = [_Output(ledger.last_ack) for _ in range(world)]
    statuses: list[int | None] = [None] * world
    open_fds = dict(zip(fds, range(world)))
    try:
        _watch(pids, open_fds, outs, statuses, how, victim, value, seed)
    finally:
        for rank, pid in enumerate(pids):  # never left behind, whatever happened here
            if statuses[rank] is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                _, statuses[rank] = os.waitpid(pid, 0)
        for fd in open_fds:
            os.close(fd)
        rdzv.unlink(missing_ok=True)
    return outs, [s or 0 for s in statuses]


def _watch(
    pids: list[int],
    open_fds: dict[int, int],
    outs: list[_Output],
    statuses: list[int | None],
    how: str,
    victim: int,
    value: float,
    seed: int,
) -> None:
    """Read the ranks' pipes until every rank is gone, killing as ``how`` says."""
    deadline = time.monotonic() + value if how == "random" else None
    killed = False
    armed = how != "random_save"  # random_save: counted from the victim's check on

    def kill_all() -> None:
        nonlocal killed
        killed = True
        for rank, pid in enumerate(pids):
            if statuses[rank] is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    while open_fds:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(list(open_fds), [], [], timeout)
        if not ready and deadline is not None and not killed:
            deadline = None
            if statuses[victim] is None:  # not already gone by itself
                os.kill(pids[victim], signal.SIGKILL)  # the others follow once it is reaped
        for fd in ready:
            rank = open_fds[fd]
            data = os.read(fd, 1 << 16)
            if not data:
                del open_fds[fd]
                os.close(fd)
                _, statuses[rank] = os.waitpid(pids[rank], 0)
                if os.WIFSIGNALED(statuses[rank] or 0) and not killed:
                    kill_all()  # one rank died: the job dies, as torchrun's agent makes it
                continue
            outs[rank].feed(outs[rank].decoder.decode(data))
            if not armed and rank == victim and outs[rank].check is not None:
                armed = True
                deadline = time.monotonic() + value
            if how == "ack" and rank == victim and outs[rank].acks >= value and not killed:
                # let it run on for a random while, so that the kill lands anywhere
                time.sleep(random.Random(seed + outs[rank].acks).uniform(0, 0.02))
                kill_all()


def run(
    root: Path,
    mode: str,
    seed: int,
    iterations: int,
    steps: int,
    *,
    keep: bool = False,
    keep_going: bool = False,
) -> dict[str, Any]:
    """``iterations`` lives, each killed as ``seed`` chooses; each life starts by restoring
    and checking what the previous one left (module docstring). The store is destroyed at
    the end."""
    rng = random.Random(seed)
    ranks = 2 if mode == "dist" else 1
    warm_up(root.with_name(root.name + "-warm"))
    ledger = Ledger.empty(ranks)
    kills: Counter[str] = Counter()
    summary: dict[str, Any] = {"mode": mode, "seed": seed, "steps_per_life": steps}
    reached = checked = acks = exact = newer = lost_acks = rollbacks = 0
    failures: list[dict[str, Any]] = []
    mean_life = 1.0
    previous = "none"
    t0 = time.monotonic()
    it = 0
    with shm_root_left_as_found():
        try:
            for it in range(iterations + 1):
                final = it == iterations  # one more life that only restores and checks
                victim = rng.randrange(ranks)
                r = rng.random()
                point = None
                if final:
                    how, value = "none", 0.0
                elif r < 0.45:
                    point = choose_kill(rng, steps)
                    how, value = "point", 0.0
                elif r < 0.6:
                    how, value = "random", rng.uniform(0, mean_life)
                elif r < 0.8:  # a random moment of its saves, after the check
                    how, value = "random_save", rng.uniform(0, mean_life)
                else:
                    how, value = "ack", float(rng.randint(1, steps))
                t_life = time.monotonic()
                outs, statuses = run_life(
                    root, mode, seed, 0 if final else steps, ledger, (how, victim, value, point)
                )
                mean_life = 0.8 * mean_life + 0.2 * (time.monotonic() - t_life)
                errors: list[str] = []
                checks = [o.check for o in outs]
                sigkilled = any(
                    os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in statuses
                )
                for rank, out in enumerate(outs):
                    # a rank whose peer was killed fails its collective (CommitAborted)
                    # before it is killed too: expected, as under torchrun
                    if not sigkilled:
                        errors += out.errors
                    errors += out.bad_rollbacks  # a kill does not excuse a wrong restore
                    rollbacks += out.rollbacks
                    for step, digest in out.saves:
                        known = ledger.digests[rank].setdefault(step, digest)
                        if known != digest:
                            errors.append(
                                f"rank {rank} trained step {step} to other bits after a "
                                "restore: the restore was not exact"
                            )
                    ledger.acked[rank] = max(ledger.acked[rank], out.last_ack)
                    acks += out.acks
                if all(c is not None for c in checks):
                    checked += 1
                    steps_back = {c["step"] for c in checks if c is not None}
                    if len(steps_back) > 1:
                        errors.append(f"the ranks restored different steps: {steps_back}")
                    for c in checks:
                        assert c is not None
                        errors += c["errors"]
                    lost_acks += any(
                        "lost ack" in e for c in checks if c is not None for e in c["errors"]
                    )
                    exact += all(c is not None and c["exact"] for c in checks)
                    newer += all(c is not None and c.get("newer", False) for c in checks)
                if sigkilled and not final:
                    reached += 1
                    kills[point.point if point is not None else how] += 1
                elif not (all(o.done for o in outs) or final) or any(
                    not os.WIFSIGNALED(s) and os.WEXITSTATUS(s) for s in statuses
                ):
                    errors += [e for o in outs for e in o.errors if e not in errors]
                    errors.append(
                        f"life ended with statuses {statuses} "
                        f"(last lines {[o.last for o in outs]!r})"
                        + "".join("\n" + line for o in outs for line in o.other[-60:])
                    )
                if final and not all(c is not None for c in checks):
                    errors.append("the final check did not finish")
                kill_name = (
                    f"{point.point}#{point.nth}{'' if point.before else ':after'}"
                    if (point is not None)
                    else f"{how}({value:.3g})"
                )
                if os.environ.get("CRASH_DEBUG"):
                    print(
                        f"{it} {kill_name} {time.monotonic() - t_life:.3f}s "
                        f"ack={ledger.last_ack} restored={[c and c['step'] for c in checks]}",
                        file=sys.stderr,
                    )
                if errors:
                    failures.append(
                        {
                            "iteration": it,
                            "kills_before": reached - int(sigkilled and not final),
                            "previous_kill": previous,
                            "kill": kill_name,
                            "last_ack": ledger.last_ack,
                            "restored": [c and c.get("step") for c in checks],
                            "errors": errors[:20],
                        }
                    )
                    if not keep_going:
                        break
                    # what was lost is lost: later lives are checked against what remains
                    back = [c["step"] for c in checks if c is not None]
                    if len(back) == ranks and len(set(back)) == 1:
                        ledger.acked = [back[0]] * ranks
                previous = kill_name if sigkilled else "none (ran to the end)"
        finally:
            if not (keep and failures):
                with contextlib.suppress(FileNotFoundError):
                    destroy_store(root)
    summary.update(
        iterations=min(it, iterations),
        kills=reached,
        kills_by_point=dict(sorted(kills.items())),
        checked=checked,
        acks=acks,
        exact_restores=exact,
        newer_restores=newer,
        rollbacks=rollbacks,
        lost_acks=lost_acks,
        last_ack=ledger.last_ack,
        seconds=round(time.monotonic() - t0, 1),
        first_failure_after_kills=failures[0]["kills_before"] if failures else None,
        failed_checks=len(failures),
        failures=failures[:20],
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", type=Path, required=True)
    r.add_argument("--mode", choices=MODES, default="dense")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--iterations", type=int, default=100)
    r.add_argument("--steps", type=int, default=4)
    r.add_argument("--keep", action="store_true", help="keep the store of a failed run")
    r.add_argument(
        "--keep-going", action="store_true", help="go on after a failed check (to count them)"
    )
    t = sub.add_parser("trainer")
    t.add_argument("--root", type=Path, required=True)
    t.add_argument("--steps", type=int, default=1000)
    v = sub.add_parser("verify")
    v.add_argument("--root", type=Path, required=True)
    v.add_argument("--last-ack", type=int, required=True)
    v.add_argument("--digests", type=Path, required=True, help="JSON: step -> digest")
    args = p.parse_args(argv)
    if args.cmd == "run":
        summary = run(
            args.root,
            args.mode,
            args.seed,
            args.iterations,
            args.steps,
            keep=args.keep,
            keep_going=args.keep_going,
        )
        print(json.dumps(summary), flush=True)
        return 1 if summary["failures"] else 0
    if args.cmd == "trainer":
        life(args.root, "dense", 0, args.steps, lambda text: print(text, end="", flush=True))
        return 0
    digests = {int(k): v for k, v in json.loads(args.digests.read_text()).items()}
    result: dict[str, Any] = {}

    def report(text: str) -> None:
        if text.startswith("CHECK "):
            result.update(json.loads(text[6:]))

    life(args.root, "dense", 0, 0, report, digests=digests, last_ack=args.last_ack)
    print(json.dumps(result), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
