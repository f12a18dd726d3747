"""Restore into tensors on a GPU: the verified bytes go to the device window by window,
while the rest of the version is still being read.

A restore writes none of the caller's tensors before every chunk of the version is
verified (it is all or nothing), so the windows go first into a copy of the stream on the
device (:class:`DeviceStream`): each window of the page-locked staging buffer is copied
host-to-device on a side stream as soon as all its chunks are verified, overlapping the
reads of the next ones (the pattern of DCP's overlapping CPU loader); the load then copies
device-to-device into the caller's tensors. Where that copy does not fit in the device's
memory, or the tensors are on several devices, the load copies each entry host-to-device
from staging instead (:func:`copy_to_devices`), after the reads.

Every copy is queued after the work already queued on the device's current stream (which
may still read or write the caller's tensors), and awaited before the load returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tiercheck.formats.manifest import ShardManifest

if TYPE_CHECKING:
    import torch

__all__ = ["WINDOW", "DeviceStream", "Windows", "copy_to_devices"]

WINDOW = 64 << 20  # bytes per host-to-device copy while the version is read


class Windows:
    """Which windows of ``[lo, hi)`` (``size`` bytes each, the last one shorter) are
    complete as verified byte ranges arrive, in any order, each byte once. Thread-safe."""

    def __init__(self, lo: int, hi: int, size: int = WINDOW) -> None:
        self.lo, self.hi, self.size = lo, hi, size
        count = (hi - lo + size - 1) // size
        self._left = [min(size, hi - lo - w * size) for w in range(count)]
        self.pending = count
        self._lock = threading.Lock()

    def add(self, offset: int, length: int) -> list[tuple[int, int]]:
        """Count ``[offset, offset + length)`` (clipped to ``[lo, hi)``) as verified; the
        ``(start, end)`` of every window it completes."""
        a, b = max(offset, self.lo), min(offset + length, self.hi)
        done: list[tuple[int, int]] = []
        if a >= b:
            return done
        with self._lock:
            for w in range((a - self.lo) // self.size, (b - 1 - self.lo) // self.size + 1):
                start = self.lo + w * self.size
                end = min(start + self.size, self.hi)
                self._left[w] -= min(b, end) - max(a, start)
                if self._left[w] == 0:
                    self.pending -= 1
                    done.append((start, end))
        return done


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().view(-1).view(torch.uint8)


class DeviceStream:
    """The part of a staged stream that goes to one GPU, ``[lo, hi)``, copied to the device
    window by window as its chunks are verified (:meth:`verified`, from the I/O pool's
    threads), then into the caller's tensors (:meth:`load`)."""

    def __init__(self, host: memoryview, lo: int, hi: int, device: torch.device) -> None:
        import torch

        self.lo, self.hi, self.device = lo, hi, device
        self._side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        with torch.cuda.device(device):
            self._buf = torch.empty(hi - lo, dtype=torch.uint8, device=device)
        # the block was allocated on the current stream and is written on the side one
        self._side.wait_stream(torch.cuda.current_stream(device))
        self._buf.record_stream(self._side)
        self._host = torch.frombuffer(host, dtype=torch.uint8)
        self._windows = Windows(lo, hi)

    @classmethod
    def for_binding(
        cls, manifest: ShardManifest, device_targets: dict[int, Any], host: memoryview
    ) -> DeviceStream | None:
        """The device copy of the stream for a binding's ``device_targets`` (entry index ->
        device tensor), or None where there is none to make: no CUDA target, targets on
        several devices, or no room on the device."""
        import torch

        cuda = {
            i: t
            for i, t in device_targets.items()
            if t.device.type == "cuda" and manifest.entries[i].nbytes
        }
        devices = {t.device for t in cuda.values()}
        if len(devices) != 1:
            return None
        entries = [manifest.entries[i] for i in cuda]
        lo = min(e.offset for e in entries)
        hi = max(e.offset + e.nbytes for e in entries)
        try:
            return cls(host, lo, hi, devices.pop())
        except torch.OutOfMemoryError:
            return None

    def verified(self, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of the stream are verified in staging: queue
        the copy of every window they complete."""
        import torch

        ready = self._windows.add(offset, length)
        for start, end in ready:
            with torch.cuda.stream(self._side):
                self._buf[start - self.lo : end - self.lo].copy_(
                    self._host[start:end], non_blocking=True
                )

    def holds(self, offset: int, nbytes: int) -> bool:
        """Whether every byte of ``[offset, offset + nbytes)`` has gone to the device."""
        return self._windows.pending == 0 and self.lo <= offset and offset + nbytes <= self.hi

    def abandon(self) -> None:
        """Wait for the copies already queued (the version is not loaded after all: the
        staging buffer they read is about to be reused)."""
        self._side.synchronize()

    def load(self, items: Sequence[tuple[Any, int, int]]) -> None:
        """Copy ``(tensor, offset, nbytes)`` from the device copy into each tensor (on
        this stream's device), after the work queued on the device's current stream."""
        import torch

        with torch.no_grad():
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                for target, offset, nbytes in items:
                    start = offset - self.lo
                    _flat_bytes(target).copy_(self._buf[start : start + nbytes])
            self._side.synchronize()


def copy_to_devices(items: Sequence[tuple[Any, memoryview]]) -> None:
    """Copy each host view into its device tensor. On CUDA the copies are queued on a side
    stream of the tensor's device and awaited once per device at the end: from a
    page-locked staging buffer they run while the next ones are queued."""
    import torch

    streams: dict[Any, Any] = {}
    with torch.no_grad():
        for target, src in items:
            flat = _flat_bytes(target)
            host = torch.frombuffer(src, dtype=torch.uint8)
            if flat.device.type != "cuda":
                flat.copy_(host)
                continue
            side = streams.get(flat.device)
            if side is None:
                side = torch.cuda.Stream(device=flat.device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(flat.device))
                streams[flat.device] = side
            with torch.cuda.stream(side):
                flat.copy_(host, non_blocking=True)
        for side in streams.values():
            side.synchronize()
