"""Staging: the copy of a state into buffers the trainer does not touch.

It is the only part of a save the trainer waits for. The buffer is allocated once and
reused across saves (writing into warm pages is several times faster than first-touch
allocation), grown only when a state outgrows it, and pre-faulted when allocated so the
first save pays nothing extra. With CUDA tensors the buffer is pinned and device-to-host
copies are issued non-blocking on a side stream; an event marks their completion.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tiercheck.chunking import Layout
from tiercheck.entries import Leaf, torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["StagingBuffer"]


class StagingBuffer:
    """A reusable host buffer holding one shard's byte stream.

    Only one save uses it at a time: :meth:`acquire` blocks until the previous user
    :meth:`release`\\ s it. ``capacity`` only grows.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._busy = threading.Lock()
        self._stream: torch.cuda.Stream | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    def ensure(self, nbytes: int, *, pinned: bool = False) -> None:
        """Make the buffer at least ``nbytes`` long (pinned if asked), pre-faulting pages."""
        import torch

        pinned = pinned and torch.cuda.is_available()
        if self._buf is not None and self.capacity >= nbytes and (self._pinned or not pinned):
            return
        self._buf = None
        size = max(nbytes, 1)
        if pinned:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        buf.zero_()  # first touch now, not during a save
        self._buf = buf
        self._pinned = pinned

    def acquire(self, timeout: float | None = None) -> bool:
        """Take exclusive use of the buffer; False if ``timeout`` ran out."""
        return self._busy.acquire(timeout=-1 if timeout is None else timeout)

    def release(self) -> None:
        self._busy.release()

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the buffer as a byte memoryview (valid until regrown)."""
        assert self._buf is not None
        return self._buf.numpy().data.cast("B")[:nbytes]

    def tensor(self) -> torch.Tensor:
        assert self._buf is not None
        return self._buf

    def stage(self, leaves: Sequence[Leaf], layout: Layout) -> torch.cuda.Event | None:
        """Copy every leaf to its offset; zero the padding. Returns a CUDA event or None.

        CPU copies are complete on return. CUDA copies are queued on a side stream; the
        returned event completes when they have landed.
        """
        import torch

        needs_cuda = any(leaf.kind == "tensor" and leaf.value.is_cuda for leaf in leaves)
        self.ensure(layout.stream_bytes, pinned=needs_cuda)
        buf = self.tensor()
        n = layout.stream_bytes
        self._zero_gaps(buf, layout)
        stream = None
        if needs_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
        for leaf, entry in zip(leaves, layout.entries):
            if entry.nbytes == 0:
                continue
            dst = buf[entry.offset : entry.offset + entry.nbytes]
            if leaf.kind == "tensor":
                src: torch.Tensor = leaf.value.detach()
                target = dst.view(torch_dtype(entry.dtype)).view(entry.shape)
                if src.is_cuda and stream is not None:
                    with torch.cuda.stream(stream):
                        target.copy_(src, non_blocking=True)
                        src.record_stream(stream)
                else:
                    target.copy_(src)
            elif leaf.kind == "ndarray":
                arr = np.asarray(leaf.value)
                out = dst.numpy().view(arr.dtype).reshape(arr.shape)
                np.copyto(out, arr, casting="no")
            else:
                dst.copy_(torch.frombuffer(bytearray(leaf.value), dtype=torch.uint8))
        assert n <= self.capacity
        if stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            return event
        return None

    @staticmethod
    def _zero_gaps(buf: torch.Tensor, layout: Layout) -> None:
        pos = 0
        for entry in sorted(layout.entries, key=lambda e: e.offset):
            if entry.offset > pos:
                buf[pos : entry.offset].zero_()
            pos = max(pos, entry.offset + entry.nbytes)
        if pos < layout.stream_bytes:
            buf[pos : layout.stream_bytes].zero_()
