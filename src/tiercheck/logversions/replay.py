"""Replaying a log version: its optimizer steps run again from the full version it extends.

Given the optimizer with the base version's state loaded (parameters, optimizer state,
mirrors), :func:`replay` runs each logged step as the trainer did: set every parameter's
``.grad`` to the logged gradient, set the group options the step ran with, set what a
GradScaler handed a fused optimizer, and call the same ``optimizer.step()``; a step the
scaler skipped changed nothing in the optimizer and is passed over. Then the options as
they stood at save are set, mirrors are recomputed, and the fingerprints of everything
the replay must reproduce are compared with the ones recorded at save: the result is
either the saved state, bit for bit, or a :class:`~tiercheck.errors.ReplayMismatch`
naming the tensors that differ.

Before touching anything, :func:`check_replayable` compares the optimizer with the one the
log was written by (class, torch version, device type, implementation flags per group,
parameters and mirrors) and raises :class:`~tiercheck.errors.ReplayRefused` listing every
difference: another kernel would not reproduce the same bits.

The state's other leaves (scheduler, RNG, data loader, buffers, the GradScaler) are not
the replay's business: a log version stores them in full and the restore loads them.
If an :class:`~tiercheck.logversions.update_log.UpdateLog` is attached to the optimizer,
replay inside ``log.paused()`` and then ``log.invalidate(...)``: the state is restored, not trained.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercheck.core.entries import decode_scalar, torch_dtype
from tiercheck.core.sharded import is_dtensor, local_tensor
from tiercheck.errors import ReplayMismatch, ReplayRefused, StateError
from tiercheck.formats.manifest import GroupOptions, ReplayLog, SmallTensor
from tiercheck.logversions.fingerprint import differing, fingerprints
from tiercheck.logversions.update_log import (
    describe_optimizer,
    flat_params,
    mirror_specs,
    replayed_tensors,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "ReplayReport",
    "apply_options",
    "as_grad",
    "check_replayable",
    "replay",
    "small_tensor",
]


@dataclass(frozen=True)
class ReplayReport:
    """What a replay did: optimizer ``steps`` run, ``skipped`` steps passed over,
    ``verified`` fingerprints that matched (0 when not verified), ``seconds`` taken."""

    steps: int
    skipped: int
    verified: int
    seconds: float


def small_tensor(value: SmallTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor an inline :class:`SmallTensor` holds, on ``device``."""
    import torch

    dtype = torch_dtype(value.dtype)
    flat = torch.frombuffer(bytearray(value.data), dtype=torch.uint8) if value.data else None
    if flat is None:
        out = torch.empty(value.shape, dtype=dtype)
    else:
        out = flat.view(dtype).reshape(value.shape)
    return out.to(device)


def apply_options(optimizer: torch.optim.Optimizer, options: GroupOptions) -> None:
    """Set every param group's options to ``options`` (as captured by the update log).

    A tensor-valued option is copied into the group's existing tensor when there is one
    (a captured CUDA graph keeps pointing at it), and set as a new tensor otherwise.
    """
    import torch

    groups = decode_scalar("msgpack", options.packed, "param_groups", allow_pickle=False)
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ReplayRefused(
            f"the log has options for {len(groups) if isinstance(groups, list) else '?'} "
            f"param groups, the optimizer has {len(optimizer.param_groups)}"
        )
    for group, opts in zip(optimizer.param_groups, groups):
        for name, value in opts.items():
            group[name] = value
    for g, name, small in options.tensors:
        group = optimizer.param_groups[g]
        current = group.get(name)
        value = small_tensor(small)
        if isinstance(current, torch.Tensor) and current.shape == value.shape:
            current.copy_(value)
        else:
            group[name] = value


def check_replayable(
    optimizer: torch.optim.Optimizer,
    log: ReplayLog,
    mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> None:
    """Raise :class:`ReplayRefused` unless ``optimizer`` is the one ``log`` was written by."""
    impl = describe_optimizer(optimizer)
    diffs: list[str] = []

    def differ(what: str, saved: Any, now: Any) -> None:
        if saved != now:
            diffs.append(f"{what}: saved {saved!r}, now {now!r}")

    differ("optimizer", log.optimizer, impl.optimizer)
    differ("torch version", log.torch, impl.torch)
    differ("device type", log.device, impl.device)
    differ("number of param groups", len(log.flags), len(impl.flags))
    for g, (saved, now) in enumerate(zip(log.flags, impl.flags)):
        for key in sorted(set(saved) | set(now)):
            differ(f"group {g} {key}", saved.get(key), now.get(key))
    differ("number of parameters", len(log.params), len(impl.params))
    for i, (saved_p, now_p) in enumerate(zip(log.params, impl.params)):
        if saved_p != now_p:
            diffs.append(
                f"parameter {i}: saved group {saved_p.group} {saved_p.dtype}{list(saved_p.shape)}"
                f", now group {now_p.group} {now_p.dtype}{list(now_p.shape)}"
            )
    try:
        differ("mirrors", log.mirrors, mirror_specs(optimizer, tuple(mirrors)))
    except StateError as exc:
        diffs.append(f"mirrors: {exc}")
    if diffs:
        raise ReplayRefused(
            "cannot replay this log exactly, the optimizer differs from the one that wrote it: "
            + "; ".join(diffs)
            + ". Restore a full version, or run with the same optimizer settings and torch.",
            differences=tuple(diffs),
        )


def as_grad(logged: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The logged gradient ``logged`` as ``param``'s ``.grad``: on its device, widened bit
    for bit where it was logged narrowed (bfloat16 for a float32 parameter, SPEC.md
    section 12.3), and for a DTensor parameter (FSDP2) a DTensor of its layout whose
    local piece is ``logged``."""
    import torch

    local = local_tensor(param)
    if logged.dtype == torch.bfloat16 and local.dtype == torch.float32:
        words = torch.zeros(2 * logged.numel(), dtype=torch.int16)
        words[1::2] = logged.reshape(-1).view(torch.int16)
        logged = words.view(torch.float32).reshape(logged.shape)
    logged = logged.to(local.device)
    if not is_dtensor(param):
        return logged
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        logged,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _live_counter(optimizer: torch.optim.Optimizer) -> tuple[str, float | None]:
    import torch

    for i, (_, p) in enumerate(flat_params(optimizer)):
        st = optimizer.state.get(p)
        if st and "step" in st:
            value = st["step"]
            if isinstance(value, torch.Tensor):
                return f"state/{i}/step", float(value.item())
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return f"state/{i}/step", float(value)
            return f"state/{i}/step", None
    return "state/0/step", None


def replay(
    optimizer: torch.optim.Optimizer,
    log: ReplayLog,
    gradient: Callable[[int], torch.Tensor],
    *,
    mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    scaler: Any = None,
    verify: bool = True,
) -> ReplayReport:
    """Run ``log``'s steps on ``optimizer`` (holding the base's state) and verify the result.

    ``gradient(i)`` returns the tensor of the shard's entry ``i`` (any device; it becomes
    a ``.grad``, so the optimizer may read it and the caller must not reuse it).
    ``mirrors`` are the ``(master, copy)`` pairs given to the update log at save. A
    ``scaler`` gets the GradScaler state recorded at save. Raises
    :class:`ReplayRefused` (nothing changed) or :class:`ReplayMismatch` (the state is not
    the saved one; restore a full version into it).
    """
    t0 = time.perf_counter()
    pairs = tuple(mirrors)
    check_replayable(optimizer, log, pairs)
    params = [p for _, p in flat_params(optimizer)]
    run = skipped = 0
    try:
        for step in log.steps:
            if step.skipped:
                skipped += 1
                continue
            assert step.options is not None  # unpack_manifest guarantees it
            name, live = _live_counter(optimizer)
            if live != step.counter:
                raise ReplayMismatch(
                    f"logged step {step.index} ran with the optimizer's step counter at "
                    f"{step.counter}, the state replayed into has {live}: it is not the state "
                    "this log continues",
                    tensors=(name,),
                )
            apply_options(optimizer, step.options)
            for p, entry in zip(params, step.grads):
                p.grad = None if entry is None else as_grad(gradient(entry), p)
            device = params[0].device if params else "cpu"
            attrs = {k: small_tensor(v, device) for k, v in step.attrs.items()}
            for k, v in attrs.items():
                setattr(optimizer, k, v)
            try:
                optimizer.step()
            finally:
                for k in attrs:
                    delattr(optimizer, k)
            run += 1
    finally:
        for p in params:
            p.grad = None
    apply_options(optimizer, log.options)
    for master, copy in pairs:
        copy.detach().copy_(master.detach())
    if scaler is not None and log.scaler is not None:
        scaler.load_state_dict(dict(log.scaler))
    verified = 0
    if verify:
        verified = _verify(optimizer, log.fingerprints, pairs)
    return ReplayReport(run, skipped, verified, time.perf_counter() - t0)


def _verify(
    optimizer: torch.optim.Optimizer,
    expected: Mapping[str, Any],
    mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> int:
    algos = {name: fp.algo for name, fp in expected.items()}
    actual = fingerprints(replayed_tensors(optimizer, mirrors), algos)
    bad = differing(expected, actual)
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ReplayMismatch(
            f"the replay did not reproduce the saved state: {len(bad)} tensor(s) differ "
            f"({shown}). Something changed them outside optimizer.step() (an EMA, a manual "
            "edit), or the kernels differ; restore a full version instead",
            tensors=tuple(bad),
        )
    return len(expected)
