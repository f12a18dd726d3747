"""Multi-rank checkpoints with real processes: torchrun, gloo, CPU.

Each rank stands for a node: its shm and LMDB directories are its node's, so wiping them
is a node loss; the remote tier is shared by every rank; peer daemons are real
``tiercheck peer serve`` processes on loopback.

The scenarios whose ranks all live through their runs share one torchrun launch per phase
(``shared_runs``): one launch saves for all of them, and one restores for all of them, each
in its own store; each test checks its own scenario's events.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _dist
import pytest
from _once import once

WORKER = Path(__file__).parent / "dist_scripts" / "cluster_worker.py"
pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    shm = Path(f"/dev/shm/tiercheck-test-{uuid.uuid4().hex[:10]}")
    yield tmp_path, shm
    shutil.rmtree(shm, ignore_errors=True)


def torchrun(
    nproc: int, *args: str, env: dict[str, str] | None = None, timeout: float = 200
) -> tuple[int, list[dict[str, Any]]]:
    proc = _dist.torchrun(WORKER, *args, nproc=nproc, env=env, timeout=timeout)
    events = events_of(Path(args[args.index("--root") + 1]), args[0])
    if proc.returncode != 0 and not events:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
    return proc.returncode, events


def events_of(root: Path, phase: str) -> list[dict[str, Any]]:
    """Every rank's events of ``phase`` in the scenario at ``root`` (read once)."""
    events = []
    for path in sorted(root.glob(f"events-{phase}-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines()]
        path.unlink()
    return events


def common(root: Path, shm: Path) -> list[str]:
    return ["--root", str(root), "--shm-root", str(shm)]


def by(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def default_segment(root: Path) -> str:
    """The shm segment name, ``{rank}`` in it, of the default store under ``root``."""
    config = (root / "default" / "tiercheck.toml").read_text()
    segment = next(line for line in config.splitlines() if "shm://" in line)
    return segment.split("shm://", 1)[1].rstrip('"')


# scenario -> phase -> (torchrun's exit status, every rank's events); and "root" -> its root
Runs = dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return once(tmp_path_factory, "cluster", run_shared)


def run_shared(folder: Path) -> Runs:
    """The scenarios in which no rank dies, each in its own store and shm root: one launch
    saves for all of them, then (node 1 of the "peer-" scenarios replaced: its shared memory
    and local disk gone) one launch restores for all of them and for "killed", whose save
    killed rank 1 in the middle of step 4, in a launch of its own."""
    shm = Path(f"/dev/shm/tiercheck-test-{uuid.uuid4().hex[:10]}")
    token = uuid.uuid4().hex
    env = {"TIERCHECK_PEER_TOKEN": token}
    daemons = [start_daemon(token) for _ in range(4)]
    live = ",".join(str(port) for _, port in daemons[:2])
    dead = ",".join(str(port) for _, port in daemons[2:])
    for proc, _ in daemons[2:]:  # the dead peers die before the job runs its saves
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def where(name: str) -> list[str]:
        (folder / name).mkdir(exist_ok=True)
        return common(folder / name, shm / name)

    saves = {
        "failing-save": [
            *where("failing-save"),
            *("--steps", "3", "--fail-rank", "1", "--fail-step", "2"),
        ],
        "peer-tcp": [*where("peer-tcp"), "--steps", "5", "--peer-ports", live],
        "peer-collective": [*where("peer-collective"), "--steps", "5", "--collective"],
        "dead-peer": [*where("dead-peer"), "--steps", "4", "--peer-ports", dead],
        "default-store": [*where("default-store"), "--steps", "3", "--default-store"],
    }
    restores = {
        "killed": where("killed"),
        "peer-tcp": [*where("peer-tcp"), "--peer-ports", live],
        "peer-collective": [*where("peer-collective"), "--collective"],
        "dead-peer": [*where("dead-peer"), "--peer-ports", dead],
        "default-store": [*where("default-store"), "--default-store"],
    }
    runs: Runs = {name: {"root": str(folder / name)} for name in {**saves, **restores}}
    try:
        killed = [*where("killed"), "--steps", "5", "--kill-rank", "1", "--kill-step", "4"]
        runs["killed"]["save"] = torchrun(2, "save", *killed)
        together("save", saves, env, runs)
        for name in ("peer-tcp", "peer-collective"):
            shutil.rmtree(shm / name / "node1")
            shutil.rmtree(folder / name / "node1")
        together("restore", restores, env, runs)
        return runs
    finally:
        for proc, _ in daemons[:2]:
            proc.kill()
            proc.wait()
        shutil.rmtree(shm, ignore_errors=True)
        from tiercheck.backends import DEFAULT_SHM_ROOT

        if (folder / "default-store" / "default" / "tiercheck.toml").is_file():
            segment = default_segment(folder / "default-store")
            for r in (0, 1):
                shutil.rmtree(f"{DEFAULT_SHM_ROOT}/{segment.replace('{rank}', str(r))}", True)


def together(phase: str, scenarios: dict[str, list[str]], env: dict[str, str], runs: Runs) -> None:
    """One launch of 2 ranks running ``phase`` of each scenario (its arguments) in turn;
    its exit status and each scenario's events go to ``runs``."""
    args = [arg for a in scenarios.values() for arg in ("then", phase, *a)][1:]
    proc = _dist.torchrun(WORKER, *args, nproc=2, env=env)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
    for name in scenarios:
        runs[name][phase] = (proc.returncode, events_of(Path(runs[name]["root"]), phase))


@pytest.mark.slow
def test_rank_killed_mid_save_aborts_and_previous_restores(shared_runs: Runs) -> None:
    rc, events = shared_runs["killed"]["save"]
    assert rc != 0  # torchrun reports the dead rank
    acks = by(events, "ack")
    assert {(e["rank"], e["step"]) for e in acks} >= {(r, s) for r in (0, 1) for s in (1, 2, 3)}
    assert not [e for e in acks if e["step"] >= 4]  # version of step 4 committed nowhere
    rc, events = shared_runs["killed"]["restore"]
    assert rc == 0, events
    restored = by(events, "restored")
    assert len(restored) == 2
    for e in restored:
        assert e["step"] == 3 and e["exact"], e


@pytest.mark.slow
@pytest.mark.parametrize("point", ["exchange", "decide", "confirm"])
def test_a_rank_killed_at_each_protocol_step_aborts_the_version_on_every_rank(
    dirs: tuple[Path, Path], point: str
) -> None:
    """Rank 1 dies just before a step of the commit protocol of step 2. Rank 0 learns it
    from that step's collective (the dead rank's connection closes) and aborts at once:
    the group's timeout is 600 s and this run may take 90, so no abort here waits for it.
    Its next save fails at once too, saying why, instead of waiting on a dead group."""
    root, shm = dirs
    rc, events = torchrun(
        2,
        "save",
        *common(root, shm),
        "--steps",
        "3",
        "--kill-rank",
        "1",
        "--kill-step",
        "2",
        "--kill-at",
        point,
        timeout=90,
    )
    assert rc != 0  # torchrun reports the dead rank
    assert {(e["rank"], e["step"]) for e in by(events, "ack")} == {(0, 1), (1, 1)}
    seen = {e["step"]: e for e in events if e["rank"] == 0 and e["step"] > 1}
    if point == "confirm":  # both ranks had committed step 2 in their own tiers
        assert seen[2]["event"] == "short" and "could not confirm" in seen[2]["error"]
    else:
        assert seen[2]["event"] == "failed" and "aborted" in seen[2]["error"]
    assert seen[3]["event"] == "failed" and "failed:" in seen[3]["error"]  # the cause, at once


@pytest.mark.slow
def test_a_rank_that_fails_a_save_aborts_it_on_every_rank_and_the_next_commits(
    shared_runs: Runs,
) -> None:
    """Rank 1's staging fails in the save of step 2 (before the chunk exchange): it still
    takes part in the protocol, carrying its failure, so rank 0 aborts step 2 at once, and
    the ranks stay in step: step 3 commits on both."""
    rc, events = shared_runs["failing-save"]["save"]
    assert rc == 0, events
    assert sorted((e["rank"], e["step"]) for e in by(events, "ack")) == [
        (0, 1),
        (0, 3),
        (1, 1),
        (1, 3),
    ]
    failed = {e["rank"]: e["error"] for e in by(events, "failed")}
    assert failed.keys() == {0, 1} and all(e["step"] == 2 for e in by(events, "failed"))
    assert "rank 1: RuntimeError: injected staging failure" in failed[0]


def start_daemon(token: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiercheck.peer.daemon",
            "--listen",
            "127.0.0.1:0",
            "--memory-limit",
            "256MiB",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TIERCHECK_PEER_TOKEN": token},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("listening on"), line
    return proc, int(line.rsplit(":", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "collective"])
def test_replaced_node_restores_from_peer_and_remote(shared_runs: Runs, transport: str) -> None:
    rc, events = shared_runs[f"peer-{transport}"]["save"]
    assert rc == 0, events
    last = [e for e in by(events, "ack") if e["step"] == 5]
    assert len(last) == 2
    assert all(e["tiers"]["peer"] == "committed" for e in last)
    # (node 1 is replaced here: its shared memory and local disk are gone)
    rc, events = shared_runs[f"peer-{transport}"]["restore"]
    assert rc == 0, events
    restored = {e["rank"]: e for e in by(events, "restored")}
    assert restored[0]["step"] == restored[1]["step"] == 5
    assert all(e["exact"] for e in restored.values())
    assert restored[0]["source"] == "shm"
    assert restored[1]["source"] == "peer"
    assert set(restored[1]["chunks_from"]) <= {"peer", "remote"}


@pytest.mark.slow
def test_dead_peer_daemon_lowers_commit_level_and_restore_falls_back(shared_runs: Runs) -> None:
    # both peers died before the job ran its saves
    rc, events = shared_runs["dead-peer"]["save"]
    assert rc == 0, events
    acks = by(events, "short")  # committed, but the peer tier is required and failed
    assert len(acks) == 8
    assert all("required tier peer failed" in e["error"] for e in acks)
    assert all(e["tiers"]["shm"] == "committed" for e in acks)
    assert all(e["tiers"].get("peer") in (None, "failed", "unreachable") for e in acks)
    rc, events = shared_runs["dead-peer"]["restore"]
    assert rc == 0, events
    assert all(
        e["step"] == 4 and e["exact"] and e["source"] == "shm" for e in by(events, "restored")
    )


@pytest.mark.slow
def test_data_parallel_replicas_are_written_once_to_the_shared_tier(
    dirs: tuple[Path, Path],
) -> None:
    root, shm = dirs
    rc, events = torchrun(4, "save", *common(root, shm), "--steps", "1", "--remote-sync")
    assert rc == 0, events
    acks = by(events, "ack")
    assert len(acks) == 4
    to_remote = sum(e["bytes"]["remote"] for e in acks)
    logical = acks[0]["logical"]
    replica = 256 * 1024 * 4
    # one copy of the replica plus each rank's own small part, not four copies
    assert replica <= to_remote < replica + 4 * (logical - replica) + 64 * 1024
    assert all(e["tiers"]["remote"] == "committed" for e in acks)
    # every rank still wrote its whole shard to its own node's tiers
    assert all(e["bytes"]["shm"] >= logical for e in acks)
    # rank 0's sweeps of the shared tier (gc_grace_seconds=0) left another writer's blob
    # while that writer held its lease, and deleted it once the writer was gone
    (gc,) = by(events, "gc")
    assert "is writing to it" in gc["fenced"]
    assert [e["kept"] for e in by(events, "in-flight blob")] == [True] * 4
    assert [e["kept"] for e in by(events, "leftover blob")] == [False] * 4


@pytest.mark.slow
def test_the_default_store_under_torchrun_gives_each_rank_its_own_tiers(
    shared_runs: Runs,
) -> None:
    """Checkpointer(root) with no config, opened by 2 ranks at once: one config wins, each
    rank gets its own shm segment and LMDB, and a restart restores every rank bit-exactly."""
    rc, events = shared_runs["default-store"]["save"]
    root = Path(shared_runs["default-store"]["root"])
    config = (root / "default" / "tiercheck.toml").read_text()
    assert rc == 0, events
    assert default_segment(root).endswith("-{rank}") and 'lmdb-{rank}"' in config
    assert sorted(p.name for p in (root / "default").glob("lmdb-*")) == ["lmdb-0", "lmdb-1"]
    assert sorted(e["step"] for e in by(events, "ack")) == [1, 1, 2, 2, 3, 3]
    rc, events = shared_runs["default-store"]["restore"]
    assert rc == 0, events
    restored = by(events, "restored")
    assert [(e["step"], e["exact"], e["source"]) for e in restored] == [(3, True, "shm")] * 2
