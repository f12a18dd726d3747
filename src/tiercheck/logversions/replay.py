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

**In a restore.** :func:`replay_version` runs a log version's steps on the guarded optimizer
(a :class:`~tiercheck.logversions.planner.LogSource`'s), which holds its base version's
state, and verifies the fingerprints; the restore then loads the log version's own leaves
(:func:`tiercheck.restore.loading.materialize` with the replayed tensors). A log version of
DTensor state saved by another number of ranks is replayed on the layout that saved it, one
rank's log at a time over copies of that rank's pieces of the base, and the verified pieces
are resharded into the guarded optimizer's tensors (:func:`replay_version_resharded`).
Without the training script, :func:`replay_offline` rebuilds a ``torch.optim`` optimizer
over copies of the base (``tiercheck export``, history reads).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from tiercheck.core.entries import decode_scalar, torch_dtype
from tiercheck.core.sharded import is_dtensor, local_tensor
from tiercheck.errors import ReplayMismatch, ReplayRefused, StateError
from tiercheck.formats.manifest import Entry, GroupOptions, ReplayLog, ShardManifest, SmallTensor
from tiercheck.logversions.fingerprint import differing, fingerprints
from tiercheck.logversions.update_log import (
    describe_optimizer,
    flat_params,
    mirror_specs,
    replayed_tensors,
)

if TYPE_CHECKING:
    import torch

    from tiercheck.logversions.planner import LogSource

__all__ = [
    "ReplayReport",
    "StoredEntry",
    "StoredVersion",
    "apply_options",
    "as_grad",
    "check_replayable",
    "gradients_of",
    "replay",
    "replay_offline",
    "replay_offline_leaves",
    "replay_resharded",
    "replay_version",
    "replay_version_resharded",
    "replayed_keys",
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


def gradients_of(manifest: ShardManifest, stream: memoryview) -> Callable[[int], torch.Tensor]:
    """``gradient(i)``: entry ``i`` of a log version's shard as a tensor over ``stream``."""
    import torch

    def gradient(i: int) -> torch.Tensor:
        e: Entry = manifest.entries[i]
        if not e.nbytes:
            return torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        raw = torch.frombuffer(stream[e.offset : e.offset + e.nbytes], dtype=torch.uint8)
        return raw.view(torch_dtype(e.dtype)).reshape(e.shape)

    return gradient


def replay_version(
    source: LogSource, manifest: ShardManifest, stream: memoryview
) -> tuple[ReplayReport, dict[str, Any]]:
    """Replay ``manifest``'s steps on the guarded optimizer (holding the base's state) and
    verify them; return the report and the replayed tensors by name. Raises
    :class:`~tiercheck.errors.ReplayRefused` or :class:`~tiercheck.errors.ReplayMismatch`."""
    assert manifest.log is not None
    with source.ulog.paused():
        try:
            report = replay(
                source.optimizer,
                manifest.log,
                gradients_of(manifest, stream),
                mirrors=source.mirrors,
                scaler=source.scaler,
            )
        except ReplayMismatch as exc:
            raise _by_state_key(exc, manifest.tree) from exc
    return report, replayed_tensors(source.optimizer, source.mirrors)


def _by_state_key(exc: ReplayMismatch, tree: Any) -> ReplayMismatch:
    """``exc`` naming the state's keys (``model/head.bias``) instead of the replayed
    tensors' names (``param/3``), where the version's tree maps them."""
    key_of = {name: key for key, name in replayed_keys(tree).items()}
    if not any(name in key_of for name in exc.tensors):
        return exc
    names = sorted((n for n in exc.tensors if n in key_of), key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(n) + r"(?![\w/])" for n in names))
    message = pattern.sub(lambda m: key_of[m.group(0)], str(exc))  # one pass
    return ReplayMismatch(message, tensors=tuple(key_of.get(n, n) for n in exc.tensors))


def replay_resharded(logs: Sequence[StoredVersion], live: Mapping[str, Any]) -> int:
    """Replay a log version saved by ``len(logs)`` ranks on the layout that saved it, then
    reshard: ``logs[r]`` is the version opened for rank ``r``. Each rank's steps are
    replayed over copies of its base's pieces (:func:`replay_offline_leaves` with
    ``pieces``) and verified against its fingerprints; then every tensor of ``live`` (the
    guarded optimizer's :func:`~tiercheck.logversions.update_log.replayed_tensors`, holding
    the base version on this rank's layout) gets its box from the replayed pieces. Returns
    the steps replayed (per rank).

    Writes only ``live``'s tensors, and only once every rank's replay verified. Raises
    :class:`~tiercheck.errors.ReplayRequired` where a replay cannot be done or does not
    verify, :class:`~tiercheck.errors.ReplayRefused` where the pieces do not cover a tensor.
    """
    import torch

    from tiercheck.core.sharded import box_of, copy_box, is_dtensor
    from tiercheck.errors import ReplayRefused

    # name -> [(offsets, piece)] of every rank, each distinct box once
    boxes: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    values: dict[str, Any] = {}
    steps = 0
    for v in logs:
        replayed = replay_offline_leaves(v, pieces=True)
        names = replayed_keys(v.manifest.tree)
        base = v.base_version
        assert base is not None  # replay_offline_leaves refuses a version without one
        bm = base.manifest
        placed = {bm.entries[i].key: p.offsets for i, p in bm.sharded.items()}
        for key, value in replayed.items():
            name = names[key]
            if not isinstance(value, torch.Tensor):
                values.setdefault(name, value)
                continue
            offsets = placed.get(key, (0,) * value.dim())
            found = boxes.setdefault(name, [])
            if all(o != offsets or p.shape != value.shape for o, p in found):
                found.append((offsets, value))
        rlog = v.manifest.log
        assert rlog is not None
        steps = sum(1 for s in rlog.steps if not s.skipped)
    targets: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
    for name, t in live.items():
        if not isinstance(t, torch.Tensor):
            continue
        if is_dtensor(t):
            local, offsets = box_of(t, name)
        else:
            local, offsets = t, (0,) * t.dim()
        targets.append((name, local, offsets))
        if name not in boxes:
            raise ReplayRefused(f"the ranks that saved the log replayed no {name}")
    staged = []
    for name, local, offsets in targets:
        fresh = torch.empty_like(local)
        covered = sum(copy_box(piece, at, fresh, offsets) for at, piece in boxes[name])
        if covered != local.numel():
            raise ReplayRefused(
                f"the pieces the ranks replayed cover {covered} of the {local.numel()} "
                f"elements of {name} here"
            )
        staged.append((local, fresh))
    with torch.no_grad():
        for local, fresh in staged:
            local.copy_(fresh)
    return steps


def replay_version_resharded(
    source: LogSource, logs: Sequence[StoredVersion]
) -> tuple[ReplayReport, dict[str, Any]]:
    """:func:`replay_version` for a log version saved on another layout (``logs``: the
    version opened for each rank that saved it): each rank's log is replayed on the
    layout that saved it, then resharded into the guarded optimizer's tensors
    (:func:`replay_resharded`). Returns the report and the replayed tensors by name."""
    import time

    t0 = time.perf_counter()
    live = replayed_tensors(source.optimizer, source.mirrors)
    steps = replay_resharded(logs, live)
    verified = sum(len(v.manifest.log.fingerprints) for v in logs if v.manifest.log is not None)
    report = ReplayReport(steps, 0, verified, time.perf_counter() - t0)
    return report, replayed_tensors(source.optimizer, source.mirrors)


def replayed_keys(tree: Any) -> dict[str, str]:
    """``{state key: replayed tensor name}`` of a log version's ``{"r": NAME}`` nodes."""
    out: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        ((tag, sub),) = node.items()
        if tag == "r":
            out[key] = sub
        elif tag == "o":
            walk(sub, key)
        elif tag == "d":
            for k, child in sub:
                walk(child, f"{key}/{k}" if key else str(k))
        elif tag in ("l", "t"):
            for i, child in enumerate(sub):
                walk(child, f"{key}/{i}" if key else str(i))

    walk(tree, "")
    return out


class StoredEntry(Protocol):
    """What an offline replay needs of an entry of a stored version."""

    @property
    def kind(self) -> str: ...

    @property
    def replayed(self) -> str | None: ...


class StoredVersion(Protocol):
    """A committed version as an offline replay reads it: a
    :class:`tiercheck.history.versions.Version` is one (history sits above this module)."""

    @property
    def id(self) -> int: ...

    @property
    def base(self) -> int | None: ...

    @property
    def manifest(self) -> ShardManifest: ...

    @property
    def entries(self) -> Mapping[str, StoredEntry]: ...

    @property
    def base_version(self) -> StoredVersion | None: ...

    def read(self, keys: Iterable[str]) -> dict[str, Any]: ...

    def read_stored(self, keys: Iterable[str]) -> dict[str, Any]: ...

    def read_pieces(self, keys: Iterable[str]) -> dict[str, Any]: ...


def replay_offline(version: StoredVersion) -> dict[str, Any]:
    """Every entry of log version ``version`` as its state held it, without the training
    script (see :func:`replay_offline_leaves`).

    Returns ``{key: value}`` for every tensor and scalar entry of the state (the replayed
    tensors, then the log version's own entries; pickled entries are left out). Raises
    :class:`~tiercheck.errors.ReplayRequired` where that cannot be done here.
    """
    out = replay_offline_leaves(version)
    own = [k for k, e in version.entries.items() if e.replayed is None and e.kind != "pickle"]
    out.update(version.read(own))
    return out


def replay_offline_leaves(version: StoredVersion, *, pieces: bool = False) -> dict[str, Any]:
    """The leaves log version ``version``'s replay reproduces, by state key, as its state
    held them, without the training script: a ``torch.optim`` optimizer of the class the
    log names is built over copies of the base version's parameters and optimizer state
    (its group options from the log), the logged steps are replayed and verified against
    the fingerprints. Tensors are detached, on the CPU.

    Raises :class:`~tiercheck.errors.ReplayRequired` where that cannot be done here (an
    optimizer outside ``torch.optim``, another torch version or device type, a base laid
    out differently) or where the replay does not reproduce the fingerprints (its cause,
    a :class:`~tiercheck.errors.ReplayMismatch`, names the tensors).

    ``pieces``: the version's rank's own pieces of its distributed tensors (FSDP2), replayed
    on the layout that logged them (the base's pieces of that rank), instead of whole
    tensors.
    """
    import importlib

    import torch

    from tiercheck.errors import ReplayMismatch, ReplayRefused, ReplayRequired

    m = version.manifest
    rlog = m.log
    base = version.base_version
    if rlog is None or base is None:
        raise ReplayRequired(
            f"version {version.id} is not a log version", version=version.id, base=version.base
        )

    def refuse(why: str) -> ReplayRequired:
        return ReplayRequired(
            f"version {version.id} is a log version that cannot be replayed without the "
            f"training script: {why}. To get its state, restore version {version.id} in the "
            "training script (ckpt.guard(optimizer); ckpt.restore(state)) and save it as a "
            f"full version (role='base'); or read or export its base, version {base.id}",
            version=version.id,
            base=base.id,
        )

    module, _, cls_name = rlog.optimizer.rpartition(".")
    if module != "torch.optim" and not module.startswith("torch.optim."):
        raise refuse(f"its optimizer {rlog.optimizer} is not one of torch.optim")
    cls = getattr(importlib.import_module(module), cls_name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise refuse(f"{rlog.optimizer} is not an optimizer of this torch")
    r_keys = replayed_keys(m.tree)
    key_of = {name: key for key, name in r_keys.items()}
    wanted = [key_of.get(f"param/{i}") for i in range(len(rlog.params))]
    state_keys = [k for n, k in key_of.items() if n.startswith("state/")]
    if None in wanted or not all(k in base.entries for k in [*wanted, *state_keys]):
        raise refuse(f"version {base.id} does not hold the replayed tensors under the same keys")
    prefix = state_keys[0].rsplit("/state/", 1)[0] if state_keys else None
    state_entries = [
        k for k in base.entries if prefix is not None and k.startswith(f"{prefix}/state/")
    ]
    read = base.read_pieces if pieces else base.read
    base_values = read([*(k for k in wanted if k is not None), *state_entries])
    params = [
        torch.nn.Parameter(base_values[k].clone(), requires_grad=True)
        for k in wanted
        if k is not None
    ]
    first = next((s.options for s in rlog.steps if s.options is not None), rlog.options)
    groups: list[dict[str, Any]] = [{"params": []} for _ in rlog.flags]
    for p, spec in zip(params, rlog.params):
        groups[spec.group]["params"].append(p)
    try:
        opt: torch.optim.Optimizer = cast(Any, cls)(groups)
    except (TypeError, ValueError) as exc:
        raise refuse(f"{rlog.optimizer} could not be built here ({exc})") from exc
    apply_options(opt, first)
    for key in state_entries:
        index, _, name = key[len(f"{prefix}/state/") :].partition("/")
        if not index.isdigit() or int(index) >= len(params) or "/" in name:
            continue
        value = base_values[key]
        opt.state[params[int(index)]][name] = (
            value.clone() if isinstance(value, torch.Tensor) else value
        )
    mirrors = []
    for j, (i, _) in enumerate(rlog.mirrors):
        mkey = key_of.get(f"mirror/{j}")
        if mkey is None or mkey not in base.entries:
            raise refuse(f"version {base.id} does not hold mirror {j}")
        mirrors.append((params[i], read([mkey])[mkey].clone()))
    grad_keys = {i: m.entries[i].key for s in rlog.steps for i in s.grads if i is not None}
    grads = version.read_stored(sorted(set(grad_keys.values())))
    try:
        replay(opt, rlog, lambda i: grads[grad_keys[i]], mirrors=mirrors)
    except ReplayRefused as exc:
        raise refuse(str(exc)) from exc
    except ReplayMismatch as exc:
        raise refuse(
            f"replaying it here did not reproduce the state saved ({exc}); a restore in the "
            "training script replays with the trainer's own optimizer, and loads the base "
            "if that does not verify either"
        ) from exc
    replayed = replayed_tensors(opt, mirrors)
    out: dict[str, Any] = {}
    for key, name in r_keys.items():
        value = replayed[name]
        out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    return out
