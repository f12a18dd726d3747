"""Multi-rank checkpoints with real processes: torchrun, gloo, CPU.

Each rank stands for a node: its shm and LMDB directories are its node's, so wiping them
is a node loss; the remote tier is shared by every rank; peer daemons are real
``tiercheck peer serve`` processes on loopback.
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
    root = Path(args[args.index("--root") + 1])
    events = []
    for path in sorted(root.glob(f"events-{args[0]}-*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines()]
        path.unlink()
    if proc.returncode != 0 and not events:
        print(proc.stdout[-4000:], proc.stderr[-4000:])
    return proc.returncode, events


def common(root: Path, shm: Path) -> list[str]:
    return ["--root", str(root), "--shm-root", str(shm)]


def by(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


@pytest.mark.slow
def test_rank_killed_mid_save_aborts_and_previous_restores(dirs: tuple[Path, Path]) -> None:
    root, shm = dirs
    rc, events = torchrun(
        2, "save", *common(root, shm), "--steps", "5", "--kill-rank", "1", "--kill-step", "4"
    )
    assert rc != 0  # torchrun reports the dead rank
    acks = by(events, "ack")
    assert {(e["rank"], e["step"]) for e in acks} >= {(r, s) for r in (0, 1) for s in (1, 2, 3)}
    assert not [e for e in acks if e["step"] >= 4]  # version of step 4 committed nowhere
    rc, events = torchrun(2, "restore", *common(root, shm))
    assert rc == 0, events
    restored = by(events, "restored")
    assert len(restored) == 2
    for e in restored:
        assert e["step"] == 3 and e["exact"], e


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


def test_a_rank_that_fails_a_save_aborts_it_on_every_rank_and_the_next_commits(
    dirs: tuple[Path, Path],
) -> None:
    """Rank 1's staging fails in the save of step 2 (before the chunk exchange): it still
    takes part in the protocol, carrying its failure, so rank 0 aborts step 2 at once, and
    the ranks stay in step: step 3 commits on both."""
    root, shm = dirs
    rc, events = torchrun(
        2, "save", *common(root, shm), "--steps", "3", "--fail-rank", "1", "--fail-step", "2"
    )
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
def test_replaced_node_restores_from_peer_and_remote(
    dirs: tuple[Path, Path], transport: str
) -> None:
    root, shm = dirs
    token = uuid.uuid4().hex
    daemons = [start_daemon(token) for _ in range(2)] if transport == "tcp" else []
    ports = ",".join(str(p) for _, p in daemons)
    peer = ["--peer-ports", ports] if transport == "tcp" else ["--collective"]
    env = {"TIERCHECK_PEER_TOKEN": token}
    try:
        rc, events = torchrun(2, "save", *common(root, shm), "--steps", "5", *peer, env=env)
        assert rc == 0, events
        last = [e for e in by(events, "ack") if e["step"] == 5]
        assert len(last) == 2
        assert all(e["tiers"]["peer"] == "committed" for e in last)
        # node 1 is replaced: its shared memory and local disk are gone
        shutil.rmtree(shm / "node1")
        shutil.rmtree(root / "node1")
        rc, events = torchrun(2, "restore", *common(root, shm), *peer, env=env)
        assert rc == 0, events
        restored = {e["rank"]: e for e in by(events, "restored")}
        assert restored[0]["step"] == restored[1]["step"] == 5
        assert all(e["exact"] for e in restored.values())
        assert restored[0]["source"] == "shm"
        assert restored[1]["source"] == "peer"
        assert set(restored[1]["chunks_from"]) <= {"peer", "remote"}
    finally:
        for proc, _ in daemons:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_dead_peer_daemon_lowers_commit_level_and_restore_falls_back(
    dirs: tuple[Path, Path],
) -> None:
    root, shm = dirs
    token = uuid.uuid4().hex
    daemons = [start_daemon(token) for _ in range(2)]
    ports = ",".join(str(p) for _, p in daemons)
    env = {"TIERCHECK_PEER_TOKEN": token}
    for proc, _ in daemons:  # both peers die before the job runs its saves
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rc, events = torchrun(
        2, "save", *common(root, shm), "--steps", "4", "--peer-ports", ports, env=env
    )
    assert rc == 0, events
    acks = by(events, "short")  # committed, but the peer tier is required and failed
    assert len(acks) == 8
    assert all("required tier peer failed" in e["error"] for e in acks)
    assert all(e["tiers"]["shm"] == "committed" for e in acks)
    assert all(e["tiers"].get("peer") in (None, "failed", "unreachable") for e in acks)
    rc, events = torchrun(2, "restore", *common(root, shm), "--peer-ports", ports, env=env)
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
    dirs: tuple[Path, Path],
) -> None:
    """Checkpointer(root) with no config, opened by 2 ranks at once: one config wins, each
    rank gets its own shm segment and LMDB, and a restart restores every rank bit-exactly."""
    root, shm = dirs
    rc, events = torchrun(2, "save", *common(root, shm), "--steps", "3", "--default-store")
    config = (root / "default" / "tiercheck.toml").read_text()
    segment = next(line for line in config.splitlines() if "shm://" in line)
    segment = segment.split("shm://", 1)[1].rstrip('"')
    try:
        assert rc == 0, events
        assert segment.endswith("-{rank}") and 'lmdb-{rank}"' in config
        assert sorted(p.name for p in (root / "default").glob("lmdb-*")) == ["lmdb-0", "lmdb-1"]
        assert sorted(e["step"] for e in by(events, "ack")) == [1, 1, 2, 2, 3, 3]
        rc, events = torchrun(2, "restore", *common(root, shm), "--default-store")
        assert rc == 0, events
        restored = by(events, "restored")
        assert [(e["step"], e["exact"], e["source"]) for e in restored] == [(3, True, "shm")] * 2
    finally:
        from tiercheck.backends import DEFAULT_SHM_ROOT

        for r in (0, 1):
            shutil.rmtree(f"{DEFAULT_SHM_ROOT}/{segment.replace('{rank}', str(r))}", True)
