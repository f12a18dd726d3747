"""Copying a step's gradients to the host: the ring of reused buffers and the copies.

:class:`Ring` holds the host buffers of :class:`~tiercheck.logversions.update_log.UpdateLog`:
page-locked for CUDA gradients, reused from one full version to the next, at most
``max_bytes`` of them, and allocated (and first touched) before the steps that fill them
where the caller knows the size ahead (:meth:`Ring.reserve`, from ``guard()``).

:func:`copy_grads` lays one step's gradients out in a buffer (64-byte-aligned slots, zero
padding). A CPU gradient is copied at once. A CUDA gradient is copied on a side stream of
its device, ordered after the work of the trainer's stream that produced it (the stream
waits for an event, not the host); the gradient's memory is marked as used by the side
stream so that the caching allocator does not hand it out before the copy ran; and the
returned :class:`Copies` make the trainer's stream wait for the copy only where the next
write of a gradient could overtake it (:meth:`Copies.fence`: after the optimizer step, or
before it where the step itself may write gradients, as a fused kernel that unscales in
place does). The host never waits, except in :meth:`Copies.wait` at ``take()``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercheck.core.chunking import ALIGN
from tiercheck.core.entries import encode_scalar
from tiercheck.formats.manifest import GroupOptions, SmallTensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "Copies",
    "Deferred",
    "GradSlot",
    "OptionsCapture",
    "Ring",
    "capture_group_options",
    "capture_options",
    "capture_scaler",
    "copy_grads",
    "dtype_name",
    "narrowable",
    "resolve_scaler",
    "round_up",
    "slot_bytes",
    "step_counter",
]

# buffers are allocated in multiples of this, so that steps of a similar size share them
_GRAIN = 1 << 16

# elements probed before the whole of a gradient is checked by narrowable: a gradient
# computed in float32 has low bits set in its first elements, and costs no more than that
_NARROW_PROBE = 4096


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class GradSlot:
    """Where one gradient lies in its step's buffer."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class Ring:
    """Host buffers for the steps since the last full version, reused from one full
    version to the next; at most ``max_bytes`` of them (``None``: unbounded)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0  # capacity of every buffer the ring owns
        self._free: list[torch.Tensor] = []

    def get(self, nbytes: int, pinned: bool) -> torch.Tensor | None:
        """A buffer of at least ``nbytes`` (page-locked if ``pinned``); None when
        ``max_bytes`` does not allow one."""
        fits = [
            i
            for i, b in enumerate(self._free)
            if b.numel() >= nbytes and (b.is_pinned() or not pinned)
        ]
        if fits:
            # by position, never by value: list.remove would compare tensors with ==
            best = min(fits, key=lambda i: self._free[i].numel())
            return self._free.pop(best)
        size = round_up(max(nbytes, 1), _GRAIN)
        if self.max_bytes is not None and self.held_bytes + size > self.max_bytes:
            for b in self._free:  # none of them fits: give their memory back
                self.held_bytes -= b.numel()
            self._free = []
            if self.held_bytes + size > self.max_bytes:
                return None
        return self._allocate(size, pinned)

    def put(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from :meth:`get`) is free for reuse."""
        if all(b is not buffer for b in self._free):
            self._free.append(buffer)

    def reserve(self, nbytes: int, pinned: bool, count: int = 1) -> None:
        """Hold ``count`` free buffers of at least ``nbytes`` now (allocated and first
        touched here, not in the step that would need them)."""
        have = sum(1 for b in self._free if b.numel() >= nbytes and (b.is_pinned() or not pinned))
        size = round_up(max(nbytes, 1), _GRAIN)
        for _ in range(count - have):
            if self.max_bytes is not None and self.held_bytes + size > self.max_bytes:
                return
            self._free.append(self._allocate(size, pinned))

    def _allocate(self, size: int, pinned: bool) -> torch.Tensor:
        import torch

        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        buf.zero_()  # first touch now, not in a later step
        self.held_bytes += size
        return buf


@dataclass
class Copies:
    """The CUDA copies of one step still in flight: ``(device, event)`` per device, the
    event recorded on the side stream after its copies."""

    events: list[tuple[Any, Any]] = field(default_factory=list)

    def fence(self) -> None:
        """Make each device's current stream wait for the copies (no host wait): work
        queued after this point cannot change a gradient before it was copied."""
        import torch

        for dev, ev in self.events:
            torch.cuda.current_stream(dev).wait_event(ev)

    def wait(self) -> None:
        """Block the host until the copies have landed."""
        for _, ev in self.events:
            ev.synchronize()

    def __bool__(self) -> bool:
        return bool(self.events)


_side_streams: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """One side stream per CUDA device for the gradient copies."""
    import torch

    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def copy_grads(buf: torch.Tensor, grads: Sequence[tuple[torch.Tensor, GradSlot] | None]) -> Copies:
    """Copy each gradient to its slot of ``buf`` and zero the padding; CUDA gradients on
    a side stream (see the module docstring). Returns the copies in flight."""
    import torch

    end = 0
    pending: dict[Any, Any] = {}  # device -> side stream that copies its gradients
    for item in grads:
        if item is None:
            continue
        g, slot = item
        if slot.offset > end:
            buf[end : slot.offset].zero_()
        target = buf[slot.offset : slot.offset + slot.nbytes]
        if slot.dtype != dtype_name(g):  # narrowed: each element's high 16 bits
            target.view(torch.int16).copy_(g.reshape(-1).view(torch.int16)[1::2])
        elif g.device.type == "cuda" and torch.cuda.is_available():
            side = pending.get(g.device)
            if side is None:
                side = pending[g.device] = _side_stream(g.device)
                # after the trainer's work so far on this device (the backward)
                side.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(side):
                target.view(g.dtype).view(g.shape).copy_(g.detach(), non_blocking=True)
            g.record_stream(side)  # its memory is not reused before the copy ran
        else:
            target.view(g.dtype).view(g.shape).copy_(g.detach())
        end = slot.offset + slot.nbytes
    copies = Copies()
    for dev in sorted(pending, key=str):
        ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ev.record(pending[dev])
        copies.events.append((dev, ev))
    return copies


def narrowable(g: torch.Tensor) -> bool:
    """Whether float32 gradient ``g`` (in host memory) holds only exact bfloat16 values:
    the low 16 bits of every element zero: bf16 gradients cast up for float32 master
    weights (and not clipped in float32 after). Such a gradient is logged as bfloat16 (the
    high halves, bit for bit: SPEC.md section 12.3) at half the bytes, and widened back
    for the replay. A device tensor is never probed: that would make the step wait."""
    import torch

    if (
        g.dtype != torch.float32
        or g.device.type != "cpu"
        or sys.byteorder != "little"
        or not g.numel()
        or not g.is_contiguous()
    ):
        return False
    low = g.detach().reshape(-1).view(torch.int16)[0::2]
    return not bool(low[:_NARROW_PROBE].any()) and not bool(low.any())


def slot_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes of one step's buffer if every one of ``params`` has a gradient of its dtype."""
    pos = 0
    for p in params:
        pos = round_up(pos, ALIGN) + p.numel() * p.element_size()
    return pos


# --- small tensors and options, captured without waiting for a device -----------------


class Deferred:
    """A small tensor cloned on its device now and read on the host later (at take)."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value.detach().clone()

    def get(self) -> SmallTensor:
        import torch

        host = self.value.cpu().contiguous()
        data = host.reshape(-1).view(torch.uint8).numpy().tobytes()
        return SmallTensor(dtype_name(host), tuple(int(d) for d in host.shape), data)


@dataclass
class OptionsCapture:
    packed: bytes
    tensors: list[tuple[int, str, Deferred]]

    def get(self) -> GroupOptions:
        return GroupOptions(self.packed, tuple((g, n, d.get()) for g, n, d in self.tensors))


def capture_options(optimizer: torch.optim.Optimizer) -> GroupOptions:
    """The options of every param group as they stand now (SPEC.md section 12.2)."""
    return capture_group_options(optimizer).get()


def capture_group_options(optimizer: torch.optim.Optimizer) -> OptionsCapture:
    import torch

    groups: list[dict[str, Any]] = []
    tensors: list[tuple[int, str, Deferred]] = []
    for g, group in enumerate(optimizer.param_groups):
        opts: dict[str, Any] = {}
        for name, value in group.items():
            if name == "params":
                continue
            if isinstance(value, torch.Tensor):
                tensors.append((g, name, Deferred(value)))
            else:
                opts[name] = value
        groups.append(opts)
    _, packed = encode_scalar(groups, "param_groups", allow_pickle=False)
    return OptionsCapture(packed, tensors)


def capture_scaler(scaler: Any) -> dict[str, Deferred] | None:
    import torch

    out: dict[str, Deferred] = {}
    for key, attr in (("scale", "_scale"), ("growth_tracker", "_growth_tracker")):
        value = getattr(scaler, attr, None)
        if isinstance(value, torch.Tensor):
            out[key] = Deferred(value)
    return out or None  # no scale yet: the scaler has not scaled anything


def resolve_scaler(raw: Mapping[str, Deferred] | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    out: dict[str, Any] = {}
    for key, deferred in raw.items():
        item = deferred.value.cpu().item()
        out[key] = float(item) if key == "scale" else int(item)
    return out


def step_counter(optimizer: Any) -> Deferred | float | None:
    """The optimizer's step counter (of its first parameter with state), without a sync."""
    import torch

    for p in (p for group in optimizer.param_groups for p in group["params"]):
        st = optimizer.state.get(p)
        if not st or "step" not in st:
            continue
        value = st["step"]
        if isinstance(value, torch.Tensor):
            return float(value.item()) if value.device.type == "cpu" else Deferred(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return None
    return None
