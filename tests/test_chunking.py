"""The packing rule (SPEC.md section 9): where entries lie and where chunks are cut."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercheck.core.chunking import ALIGN, chunks_of, plan_layout
from tiercheck.core.entries import Leaf, flatten
from tiercheck.formats.manifest import ChunkRef

CS = 4096


def leaf(key: str, nbytes: int, kind: str = "tensor") -> Leaf:
    return Leaf(key, kind, None, "uint8", (nbytes,), nbytes)  # type: ignore[arg-type]


sizes = st.lists(
    st.tuples(st.sampled_from(["tensor", "msgpack"]), st.integers(0, 3 * CS + 100)),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(sizes)
def test_windows_tile_the_stream_and_large_entries_own_theirs(spec: list[tuple[str, int]]) -> None:
    leaves = [leaf(f"k{i}", n, kind) for i, (kind, n) in enumerate(spec)]
    layout = plan_layout(leaves, CS)
    # windows cover [0, stream_bytes) exactly, in order, none empty or longer than a chunk
    pos = 0
    for off, n in layout.windows:
        assert off == pos and 0 < n <= CS
        pos += n
    assert pos == layout.stream_bytes
    starts = {off for off, _ in layout.windows}
    ends = {off + n for off, n in layout.windows}
    placed = sorted(layout.entries, key=lambda e: (e.offset, e.nbytes))
    # tensors before scalars; 64-byte aligned; no overlap; padding only up to the alignment
    kinds = [e.kind for e in placed if e.nbytes]
    assert kinds == sorted(kinds, key=lambda k: k != "tensor")
    end = 0
    for e in placed:
        assert e.offset % ALIGN == 0 and e.offset >= end and e.offset - end < ALIGN
        end = e.offset + e.nbytes
        if e.nbytes >= CS:  # a large entry is its own run of chunks
            assert e.offset in starts and e.offset + e.nbytes in ends
    assert layout.stream_bytes == end
    refs = [ChunkRef(f"{i:064x}", o, n) for i, (o, n) in enumerate(layout.windows)]
    for e in layout.entries:
        touched = [
            i
            for i, (o, n) in enumerate(layout.windows)
            if o < e.offset + e.nbytes and e.offset < o + n
        ]
        assert list(chunks_of(e, refs)) == (touched if e.nbytes else [])


def test_no_padding_for_entries_just_over_a_chunk() -> None:
    # the old rule (large entries start on a chunk boundary) padded this to 4 chunks of 4 KiB
    layout = plan_layout([leaf("a", CS + 64), leaf("b", CS + 64), leaf("c", 10)], CS)
    assert layout.stream_bytes == 2 * (CS + 64) + 10
    assert layout.windows == (
        (0, CS),
        (CS, 64),
        (CS + 64, CS),
        (2 * CS + 64, 64),
        (2 * CS + 128, 10),
    )


def test_a_scalar_growing_moves_no_tensor_chunk() -> None:
    def starts(step: int) -> list[int]:
        state = {"w": torch.zeros(CS + 8, dtype=torch.uint8), "b": torch.zeros(7), "step": step}
        _, leaves = flatten(state)
        return [o for o, _ in plan_layout(leaves, CS).windows]

    assert starts(1) == starts(1 << 40) == [0, CS, CS + 8]


def test_small_states_get_small_chunks() -> None:
    from tiercheck.core.chunking import CHUNKS_PER_STATE, MIN_CHUNK_SIZE, choose_chunk_size

    big = 4 << 20
    assert choose_chunk_size([leaf("a", 1 << 30)], big) == big  # large: the policy's size
    assert choose_chunk_size([leaf("a", 100)], big) == MIN_CHUNK_SIZE
    mid = 16 << 20
    assert choose_chunk_size([leaf("a", mid)], big) == mid // CHUNKS_PER_STATE
    # a power of two: the size changes only when the state doubles or halves
    assert choose_chunk_size([leaf("a", mid - 640)], big) == mid // CHUNKS_PER_STATE
    assert choose_chunk_size([leaf("a", mid // 2 + 640)], big) == mid // CHUNKS_PER_STATE
    assert choose_chunk_size([leaf("a", mid)], 8192) == 8192  # never above the policy's


def test_a_one_bias_change_rewrites_a_small_part_of_a_small_state(tmp_path: Path) -> None:
    import uuid

    import tiercheck

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))  # 514 KiB
    tier = "memory://" + uuid.uuid4().hex
    with tiercheck.Checkpointer(tmp_path / "s", tiers=[tier]) as ckpt:
        first = ckpt.save(0, {"model": model}).wait()
        with torch.no_grad():
            model[1].bias[0] += 1
        second = ckpt.save(1, {"model": model}).wait()
    (name,) = first.bytes_written
    assert second.bytes_written[name] < first.bytes_written[name] / 5  # one 64 KiB chunk
