"""The commit protocol's cost per rank does not grow with the job (issue 24).

Real saves under torchrun (gloo on loopback, CPU) at 2 and 8 ranks, a fully sharded
state with the same chunks per rank; every ``torch.distributed`` collective counted in
each rank by tests/dist_scripts/protocol_worker.py (bytes its outputs received, calls).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from statistics import mean
from typing import Any

import _dist
import pytest

WORKER = Path(__file__).parent / "dist_scripts" / "protocol_worker.py"
CHUNKS = 96  # per rank, 16 KiB each
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def shm_root() -> Iterator[Path]:
    path = Path(f"/dev/shm/tiercheck-test-{uuid.uuid4().hex[:10]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(world: int, root: Path, shm_root: Path) -> list[dict[str, Any]]:
    """Each rank's counts, in rank order."""
    root.mkdir()
    out = root / "counts"
    proc = _dist.torchrun(
        WORKER,
        "--root",
        str(root),
        "--shm-root",
        str(shm_root / f"w{world}"),
        "--out",
        str(out),
        "--chunks",
        str(CHUNKS),
        nproc=world,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(Path(f"{out}-{r}.json").read_text()) for r in range(world)]
    for r in ranks:
        for save in r["saves"]:
            assert set(save["tiers"].values()) == {"committed"}, save
    return ranks


@pytest.mark.slow
def test_bytes_and_rounds_per_rank_per_save_stay_flat_from_2_to_8_ranks(
    tmp_path: Path, shm_root: Path
) -> None:
    two = run(2, tmp_path / "two", shm_root)
    eight = run(8, tmp_path / "eight", shm_root)

    def per_save(ranks: list[dict[str, Any]], key: str) -> list[int]:
        return [s[key] for r in ranks for s in r["saves"]]

    # the bytes a rank receives follow its own chunks, not the world: within 1.5x from 2
    # to 8 ranks (the ids alone are 40 bytes each, 3.8 KB per rank per save; which rank
    # owns an id is a hash, so a rank receives about, not exactly, as many as it sends)
    assert mean(per_save(eight, "bytes")) <= 1.25 * mean(per_save(two, "bytes"))
    assert max(per_save(eight, "bytes")) <= 1.5 * max(per_save(two, "bytes"))
    assert min(per_save(eight, "bytes")) >= CHUNKS * 40 * 0.5
    # a constant number of collective calls per save, whatever the world
    assert set(per_save(two, "calls")) == set(per_save(eight, "calls"))
    assert len(set(per_save(eight, "calls"))) == 1
    # the protocol is the only user of torch.distributed in a save, and counts what it gets
    for ranks in (two, eight):
        assert per_save(ranks, "bytes") == per_save(ranks, "protocol_bytes")
        assert per_save(ranks, "calls") == per_save(ranks, "protocol_calls")
    # every unique chunk went to the shared tier once, from one writer
    for ranks, world in ((two, 2), (eight, 8)):
        for i in range(len(ranks[0]["saves"])):
            assert sum(r["saves"][i]["remote_chunks"] for r in ranks) == CHUNKS * world
