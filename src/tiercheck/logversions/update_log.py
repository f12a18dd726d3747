"""The update log: what the optimizer consumed at each step since the last full version.

A dense training step rewrites every parameter and every optimizer moment, so a differential
of the state is as large as the state. What the step *consumed* is smaller: the gradients
it read (after reduction, unscaling and clipping, in their dtype), the group options it ran
with (``lr``, ``betas``, ``weight_decay``... as they stood) and its step counters. Replaying
those through the same ``optimizer.step()`` from a full version reproduces the optimizer's
parameters and state bit for bit (:mod:`tiercheck.logversions.replay`); fingerprints of every
reproduced tensor, recorded here at save and checked after replay, make that a checked
fact. A version stored this way has the role ``log`` (SPEC.md section 12).

:class:`UpdateLog` captures. :meth:`UpdateLog.attach` installs an optimizer step pre-hook
that copies every gradient into a reused host buffer of a ring (pinned memory for CUDA
tensors, the copies queued on the tensor's own current stream so that they are ordered
before anything later on that stream can touch the gradient; the trainer waits only for
that copy) and records the options and counters; a step post-hook marks the step
complete. With a ``torch.amp.GradScaler`` attached too, a step the scaler skipped (it
found inf/nan and did not call ``optimizer.step()``) is logged as skipped, with the
scaler's state. A DTensor gradient (FSDP2) is logged as its local piece, and a float32
gradient whose every element is an exact bfloat16 value as bfloat16, bit for bit.

The engine's call sequence (the contract this module keeps):

1. ``attach(optimizer, scaler)`` once; nothing can be logged until the first full version.
2. At every full (base or diff) version: ``reset()`` before the next ``optimizer.step()``.
3. At a log version: ``status`` is ``None`` (else the reason it cannot be one), then
   ``take()`` before the next ``optimizer.step()``. It returns every step since the last
   ``reset()``, with the fingerprints of the state now; :func:`plan_log` lays them out as
   the gradient entries of the version's shard. ``release(taken)`` when the buffers have
   been written (until then the ring does not reuse them).
4. After a restore: ``reset()`` if a full version was restored (the state is that
   version's), ``invalidate(reason)`` otherwise; replay inside ``paused()``.

Memory is bounded: the ring holds the gradients of the steps since the last full version,
in buffers reused from one full version to the next, at most ``max_bytes`` of them; a step
that would exceed it makes the log unusable (``status`` says so) until the next
``reset()``, so the next version must be a full one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tiercheck.core.chunking import ALIGN, cut_windows
from tiercheck.core.entries import Leaf, tensor_place, torch_dtype
from tiercheck.core.sharded import local_tensor
from tiercheck.errors import StateError
from tiercheck.formats.manifest import (
    Entry,
    Fingerprint,
    GroupOptions,
    LogStep,
    ParamSpec,
    ReplayLog,
    SmallTensor,
)
from tiercheck.logversions.capture import (
    Copies,
    Deferred,
    GradSlot,
    OptionsCapture,
    Ring,
    capture_group_options,
    capture_options,
    capture_scaler,
    copy_grads,
    dtype_name,
    narrowable,
    resolve_scaler,
    round_up,
    slot_bytes,
    step_counter,
)
from tiercheck.logversions.fingerprint import fingerprints

if TYPE_CHECKING:
    import torch

__all__ = [
    "IMPLEMENTATION_FLAGS",
    "CapturedStep",
    "GradSlot",
    "Implementation",
    "LogLayout",
    "LoggedSteps",
    "UpdateLog",
    "describe_optimizer",
    "estimate_replay_seconds",
    "flat_params",
    "mirror_specs",
    "plan_log",
    "replayed_leaves",
    "replayed_tensors",
]

# Group options that select the optimizer's kernel: a replay must run the same ones.
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")

# Attributes torch.amp.GradScaler sets on an optimizer that unscales inside its own step
# (fused Adam/AdamW/SGD) for the length of the call.
_STEP_ATTRS = ("grad_scale", "found_inf")

# Throughput assumed by estimate_replay_seconds for what it cannot measure: moving the
# logged gradients to the device, and fingerprinting the state after the replay.
_H2D_BYTES_PER_S = 10e9
_VERIFY_BYTES_PER_S = 5e9


# --- describing an optimizer ------------------------------------------------------------


def flat_params(optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor]]:
    """``(group, param)`` of every parameter, in ``optimizer.state_dict()`` order."""
    return [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]


@dataclass(frozen=True)
class Implementation:
    """What a replay pins: the optimizer class, the torch version, the device type(s) of
    the parameters, the implementation flags of each param group, and the parameters."""

    optimizer: str
    torch: str
    device: str
    flags: tuple[Mapping[str, Any], ...]
    params: tuple[ParamSpec, ...]


def describe_optimizer(optimizer: torch.optim.Optimizer) -> Implementation:
    """The :class:`Implementation` of ``optimizer`` as it is now."""
    import torch

    cls = type(optimizer)
    params = flat_params(optimizer)
    devices = sorted({p.device.type for _, p in params}) or ["cpu"]
    flags = tuple(
        {k: group[k] for k in IMPLEMENTATION_FLAGS if k in group}
        for group in optimizer.param_groups
    )
    # a DTensor's (FSDP2) local piece: what this rank's log holds gradients of
    specs = tuple(
        ParamSpec(g, dtype_name(p), tuple(int(d) for d in local_tensor(p).shape)) for g, p in params
    )
    return Implementation(
        f"{cls.__module__}.{cls.__qualname__}", torch.__version__, ",".join(devices), flags, specs
    )


def replayed_tensors(
    optimizer: torch.optim.Optimizer, mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
) -> dict[str, Any]:
    """Everything a replay reproduces, by fingerprint name.

    ``param/I`` (parameter ``I`` in state-dict order), ``state/I/NAME`` (each value of the
    optimizer's state for it, tensor or not) and ``mirror/J`` (the copy of mirror pair
    ``J``). The engine matches state leaves to these tensors by storage to leave them out
    of a log version.
    """
    out: dict[str, Any] = {}
    params = flat_params(optimizer)
    for i, (_, p) in enumerate(params):
        out[f"param/{i}"] = p
    for i, (_, p) in enumerate(params):
        for name, value in optimizer.state.get(p, {}).items():
            out[f"state/{i}/{name}"] = value
    for j, (_, copy) in enumerate(mirrors):
        out[f"mirror/{j}"] = copy
    return out


def replayed_leaves(leaves: Sequence[Leaf], replayed: Mapping[str, Any]) -> dict[str, str]:
    """``{leaf key: name}`` for every tensor leaf that is one of the ``replayed`` tensors
    (:func:`replayed_tensors`): same device, data pointer, dtype and shape.

    ``module.state_dict()`` and ``optimizer.state_dict()`` hand out tensors sharing
    storage with the live ones, so this finds the leaves of a flattened state that a log
    version leaves out (SPEC.md section 12.3: they become ``{"r": name}`` nodes).
    """
    import torch

    by_ident = {
        tensor_place(local_tensor(v)): name
        for name, v in replayed.items()
        if isinstance(v, torch.Tensor) and local_tensor(v).numel() > 0
    }
    out: dict[str, str] = {}
    for leaf in leaves:
        if leaf.kind == "tensor" and leaf.value.numel() > 0:
            name = by_ident.get(tensor_place(leaf.value))
            if name is not None:
                out[leaf.key] = name
    return out


def mirror_specs(
    optimizer: torch.optim.Optimizer, mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[tuple[int, str], ...]:
    """``(parameter index, dtype)`` of each ``(master, copy)`` pair; refuses bad pairs."""
    index = {id(p): i for i, (_, p) in enumerate(flat_params(optimizer))}
    out = []
    for master, copy in mirrors:
        i = index.get(id(master))
        if i is None:
            raise StateError("a mirror's master tensor is not a parameter of the optimizer")
        if tuple(copy.shape) != tuple(master.shape):
            raise StateError(
                f"a mirror of shape {tuple(copy.shape)} cannot mirror parameter {i} of shape "
                f"{tuple(master.shape)}"
            )
        out.append((i, dtype_name(copy)))
    return tuple(out)


# --- what take() hands out ------------------------------------------------------------


@dataclass(frozen=True)
class CapturedStep:
    """One logged step. ``data`` holds its gradients at 64-byte-aligned offsets with zero
    padding (the layout of one segment of a log version's stream, SPEC.md section 12.3);
    it is empty for a skipped step. ``seconds`` is how long the optimizer step took."""

    index: int
    skipped: bool
    grads: tuple[GradSlot | None, ...]
    data: memoryview
    options: GroupOptions | None
    attrs: Mapping[str, SmallTensor]
    counter: float | None
    scaler: Mapping[str, Any] | None
    seconds: float

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class LoggedSteps:
    """Every step since the last full version, and what the state is now.

    The buffers behind ``steps[i].data`` stay untouched until ``UpdateLog.release(self)``.
    ``options`` and ``scaler`` are the group options and GradScaler state at ``take()``;
    ``fingerprints`` those of :func:`replayed_tensors` then (empty after
    ``take(fingerprint=False)``: see :meth:`with_fingerprints`).
    """

    steps: tuple[CapturedStep, ...]
    impl: Implementation
    mirrors: tuple[tuple[int, str], ...]
    options: GroupOptions
    scaler: Mapping[str, Any] | None
    fingerprints: Mapping[str, Fingerprint] = field(default_factory=dict)
    lease: int = 0

    @property
    def nbytes(self) -> int:
        """Gradient bytes of all steps (what a log version stores besides the leaves)."""
        return sum(s.nbytes for s in self.steps)

    def with_fingerprints(self, fps: Mapping[str, Fingerprint]) -> LoggedSteps:
        """A copy carrying ``fps``, computed by the caller (e.g. on a background thread
        while the guard holds the next step back) with :func:`tiercheck.logversions.fingerprint.
        fingerprints` over :func:`replayed_tensors`."""
        return replace(self, fingerprints=dict(fps))


def estimate_replay_seconds(logged: LoggedSteps, state_bytes: int = 0) -> float:
    """How long replaying ``logged`` should take: the optimizer steps as timed at capture,
    moving the gradients to the device, and fingerprinting ``state_bytes`` of state."""
    seconds = sum(s.seconds for s in logged.steps)
    if logged.impl.device != "cpu":
        seconds += logged.nbytes / _H2D_BYTES_PER_S
    return seconds + state_bytes / _VERIFY_BYTES_PER_S


# --- laying a log out in a shard's stream ------------------------------------------------


@dataclass(frozen=True)
class LogLayout:
    """The gradient part of a log version's stream (SPEC.md section 12.3).

    ``entries`` are the gradient entries in stream order; ``windows`` the chunk windows
    over ``[0, end)``; ``segments`` the ``(stream offset, bytes)`` of each step's data, to
    hash and write; ``end`` is where the state's leaves start (a cut point). ``replay``
    refers to gradients by their index in ``entries``, so the leaf entries go after them.
    """

    entries: tuple[Entry, ...]
    windows: tuple[tuple[int, int], ...]
    segments: tuple[tuple[int, memoryview], ...]
    end: int
    replay: ReplayLog


def plan_log(logged: LoggedSteps, chunk_size: int) -> LogLayout:
    """Lay the logged steps out as the first part of a log version's stream.

    Each step's data is one segment, starting at a cut point, so its chunks are the same
    in every later log version that repeats the step, and on every data-parallel rank
    whose gradients are the same: they are stored once.
    """
    if chunk_size < ALIGN or chunk_size % ALIGN:
        raise ValueError(f"chunk_size must be a positive multiple of {ALIGN}, got {chunk_size}")
    entries: list[Entry] = []
    segments: list[tuple[int, memoryview]] = []
    steps: list[LogStep] = []
    cuts: set[int] = {0}
    pos = 0
    for step in logged.steps:
        cuts.add(pos)
        grads: list[int | None] = []
        for i, slot in enumerate(step.grads):
            if slot is None:
                grads.append(None)
                continue
            grads.append(len(entries))
            key = f"/log/{step.index}/{i}"
            offset = pos + slot.offset
            entries.append(Entry(key, "tensor", slot.dtype, slot.shape, offset, slot.nbytes))
        if step.nbytes:
            segments.append((pos, step.data))
        steps.append(
            LogStep(
                index=step.index,
                skipped=step.skipped,
                grads=tuple(grads),
                options=step.options,
                attrs=step.attrs,
                counter=step.counter,
                scaler=step.scaler,
            )
        )
        pos = round_up(pos + step.nbytes, ALIGN)
    replay = ReplayLog(
        optimizer=logged.impl.optimizer,
        torch=logged.impl.torch,
        device=logged.impl.device,
        flags=logged.impl.flags,
        params=logged.impl.params,
        mirrors=logged.mirrors,
        steps=tuple(steps),
        options=logged.options,
        fingerprints=dict(logged.fingerprints),
        scaler=logged.scaler,
    )
    windows = cut_windows(cuts, pos, chunk_size)
    return LogLayout(tuple(entries), windows, tuple(segments), pos, replay)


# --- capture ------------------------------------------------------------------------------


@dataclass
class _Step:
    """A step as the hooks record it; small device values are read at take()."""

    index: int
    skipped: bool
    grads: tuple[GradSlot | None, ...] = ()
    buffer: torch.Tensor | None = None
    nbytes: int = 0
    options: OptionsCapture | None = None
    attrs: dict[str, Deferred] = field(default_factory=dict)
    counter: Deferred | float | None = None
    scaler: dict[str, Deferred] | None = None
    started: float = 0.0
    seconds: float = 0.0
    # the CUDA copies of the gradients: they have landed when their events complete
    copied: Copies = field(default_factory=Copies)
    # (device, event before the step, event after it): the step's time on the device
    timing: tuple[Any, Any, Any] | None = None

    def wait_copies(self) -> None:
        self.copied.wait()


def _structure(optimizer: Any) -> tuple[tuple[int, ...], ...]:
    """Which parameters the optimizer steps, group by group (by identity)."""
    return tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups)


def _versions(optimizer: Any) -> dict[str, tuple[int, int]]:
    """``{name: (id, version counter)}`` of every tensor a replay reproduces but the
    mirrors (which the trainer writes): any in-place write bumps a tensor's counter."""
    import torch

    out: dict[str, tuple[int, int]] = {}
    for name, t in replayed_tensors(optimizer).items():
        if isinstance(t, torch.Tensor):
            local = local_tensor(t)
            out[name] = (id(local), local._version)
    return out


class UpdateLog:
    """Captures the optimizer's inputs at every step, into a ring of reused host buffers.

    ``max_bytes`` bounds the host memory of the ring (the gradients of the steps since
    the last full version, and buffers kept for reuse); ``None`` leaves it unbounded.
    See the module docstring for the call sequence.
    """

    def __init__(self, *, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self._ring = Ring(max_bytes)
        self._lock = threading.Lock()
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler: Any = None
        self._mirrors: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        self._handles: list[Any] = []
        self._steps: list[_Step] = []
        self._open: _Step | None = None
        self._calls = 0
        self._paused = 0
        self._unusable: str | None = "no full version has been saved since the log was attached"
        self._leases: dict[int, list[torch.Tensor]] = {}
        self._leased: dict[int, int] = {}  # id(buffer) -> how many leases hold it
        self._next_lease = 1
        self._capturing = True  # off: steps are counted, not captured (set_capture)
        self._seen = 0  # optimizer steps seen (captured or not), replays excepted
        self._structure: tuple[tuple[int, ...], ...] = ()  # the parameters at reset()
        self._versions: dict[str, tuple[int, int]] = {}  # after the last step or reset()
        self._edited: tuple[str, ...] = ()  # found written outside a step since reset()
        # the parameters and version counters when the state was last read for a save
        # (optimizer.state_dict(), on the trainer's thread): what reset() logs from
        self._at_read: tuple[tuple[tuple[int, ...], ...], dict[str, tuple[int, int]]] | None = None

    @property
    def max_bytes(self) -> int | None:
        return self._ring.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        self._ring.max_bytes = value

    # --- installing ---------------------------------------------------------------------

    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        *,
        mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        """Log every ``optimizer.step()`` from now on.

        ``scaler`` (a ``torch.amp.GradScaler``) lets a step it skips be logged as skipped.
        ``mirrors`` are ``(master, copy)`` pairs where the trainer keeps ``copy`` equal to
        the parameter ``master`` cast to ``copy``'s dtype after every step (bf16 weights
        of fp32 master weights); the replay recomputes them and the fingerprints cover
        them, so a log version need not store them.
        """
        if self._optimizer is not None:
            raise StateError("this UpdateLog is already attached to an optimizer; detach first")
        pairs = tuple(mirrors)
        mirror_specs(optimizer, pairs)  # refuse bad pairs before hooking anything
        self._optimizer = optimizer
        self._mirrors = pairs
        self._handles = [
            optimizer.register_step_pre_hook(self._pre_hook),
            optimizer.register_step_post_hook(self._post_hook),
            optimizer.register_state_dict_post_hook(self._state_dict_hook),
        ]
        if scaler is not None:
            self._wrap_scaler(scaler)
        with self._lock:
            self._unusable = "no full version has been saved since the log was attached"

    def detach(self) -> None:
        """Remove the hooks (and the scaler wrapper). Captured steps are dropped."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._scaler is not None and "step" in vars(self._scaler):
            del self._scaler.step
        self._scaler = None
        self._optimizer = None
        self._mirrors = ()
        with self._lock:
            self._drop_steps()
            self._unusable = "the log is not attached to an optimizer"

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    @property
    def mirrors(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return self._mirrors

    def _wrap_scaler(self, scaler: Any) -> None:
        orig = scaler.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            calls = self._calls
            out = orig(optimizer, *args, **kwargs)
            if optimizer is self._optimizer and self._calls == calls and scaler.is_enabled():
                self._record_skipped(scaler)
            return out

        scaler.step = step  # an instance attribute, deleted by detach()
        self._scaler = scaler

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Steps taken inside (a replay) are neither logged nor counted as skipped."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    # --- what the engine reads -----------------------------------------------------------

    @property
    def status(self) -> str | None:
        """``None`` if a log version can be taken now; otherwise why not."""
        with self._lock:
            if self._optimizer is None:
                return "the log is not attached to an optimizer"
            if self._open is not None:
                return "an optimizer step has not finished"
            if self._unusable is None and _structure(self._optimizer) != self._structure:
                return (
                    "the optimizer's parameters changed since the last full version (a param "
                    "group added or removed)"
                )
            return self._unusable

    def edited(self) -> tuple[str, ...]:
        """Names (:func:`replayed_tensors`) of the tensors written since the last logged
        step or :meth:`reset` other than by ``optimizer.step()`` (a clamp, a manual
        edit, a replaced tensor): no replay can reproduce them. Read from the tensors'
        version counters, so an edit through ``.data`` is not seen (the fingerprints
        catch that at restore)."""
        with self._lock:
            if self._edited or self._optimizer is None or self._unusable is not None:
                return self._edited
            now = self._at_read[1] if self._at_read is not None else _versions(self._optimizer)
            before = self._versions
        return tuple(name for name, v in before.items() if now.get(name, v) != v)

    @property
    def steps_seen(self) -> int:
        """Optimizer steps seen since :meth:`attach`, captured or not (replays excepted)."""
        with self._lock:
            return self._seen

    @property
    def capturing(self) -> bool:
        """Whether steps are captured (see :meth:`set_capture`)."""
        with self._lock:
            return self._capturing

    def prepare(self, steps: int = 1) -> None:
        """Allocate ring buffers for ``steps`` steps of gradients of every parameter now
        (page-locked for CUDA parameters), so that no step allocates them."""
        import torch

        with self._lock:
            if self._optimizer is None:
                return
            params = [local_tensor(p) for _, p in flat_params(self._optimizer)]
            pinned = torch.cuda.is_available() and any(p.device.type == "cuda" for p in params)
            need = slot_bytes(params)
            if need:
                self._ring.reserve(need, pinned, steps)

    @property
    def steps_since_reset(self) -> int:
        with self._lock:
            return len(self._steps)

    @property
    def bytes_since_reset(self) -> int:
        """Gradient bytes a log version taken now would hold (no device sync)."""
        with self._lock:
            return sum(s.nbytes for s in self._steps)

    @property
    def held_bytes(self) -> int:
        """Host memory the ring holds (buffers in use, leased and kept for reuse)."""
        with self._lock:
            return self._ring.held_bytes

    # --- the engine's calls --------------------------------------------------------------

    def reset(self, *, capture: bool = True, reason: str = "") -> None:
        """The state as it is now has been saved as a full version: log from here.

        ``capture=False`` (with the ``reason``) logs nothing until the next ``reset``:
        the steps are counted (:attr:`steps_seen`) but their gradients not copied, for a
        cycle in which no log version could be cheaper than a full one."""
        with self._lock:
            self._drop_steps()
            if self._optimizer is None:
                return
            self._capturing = capture
            self._unusable = None if capture else reason or "capture is off"
            # the state saved is the one read for the save, which the trainer may have
            # changed since (a param group added, a clamp) without a step
            at_read, self._at_read = self._at_read, None
            if at_read is None:
                at_read = (_structure(self._optimizer), _versions(self._optimizer))
            self._structure, self._versions = at_read
            self._edited = ()

    def invalidate(self, reason: str) -> None:
        """The state changed other than by a logged step (a restore, a replay): no log
        version until the next :meth:`reset`."""
        with self._lock:
            self._drop_steps()
            self._unusable = reason

    def take(self, *, fingerprint: bool = True) -> LoggedSteps:
        """Every step since the last :meth:`reset`, for a log version of the state now.

        Call it between steps, before the next ``optimizer.step()``. Waits for gradient
        copies still in flight. With ``fingerprint``, the fingerprints of every tensor the
        replay must reproduce are computed here, on their devices. Raises
        :class:`StateError` when :attr:`status` says no log version can be taken.
        """
        reason = self.status
        if reason is not None:
            raise StateError(f"no log version can be taken now: {reason}")
        optimizer = self._optimizer
        assert optimizer is not None
        with self._lock:
            steps = list(self._steps)
            lease = self._next_lease
            self._next_lease += 1
            buffers = [s.buffer for s in steps if s.buffer is not None]
            self._leases[lease] = buffers
            for b in buffers:
                self._leased[id(b)] = self._leased.get(id(b), 0) + 1
        logged = LoggedSteps(
            steps=tuple(_finish(s) for s in steps),
            impl=describe_optimizer(optimizer),
            mirrors=mirror_specs(optimizer, self._mirrors),
            options=capture_options(optimizer),
            scaler=None if self._scaler is None else dict(self._scaler.state_dict()) or None,
            lease=lease,
        )
        if fingerprint:
            fps = fingerprints(replayed_tensors(optimizer, self._mirrors))
            logged = logged.with_fingerprints(fps)
        return logged

    def release(self, logged: LoggedSteps) -> None:
        """The caller is done with ``logged``'s buffers; the ring may reuse them."""
        with self._lock:
            current = {id(s.buffer) for s in self._steps if s.buffer is not None}
            for b in self._leases.pop(logged.lease, []):
                left = self._leased[id(b)] - 1
                if left:
                    self._leased[id(b)] = left
                    continue
                del self._leased[id(b)]
                if id(b) not in current:
                    self._ring.put(b)

    # --- the hooks (trainer thread) ---------------------------------------------------------

    def _fail(self, reason: str) -> None:
        """The log can no longer reproduce the state: drop it until the next reset."""
        if self._unusable is None:
            self._unusable = reason
        try:
            self._drop_steps()
        except Exception:  # a device error while waiting for copies: drop them anyway
            self._steps = []
            self._open = None

    def _drop_steps(self) -> None:
        steps, self._steps, self._open = self._steps, [], None
        for s in steps:
            s.wait_copies()  # a buffer goes back to the ring only once nothing writes it
            if s.buffer is not None and id(s.buffer) not in self._leased:
                self._ring.put(s.buffer)

    # The hooks run inside optimizer.step(): they never raise into it. Whatever cannot be
    # captured makes the log unusable, so the next version is a full one.

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            if self._paused:
                return
            self._calls += 1
            self._seen += 1
            try:
                self._capture(optimizer, args, kwargs)
            except Exception as exc:
                self._fail(f"a step could not be captured ({type(exc).__name__}: {exc})")

    def _capture(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        import torch

        if self._open is not None:
            self._fail("an optimizer step raised before it finished")
        if self._unusable is not None:
            return
        if len(args) > 1 or kwargs:  # args[0] is the optimizer itself
            self._fail("optimizer.step() was called with a closure or arguments")
            return
        if _structure(optimizer) != self._structure:
            self._fail(
                "the optimizer's parameters changed since the last full version (a param "
                "group added or removed)"
            )
            return
        now = _versions(optimizer)
        edited = tuple(n for n, v in self._versions.items() if now.get(n, v) != v)
        if edited:
            self._edited = edited
            self._fail(f"{edited[0]} was written outside optimizer.step()")
            return
        try:
            options = capture_group_options(optimizer)
        except (StateError, TypeError) as exc:
            self._fail(f"a param group option cannot be logged ({exc})")
            return
        grads: list[tuple[torch.Tensor, GradSlot] | None] = []
        pos = 0
        devices: set[torch.device] = set()
        for _, p in flat_params(optimizer):
            if p.grad is None:
                grads.append(None)
                continue
            g = local_tensor(p.grad)  # a DTensor's (FSDP2): this rank's piece
            if g.layout != torch.strided:
                self._fail("a gradient is sparse; only dense gradients can be logged")
                return
            if tuple(g.shape) != tuple(local_tensor(p).shape):
                self._fail("a gradient's shape is not its parameter's")
                return
            pos = round_up(pos, ALIGN)
            dtype = "bfloat16" if narrowable(g) else dtype_name(g)
            n = g.numel() * torch_dtype(dtype).itemsize
            shape = tuple(int(d) for d in g.shape)
            grads.append((g, GradSlot(pos, n, dtype, shape)))
            if g.device.type == "cuda":
                devices.add(g.device)
            pos += n
        buf = self._ring.get(pos, bool(devices)) if pos else None
        if pos and buf is None:
            self._fail(f"the steps since the last full version outgrew max_bytes={self.max_bytes}")
            return
        step = _Step(
            index=len(self._steps),
            skipped=False,
            grads=tuple(None if g is None else g[1] for g in grads),
            buffer=buf,
            nbytes=pos,
            options=options,
            attrs={
                name: Deferred(value)
                for name in _STEP_ATTRS
                if isinstance(value := getattr(optimizer, name, None), torch.Tensor)
            },
            counter=step_counter(optimizer),
            scaler=None if self._scaler is None else capture_scaler(self._scaler),
        )
        if devices:
            dev = min(devices, key=str)
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(torch.cuda.current_stream(dev))
            step.timing = (dev, start, None)
        if buf is not None:
            step.copied = copy_grads(buf, grads)
            if step.copied and _writes_grads(optimizer):
                step.copied.fence()  # the step itself may write a gradient: copy first
        self._steps.append(step)
        self._open = step
        step.started = time.perf_counter()

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        import torch

        with self._lock:
            step = self._open
            if self._paused or step is None:
                return
            try:
                step.seconds = time.perf_counter() - step.started
                # work queued after the step (zero_grad, the next backward) waits for the
                # copies: it may write the gradients
                step.copied.fence()
                if step.timing is not None:
                    device, start, _ = step.timing
                    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    end.record(torch.cuda.current_stream(device))
                    step.timing = (device, start, end)
                self._open = None
                self._versions = _versions(optimizer)
            except Exception as exc:
                self._fail(f"a step could not be captured ({type(exc).__name__}: {exc})")

    def _state_dict_hook(self, optimizer: Any, state_dict: Any) -> None:
        with self._lock:
            if self._paused or self._optimizer is None:
                return
            try:
                self._at_read = (_structure(optimizer), _versions(optimizer))
            except Exception:  # never into state_dict(): reset() reads the tensors then
                self._at_read = None

    def _record_skipped(self, scaler: Any) -> None:
        with self._lock:
            if self._paused:
                return
            self._seen += 1
            if self._unusable is not None:
                return
            try:
                step = _Step(index=len(self._steps), skipped=True, scaler=capture_scaler(scaler))
            except Exception as exc:
                self._fail(f"a skipped step could not be logged ({type(exc).__name__}: {exc})")
                return
            self._steps.append(step)


def _writes_grads(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` may write its gradients in place: a fused kernel
    handed a GradScaler's scale unscales them there."""
    return any(group.get("fused") for group in optimizer.param_groups) or any(
        getattr(optimizer, name, None) is not None for name in _STEP_ATTRS
    )


def _finish(step: _Step) -> CapturedStep:
    """The host-side view of ``step``, once its copies have landed."""
    step.wait_copies()
    seconds = step.seconds
    if step.timing is not None and step.timing[2] is not None:
        _, start, end = step.timing
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000.0
    if step.buffer is None:
        data = memoryview(b"")
    else:
        data = step.buffer[: step.nbytes].numpy().data.cast("B")
    counter = step.counter
    if isinstance(counter, Deferred):
        counter = float(counter.value.cpu().item())
    return CapturedStep(
        index=step.index,
        skipped=step.skipped,
        grads=step.grads,
        data=data,
        options=None if step.options is None else step.options.get(),
        attrs={k: v.get() for k, v in step.attrs.items()},
        counter=counter,
        scaler=resolve_scaler(step.scaler),
        seconds=seconds,
    )
