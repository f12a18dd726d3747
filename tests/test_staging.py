"""The staging buffer: every leaf at its offset, zero padding between them whatever was in
the buffer before, and the per-layout plan rebuilt when the layout or the buffer changes."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from tiercheck.core.chunking import plan_layout
from tiercheck.core.entries import flatten
from tiercheck.engine.staging import ShardBytes, StagingBuffer


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


def test_shard_bytes_switch_waits_for_readers_of_the_buffer() -> None:
    """``ShardBytes.switch`` returns only once every reader that began on the staging buffer
    has ended; reads after it come from the new source (issue 31: the buffer is handed to the
    next save while slower tiers read the fast tier's copy)."""
    buf = bytearray(b"a" * 8 + b"b" * 8)
    src = ShardBytes(memoryview(buf))
    inside, leave, switched = threading.Event(), threading.Event(), threading.Event()
    seen: list[bytes] = []

    def reader() -> None:
        with src.reading():
            seen.append(bytes(src[0:8]))
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=reader)
    t.start()
    assert inside.wait(30)

    def switch() -> None:
        src.switch(lambda offset, length: b"z" * length)
        switched.set()

    s = threading.Thread(target=switch)
    s.start()
    assert not switched.wait(0.2)  # the reader still holds the buffer
    leave.set()
    t.join(30)
    assert switched.wait(30)
    s.join(30)
    assert seen == [b"a" * 8]
    with src.reading():  # after the switch: the new source, and no wait
        assert bytes(src[8:16]) == b"z" * 8


def test_an_offered_buffer_is_given_back_only_when_wanted() -> None:
    """``StagingBuffer.offer``: the holder keeps the buffer until another user wants it;
    then ``give_back`` runs on the wanting thread (at once if it already waits) and that
    user gets the buffer. A release forgets the offer."""
    buf = StagingBuffer()
    called: list[str] = []
    assert buf.acquire()
    buf.offer(lambda: (called.append(threading.current_thread().name), buf.release()))
    assert called == []  # nobody wants it: the holder keeps reading it
    got = threading.Event()

    def want() -> None:
        assert buf.acquire(timeout=30)
        got.set()

    t = threading.Thread(target=want, name="wanting")
    t.start()
    assert got.wait(30) and called == ["wanting"]
    t.join(30)

    # someone already waits when the offer comes: given back at once
    waiting = threading.Thread(target=lambda: buf.acquire(timeout=30) and got.set())
    got.clear()
    waiting.start()
    while not buf._waiting:
        threading.Event().wait(0.001)
    buf.offer(lambda: (called.append("at once"), buf.release()))
    assert got.wait(30) and called == ["wanting", "at once"]
    waiting.join(30)

    # a holder that finished before anyone wanted the buffer: its offer is forgotten
    buf.offer(lambda: called.append("stale"))
    buf.release()
    assert buf.acquire(timeout=1) and called == ["wanting", "at once"]
    buf.release()


def test_a_copy_told_to_stop_leaves_the_rest_of_the_leaves() -> None:
    """A save that gave way mid-copy (``stop``): the leaves before ``stop`` said so are
    copied, none after (the trainer changes them now, and the pipeline lets the buffer go
    only once the copy has stopped)."""
    buf = StagingBuffer()
    state = {"a": torch.ones(1000), "b": torch.full((1000,), 2.0), "c": torch.full((10,), 3.0)}
    _, leaves = flatten(state, allow_pickle=False)
    layout = plan_layout(leaves, 4096)
    buf.ensure(layout.stream_bytes)
    buf.view(buf.capacity)[:] = b"\xff" * buf.capacity
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1  # the trainer went on once the first leaf was copied

    assert buf.stage(leaves, layout, stop=stop) is None
    assert len(asked) == 2  # asked before each copy, not after it said stop
    view = buf.view(layout.stream_bytes)
    first, second = layout.entries[0], layout.entries[1]
    copied = np.frombuffer(view[first.offset : first.offset + first.nbytes], dtype=np.float32)
    assert (copied == 1.0).all()
    left = bytes(view[second.offset : second.offset + second.nbytes])
    assert left == b"\xff" * second.nbytes
