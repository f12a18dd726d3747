"""Writer assignment by hash partition (tiercheck.engine.partition): each id has one owner,
and an owner names exactly one writer per id among the ranks that hold it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercheck.engine.partition import assign_writers, owners, pack_chunks, unpack_ids
from tiercheck.formats.ids import chunk_id

IDS = [chunk_id(i.to_bytes(2, "little")) for i in range(512)]


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 64),
    holdings=st.lists(st.lists(st.integers(0, 40), max_size=12), min_size=1, max_size=8),
)
def test_every_held_id_gets_exactly_one_writer_among_its_holders(
    world: int, holdings: list[list[int]]
) -> None:
    sent = [pack_chunks([(IDS[i], 100 + i) for i in held]) for held in holdings]
    records = np.concatenate(sent)
    holders = np.concatenate([np.full(len(s), r, dtype=np.int64) for r, s in enumerate(sent)])
    assert np.all((owners(records, world) >= 0) & (owners(records, world) < world))
    writes = assign_writers(records, holders)
    writers: dict[str, set[int]] = {}
    for cid, rank, w in zip(unpack_ids(records), holders.tolist(), writes.tolist()):
        if w:
            writers.setdefault(cid, set()).add(rank)
    held_by = {
        IDS[i]: {r for r, held in enumerate(holdings) if i in held} for h in holdings for i in h
    }
    assert set(writers) == set(held_by)
    for cid, ranks in writers.items():
        assert len(ranks) == 1 and ranks <= held_by[cid]


def test_owners_spread_ids_evenly_and_replicas_share_the_writing() -> None:
    records = pack_chunks([(c, 1) for c in IDS])
    counts = np.bincount(owners(records, 8), minlength=8)
    assert counts.min() >= 0.5 * len(IDS) / 8 and counts.max() <= 1.5 * len(IDS) / 8
    # the same 512 ids on 4 ranks (data-parallel replicas): each rank writes about a quarter
    both = np.concatenate([records] * 4)
    holders = np.repeat(np.arange(4, dtype=np.int64), len(records))
    per_rank = np.bincount(holders[assign_writers(both, holders) == 1], minlength=4)
    assert per_rank.sum() == len(IDS) and per_rank.min() >= 0.5 * len(IDS) / 4
