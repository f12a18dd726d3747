"""Two nodes on one machine: two concurrent ``torchrun --nnodes 2 --node-rank 0|1`` launches
with a static rendezvous on 127.0.0.1, gloo, CPU.

Each launch is a node: ``GROUP_RANK`` differs, node-local tiers sit under that node's
directories (``{node}`` in the tier URLs), so wiping node 1's directories loses its shm and
LMDB for real. Node 1 must then restore from its partner on node 0 (``collective://``, the
default partner map) and the shared remote tier, bit-exactly. Losing node 0 loses the store
file that rank 0 writes too; the store must still be the same store afterwards. The two
scenarios with one rank per node share their launches (each in its own directories).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _dist import free_port, launch
from _once import once

WORKER = Path(__file__).parent / "dist_scripts" / "node_worker.py"
pytestmark = pytest.mark.timeout(120)
STEPS = 5


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    shm = Path(f"/dev/shm/tiercheck-nodes-{uuid.uuid4().hex[:10]}")
    yield tmp_path, shm
    shutil.rmtree(shm, ignore_errors=True)


def two_nodes(nproc: int, phase: str, scenarios: list[tuple[Path, Path]]) -> list[list[Any]]:
    """Run both nodes' torchrun launches concurrently, each running ``phase`` of every
    scenario (its root and shm root) in turn; return each scenario's events (every rank's)."""
    port = str(free_port())
    args: list[str] = []
    for root, shm in scenarios:
        args += ["then", phase, "--root", str(root), "--shm-root", str(shm)]
        args += ["--steps", str(STEPS)]
    launches = [
        launch(
            WORKER,
            *args[1:],
            nproc=nproc,
            rendezvous=[
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ],
        )
        for node in (0, 1)
    ]
    results = []
    try:
        for run in launches:
            results.append(run.wait(timeout=90))
    finally:
        for run in launches:
            run.kill()
    events = []
    for root, _ in scenarios:
        events.append([])
        for path in sorted(root.glob(f"events-{phase}-*.jsonl")):
            events[-1] += [json.loads(line) for line in path.read_text().splitlines()]
            path.unlink()
    codes = [r.returncode for r in results]
    assert codes == [0, 0], "\n".join((r.stdout + r.stderr)[-3000:] for r in results)
    return events


def lose_nodes(nproc: int, root: Path, shm: Path, lost: dict[str, int]) -> dict[str, Any]:
    """For each scenario (its name, the node it loses), in ``root/NAME`` and ``shm/NAME``:
    both nodes save; the lost node's shm and local directories are deleted (whether they
    were there first is noted, and whether node 0's store file was); both nodes restore.
    Returns each scenario's events of both phases and what was noted."""
    where = [(root / name, shm / name) for name in lost]
    for scenario_root, _ in where:
        scenario_root.mkdir()
    saved = two_nodes(nproc, "save", where)
    runs: dict[str, Any] = {}
    for (name, node), (scenario_root, scenario_shm), events in zip(lost.items(), where, saved):
        lost_dirs = [scenario_shm / f"node{node}", scenario_root / f"node{node}"]
        runs[name] = {
            "save": events,
            "lost dirs": [d.is_dir() for d in lost_dirs],
            "store file": (scenario_root / "node0" / "store" / "tiercheck.toml").is_file(),
        }
        for d in lost_dirs:
            shutil.rmtree(d)
    for name, events in zip(lost, two_nodes(nproc, "restore", where)):
        runs[name]["restore"] = events
    return runs


@pytest.fixture(scope="module")
def one_rank_per_node(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenarios with one rank per node, sharing their launches: node 1 lost, node 0
    lost."""

    def make(folder: Path) -> dict[str, Any]:
        shm = Path(f"/dev/shm/tiercheck-nodes-{uuid.uuid4().hex[:10]}")
        try:
            return lose_nodes(1, folder, shm, {"node1-lost": 1, "node0-lost": 0})
        finally:
            shutil.rmtree(shm, ignore_errors=True)

    return once(tmp_path_factory, "cluster-nodes", make)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_node_lost_restores_from_partner_on_other_node_and_remote(
    request: pytest.FixtureRequest, dirs: tuple[Path, Path], nproc: int
) -> None:
    if nproc == 1:
        run = request.getfixturevalue("one_rank_per_node")["node1-lost"]
    else:
        run = lose_nodes(nproc, *dirs, {"node1-lost": 1})["node1-lost"]
    world = 2 * nproc
    events = run["save"]
    acks = [e for e in events if e["event"] == "ack"]
    assert len(acks) == world * STEPS
    for e in acks:
        # the node is torchrun's GROUP_RANK, and the partner lives on the other node
        assert e["node"] == e["group_rank"] == e["rank"] // nproc
        assert e["local_rank"] == e["rank"] % nproc
        assert e["partner"] == (e["rank"] + nproc) % world
        assert e["partner"] // nproc != e["node"]
    assert {(e["rank"], e["step"]) for e in acks} == {
        (r, s) for r in range(world) for s in range(1, STEPS + 1)
    }
    for e in acks:  # node-local LMDB takes base versions only (its default placement)
        assert e["tiers"]["shm"] == e["tiers"]["peer"] == "committed", e
        assert e["tiers"]["lmdb"] == ("committed" if e["role"] == "base" else "missing"), e
    gc = [e for e in events if e["event"] == "gc"]  # a GC pass ran on every rank
    assert len(gc) == world and all(set(e["kept"]) == {"shm", "peer", "lmdb", "remote"} for e in gc)
    # node 1 was replaced: its shared memory and local disk were there, and then gone
    assert run["lost dirs"] == [True, True]

    restored = {e["rank"]: e for e in run["restore"]}
    assert sorted(restored) == list(range(world))
    for e in restored.values():
        assert e["step"] == STEPS and e["exact"], e
        if e["node"] == 0:
            assert e["source"] == "shm", e
        else:
            assert e["source"] == "peer", e
            assert set(e["chunks_from"]) <= {"peer", "remote"}, e


@pytest.mark.slow
def test_node_0_lost_with_the_store_file_restores_the_same_store(
    one_rank_per_node: dict[str, Any],
) -> None:
    """Rank 0 writes the store file, in its node's directory: losing node 0 loses the file
    too. The replacement's rank 0 makes the file again with a new id, takes the store's id
    back from the shared remote (which records it at this root) instead of refusing it as
    another store's, and every rank restores the newest version bit-exactly."""
    run = one_rank_per_node["node0-lost"]
    assert len([e for e in run["save"] if e["event"] == "ack"]) == 2 * STEPS
    assert run["store file"]  # node 0's store file, before node 0 was lost

    restored = {e["rank"]: e for e in run["restore"]}
    assert sorted(restored) == [0, 1]
    assert all(e["step"] == STEPS and e["exact"] for e in restored.values()), restored
    assert restored[0]["source"] == "peer" and restored[1]["source"] == "shm", restored
