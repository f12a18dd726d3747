"""The staging buffer: every leaf at its offset, zero padding between them whatever was in
the buffer before, and the per-layout plan rebuilt when the layout or the buffer changes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiercheck.core.chunking import plan_layout
from tiercheck.core.entries import flatten
from tiercheck.engine.staging import StagingBuffer


def expected_stream(state: dict[str, Any]) -> bytes:
    """The staged stream built the slow way: zeros, then each leaf's bytes at its offset."""
    _, leaves = flatten(state, allow_pickle=False)
    layout = plan_layout(leaves, 4096)
    out = bytearray(layout.stream_bytes)
    for leaf, entry in zip(leaves, layout.entries):
        if leaf.kind == "tensor":
            data = leaf.value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        elif leaf.kind == "ndarray":
            data = np.ascontiguousarray(leaf.value).tobytes()
        else:
            data = bytes(leaf.value)
        out[entry.offset : entry.offset + entry.nbytes] = data
    return bytes(out)


def stage(buf: StagingBuffer, state: dict[str, Any]) -> bytes:
    _, leaves = flatten(state, allow_pickle=False)
    layout = plan_layout(leaves, 4096)
    assert buf.stage(leaves, layout) is None  # CPU only: done on return
    return bytes(buf.view(layout.stream_bytes))


def make_state(scale: float) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.nn.Parameter(torch.randn(333, 7, generator=g) * scale),  # needs padding
        "b": torch.randn(5, generator=g).half(),
        "t": torch.randn(20, 30, generator=g).t(),  # not contiguous
        "a": np.arange(17, dtype=np.int16) * int(scale),
        "e": torch.empty(0),
        "step": int(scale),
        "name": "x" * int(scale),
    }


def test_stage_writes_every_leaf_and_zero_padding_even_over_garbage() -> None:
    buf = StagingBuffer()
    state = make_state(1.0)
    want = expected_stream(state)
    assert stage(buf, state) == want
    buf.view(buf.capacity)[:] = b"\xff" * buf.capacity  # e.g. a restore read into it
    assert stage(buf, state) == want
    assert buf.tensor().grad_fn is None and not buf.tensor().requires_grad


def test_plan_follows_layout_and_buffer_changes() -> None:
    buf = StagingBuffer()
    assert stage(buf, make_state(1.0)) == expected_stream(make_state(1.0))
    other = make_state(3.0)  # longer string: the scalars move
    assert stage(buf, other) == expected_stream(other)
    big = {**other, "extra": torch.ones(100_000)}  # outgrows the buffer: a new one
    assert stage(buf, big) == expected_stream(big)
    assert stage(buf, make_state(1.0)) == expected_stream(make_state(1.0))
