"""Staging: the copy of a state into buffers the trainer does not touch.

It is the only part of a save the trainer waits for. The buffer is allocated once and
reused across saves (writing into warm pages is several times faster than first-touch
allocation), grown only when a state outgrows it, and pre-faulted when allocated so the
first save pays nothing extra. Where the store's fastest tier offers a staging area of its
own storage (shm: :mod:`tiercheck.engine.shm_staging`), a full version's copy goes into
one of its two ranges instead, and that tier then adopts the staged windows as its blobs.

CUDA tensors go to a pinned buffer with non-blocking device-to-host copies, issued per
device on a side stream of *that* device. Each side stream first waits for the work the
trainer had queued on the device when it called ``save`` (an event recorded on the
caller's current stream by :func:`ready_events`, or, without one, the current stream of
the device as the staging thread sees it), so a copy never reads a tensor an earlier
kernel is still writing; an event recorded on each side stream after its copies says
when they have landed. Streams, events and the pinned buffer are made under the device
of the tensors they serve, so a rank that uses ``cuda:3`` never creates a context on
``cuda:0`` (CUDA's current device is per thread: the staging thread's is 0).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercheck.core.chunking import Layout
from tiercheck.core.entries import Leaf, tensor_place, torch_dtype
from tiercheck.errors import TiercheckError
from tiercheck.formats.manifest import Entry

if TYPE_CHECKING:
    import torch

    from tiercheck.backends.base import StagingArea

log = logging.getLogger(__name__)

__all__ = [
    "CopiesInFlight",
    "Hold",
    "ShardBytes",
    "StagingBuffer",
    "copy_buffers",
    "cuda_devices",
    "ready_events",
]


def cuda_devices(leaves: Sequence[Leaf]) -> list[int]:
    """The CUDA device indices holding tensor leaves, in first-seen order."""
    seen: dict[int, None] = {}
    for leaf in leaves:
        if leaf.kind == "tensor" and leaf.value.is_cuda:
            seen.setdefault(int(leaf.value.device.index), None)
    return list(seen)


_MODULE_DEPTH = 32  # how deep copy_buffers looks for modules in a state's containers


def copy_buffers(state: Any, leaves: list[Leaf]) -> list[Leaf]:
    """``leaves``, with each tensor that is a buffer of a module in ``state`` replaced by a
    copy taken now (on a GPU, queued on the caller's current stream, before the staging
    copies' :func:`ready_events`).

    A guarded loop (``Checkpointer.guard``) waits for staging in ``optimizer.step()``, but
    its ``forward()`` runs first and changes the buffers of the modules it runs (a batch
    norm's running statistics): without this copy the version would hold the next step's
    buffers. Parameters and the optimizer's state change only in the step, and are not
    copied here."""
    import torch

    found: dict[tuple[Any, ...], None] = {}

    def walk(node: Any, depth: int) -> None:
        if depth > _MODULE_DEPTH:
            return
        if isinstance(node, torch.nn.Module):
            for b in node.buffers():
                if b.numel():
                    found[tensor_place(b)] = None
        elif isinstance(node, Mapping):
            for v in node.values():
                walk(v, depth + 1)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, depth + 1)

    walk(state, 0)
    if not found:
        return leaves
    out = []
    for leaf in leaves:
        value = leaf.value
        if (
            leaf.kind == "tensor"
            and leaf.placement is None
            and type(value) is torch.Tensor
            and value.numel()
            and tensor_place(value) in found
        ):
            leaf = dataclasses.replace(leaf, value=value.detach().clone())
        out.append(leaf)
    return out


def ready_events(leaves: Sequence[Leaf]) -> dict[int, torch.cuda.Event]:
    """For each CUDA device holding a leaf, an event recorded now on the calling thread's
    current stream of that device: the point the staging copies must wait for.

    Call it on the trainer's thread, in ``save``; CPU-only states return ``{}``.
    """
    devices = cuda_devices(leaves)
    if not devices:
        return {}
    import torch

    events: dict[int, torch.cuda.Event] = {}
    for device in devices:
        with torch.cuda.device(device):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events[device] = event
    return events


@dataclass(frozen=True)
class CopiesInFlight:
    """The device-to-host copies of one staging, one event per device."""

    events: tuple[tuple[int, Any], ...]  # (device index, torch.cuda.Event)

    def synchronize(self) -> None:
        """Block until every copy has landed in the staging buffer."""
        import torch

        for device, event in self.events:
            with torch.cuda.device(device):  # this thread's current device may be another
                event.synchronize()

    def query(self) -> bool:
        """Whether every copy has landed (without blocking)."""
        import torch

        done = True
        for device, event in self.events:
            with torch.cuda.device(device):
                done = done and bool(event.query())
        return done


class StagingBuffer:
    """A reusable host buffer holding one shard's byte stream.

    Only one save uses it at a time: :meth:`acquire` blocks until the previous user
    :meth:`release`\\ s it, and asks that user to give it back early if it has
    :meth:`offer`\\ ed to. ``capacity`` only grows.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._busy = threading.Lock()
        self._offers = threading.Lock()  # guards the two below
        self._waiting = 0  # acquire() calls blocked on the buffer
        self._give_back: Callable[[], None] | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._plans: dict[int, _Plan] = {}  # by id of the buffer (private, or a range)
        self._current: torch.Tensor | None = None  # what the last stage (or ensure) used
        #: the engine's choice of a shm staging area for a layout (None: always private)
        self.area_for: Callable[[Layout], StagingArea | None] | None = None
        #: called before a range is armed: frees what a version no longer needs there
        self.before_arm: Callable[[StagingArea, int], None] | None = None
        self._area: StagingArea | None = None  # the area of the last stage
        #: the range of ``_area`` the last stage copied into (None: the private buffer)
        self.staged_range: int | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    @property
    def pinned(self) -> bool:
        return self._pinned

    def ensure(self, nbytes: int, *, pinned: bool = False, device: int | None = None) -> None:
        """Make the buffer at least ``nbytes`` long (pinned if asked), pre-faulting pages.

        A pinned buffer is allocated under CUDA device ``device`` (default: the calling
        thread's current device), so no context is created on a device the process does
        not use; pinned memory is usable by every device of the process.
        """
        import torch

        pinned = pinned and torch.cuda.is_available()
        self.staged_range = None
        if self._buf is not None and self.capacity >= nbytes and (self._pinned or not pinned):
            self._current = self._buf
            return
        if self._buf is not None:
            self._plans.pop(id(self._buf), None)  # its views hold the old buffer
        self._buf = self._current = None
        size = max(nbytes, 1)
        if pinned:
            index = torch.cuda.current_device() if device is None else device
            with torch.cuda.device(index):
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        buf.zero_()  # first touch now, not during a save
        self._buf = self._current = buf
        self._pinned = pinned

    def acquire(self, timeout: float | None = None) -> bool:
        """Take exclusive use of the buffer; False if ``timeout`` ran out. A user that
        offered the buffer (:meth:`offer`) gives it back now, on this thread."""
        if self._busy.acquire(blocking=False):
            return True
        with self._offers:
            self._waiting += 1
            give_back, self._give_back = self._give_back, None
        try:
            if give_back is not None:
                give_back()
            return self._busy.acquire(timeout=-1 if timeout is None else timeout)
        finally:
            with self._offers:
                self._waiting -= 1

    def offer(self, give_back: Callable[[], None]) -> None:
        """The user may give the buffer back before it is done with it: ``give_back``
        (which ends by releasing it) is called once someone wants it, at once if someone
        is already waiting. Until then the user keeps reading it."""
        with self._offers:
            if not self._waiting:
                self._give_back = give_back
                return
        give_back()

    def release(self) -> None:
        with self._offers:
            self._give_back = None
        self._busy.release()

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the buffer the last :meth:`stage` (or :meth:`ensure`)
        used, as a byte memoryview (valid until regrown)."""
        return self.tensor().numpy().data.cast("B")[:nbytes]

    def tensor(self) -> torch.Tensor:
        """The buffer the last :meth:`stage` (or :meth:`ensure`) used: the private one, or
        a range of the shm staging area."""
        assert self._current is not None
        return self._current

    @property
    def staged(self) -> tuple[StagingArea, int] | None:
        """The shm staging area and range the last :meth:`stage` copied into (None: the
        private buffer)."""
        r = self.staged_range
        return None if self._area is None or r is None else (self._area, r)

    def close_area(self) -> None:
        """Forget the shm staging area (its owner closes it): no view of it is kept."""
        if self._area is not None:
            self._plans = {k: p for k, p in self._plans.items() if p.buf is self._buf}
            self._current = self._buf
            self._area = None
            self.staged_range = None

    def _stream(self, device: int) -> torch.cuda.Stream:
        """This buffer's side stream on ``device``, created there on first use."""
        import torch

        stream = self._streams.get(device)
        if stream is None:
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            self._streams[device] = stream
        return stream

    def stage(
        self,
        leaves: Sequence[Leaf],
        layout: Layout,
        *,
        ready: Mapping[int, torch.cuda.Event] | None = None,
        stop: Callable[[], bool] | None = None,
        shm: bool = True,
    ) -> CopiesInFlight | None:
        """Copy every leaf to its offset; the padding between them is zero.

        CPU copies are complete on return, and so is the result None. With CUDA leaves the
        device-to-host copies are queued (see the module docstring) and the returned
        :class:`CopiesInFlight` says when they have landed: call its ``synchronize()``
        before reading the buffer. ``ready`` maps a device index to the event of
        :func:`ready_events` taken when the save was asked for. ``stop`` is asked before
        each host copy: once it says True the rest is left (the save gave way; what the
        buffer holds then is no version's). ``shm``: a full version, which may stage in the
        shm staging area (a log version, whose layout is its gradients', never does: it
        would take the state's area away).
        """
        devices = cuda_devices(leaves)
        area_for = self.area_for if shm and not devices else None
        area = area_for(layout) if area_for is not None else None
        if area is not self._area:
            self.close_area()
            self._area = area
        if area is not None:
            r = area.take()
            try:
                if self.before_arm is not None:
                    self.before_arm(area, r)
                area.arm(r)
            except (OSError, TiercheckError) as exc:  # this save stages privately
                area.done_staging()
                log.warning("staging privately: could not ready a shm staging range: %s", exc)
            else:
                self._current, self.staged_range = area.tensor(r), r
                try:
                    return self._copy(leaves, layout, devices, ready, stop)
                finally:
                    area.done_staging()
        self.ensure(
            layout.stream_bytes, pinned=bool(devices), device=devices[0] if devices else None
        )
        return self._copy(leaves, layout, devices, ready, stop)

    def _copy(
        self,
        leaves: Sequence[Leaf],
        layout: Layout,
        devices: list[int],
        ready: Mapping[int, torch.cuda.Event] | None,
        stop: Callable[[], bool] | None,
    ) -> CopiesInFlight | None:
        """:meth:`stage`'s copies into the buffer it chose (:meth:`tensor`)."""
        import torch

        plan = self._plan_for(layout)
        plan.zero_gaps()
        events = []
        # no autograd: a parameter copied into the buffer must not make it part of a graph
        with torch.no_grad():
            # the device-to-host copies first: they run while the CPU leaves are copied
            for device in devices:
                stream = self._stream(device)
                ready_event = (ready or {}).get(device)
                # everything under the device's guard: this thread's current device is 0
                with torch.cuda.device(device):
                    if ready_event is not None:
                        stream.wait_event(ready_event)  # type: ignore[no-untyped-call]
                    else:
                        stream.wait_stream(torch.cuda.current_stream(device))  # type: ignore[no-untyped-call]
                    with torch.cuda.stream(stream):
                        for leaf, target in zip(leaves, plan.targets):
                            src = leaf.value
                            if (
                                target is None
                                or leaf.kind != "tensor"
                                or not src.is_cuda
                                or src.device.index != device
                            ):
                                continue
                            target.copy_(src, non_blocking=True)
                            src.record_stream(stream)  # its memory is not reused before the copy
                    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    done.record(stream)
                events.append((device, done))
            for leaf, target, entry in zip(leaves, plan.targets, layout.entries):
                if target is None:
                    continue
                if stop is not None and stop():
                    break
                if leaf.kind == "tensor":
                    if not leaf.value.is_cuda:
                        target.copy_(leaf.value)
                elif leaf.kind == "ndarray":
                    arr = np.asarray(leaf.value)
                    np.copyto(target.numpy().view(arr.dtype).reshape(arr.shape), arr, casting="no")
                else:
                    plan.bytes[entry.offset : entry.offset + entry.nbytes] = leaf.value
        return CopiesInFlight(tuple(events)) if events else None

    def _plan_for(self, layout: Layout) -> _Plan:
        """The destinations of ``layout``'s entries in the buffer, made once per layout.

        Every save of a training run has the layout of the one before, and reuses the typed
        views: per leaf that leaves one ``copy_``. Building the views and zeroing each gap
        with a slice per save cost as much as copying 25 KiB per leaf.
        """

        buf = self.tensor()
        plan = self._plans.get(id(buf))
        if plan is not None and plan.buf is buf and plan.entries == layout.entries:
            return plan
        targets: list[torch.Tensor | None] = []
        for entry in layout.entries:
            if entry.nbytes == 0:
                targets.append(None)
                continue
            dst = buf[entry.offset : entry.offset + entry.nbytes]
            if entry.kind == "tensor":
                targets.append(dst.view(torch_dtype(entry.dtype)).view(entry.shape))
            else:
                targets.append(dst)
        small: list[np.ndarray[Any, np.dtype[np.int64]]] = []
        large: list[tuple[int, int]] = []
        pos = 0
        for entry in sorted(layout.entries, key=lambda e: e.offset):
            if entry.offset > pos:
                if entry.offset - pos < _SMALL_GAP:
                    small.append(np.arange(pos, entry.offset, dtype=np.int64))
                else:
                    large.append((pos, entry.offset))
            pos = max(pos, entry.offset + entry.nbytes)
        if pos < layout.stream_bytes:
            large.append((pos, layout.stream_bytes))
        plan = self._plans[id(buf)] = _Plan(
            buf=buf,
            entries=layout.entries,
            targets=targets,
            bytes=buf.numpy().data.cast("B"),
            small_gaps=np.concatenate(small) if small else np.zeros(0, dtype=np.int64),
            large_gaps=large,
        )
        return plan


class Hold:
    """One save's use of a :class:`StagingBuffer`, released once, by whichever comes first:
    the next user wanting the buffer once the fastest tier holds the shard (:meth:`offer`,
    :meth:`ShardBytes.switch`), the save's end, or its cancellation."""

    def __init__(self, buffer: StagingBuffer) -> None:
        self._buffer = buffer
        self._lock = threading.Lock()
        self._held = True
        self._offered = False

    @property
    def held(self) -> bool:
        return self._held

    @property
    def needed(self) -> bool:
        """Held and not offered: the save still needs the buffer (its fastest tier does
        not hold the shard yet), and the next save cannot have it."""
        return self._held and not self._offered

    def offer(self, give_back: Callable[[], None]) -> None:
        """Give the buffer back (``give_back``, then :meth:`release`) once someone wants
        it; until then the save keeps reading it (:meth:`StagingBuffer.offer`)."""
        with self._lock:
            if not self._held:
                return
            self._offered = True

        def back() -> None:
            try:
                give_back()
            finally:
                self.release()

        self._buffer.offer(back)

    def release(self) -> bool:
        """Give the buffer back; False if it was given back already."""
        with self._lock:
            if not self._held:
                return False
            self._held = False
        self._buffer.release()
        return True


class ShardBytes:
    """The staged stream as the tier writers read it: slices of the staging buffer until
    :meth:`switch` points every later read at a copy a tier holds (read back verified, as
    migration reads), so the buffer can take the next save while slower tiers still write.

    A reader slices under :meth:`reading` and keeps the slice no longer than that (a raw
    blob's payload is a view passed to the tier's write): :meth:`switch` returns once every
    reader that began on the buffer has ended.
    """

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._read: Callable[[int, int], Any] | None = None
        self._cond = threading.Condition()
        self._readers = 0  # readers that began while the buffer was the source
        self._local = threading.local()

    def __len__(self) -> int:
        return len(self._view)

    @property
    def switched(self) -> bool:
        return self._read is not None

    @contextmanager
    def reading(self) -> Iterator[None]:
        """A reader's lease on what it slices (nestable)."""
        depth = getattr(self._local, "depth", 0)
        counted = False
        if depth == 0:
            with self._cond:
                if self._read is None:
                    self._readers += 1
                    counted = True
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if counted:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._cond.notify_all()

    def __getitem__(self, span: slice) -> Any:
        read = self._read
        if read is None:
            return self._view[span]
        start = span.start or 0
        stop = len(self._view) if span.stop is None else span.stop
        return read(start, stop - start)

    def switch(self, read: Callable[[int, int], Any]) -> None:
        """From now on ``read(offset, length)`` gives the bytes; returns once no reader of
        the buffer is left (the buffer may then be released)."""
        with self._cond:
            self._read = read
            self._cond.wait_for(lambda: self._readers == 0)


# Gaps (alignment padding between entries) shorter than this are zeroed together by one
# indexed store per save; longer ones by a slice each.
_SMALL_GAP = 4096


@dataclass
class _Plan:
    """Where each entry of one layout goes in one buffer (see ``StagingBuffer._plan_for``)."""

    buf: Any  # the torch.Tensor the views below are of
    entries: tuple[Entry, ...]
    targets: list[Any]  # per entry: a typed view (tensor), a byte view, or None (empty)
    bytes: memoryview  # the whole buffer, for msgpack-encoded leaves
    small_gaps: np.ndarray[Any, np.dtype[np.int64]]  # every byte of the short gaps
    large_gaps: list[tuple[int, int]]

    def zero_gaps(self) -> None:
        """Zero the bytes between entries: others may have written there (a restore into
        this buffer, a save of another layout), and equal states must make equal chunks."""
        np.frombuffer(self.bytes, dtype=np.uint8)[self.small_gaps] = 0
        for start, end in self.large_gaps:
            self.buf[start:end].zero_()
