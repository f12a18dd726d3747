"""Log versions in the engine: when a save becomes one, how it is laid out, how it restores.

The capture (:mod:`tiercheck.logversions.update_log`), the format (SPEC.md section 12) and
the replay (:mod:`tiercheck.logversions.replay`) exist on their own; this module joins them
to the save pipeline and the restore.

**Saving.** ``Checkpointer.guard(optimizer, scaler)`` attaches an
:class:`~tiercheck.logversions.update_log.UpdateLog` to the optimizer through a :class:`LogSource`.
Every save of the store is then planned on the pipeline thread, in order, while the guard
holds the trainer's next ``optimizer.step()`` (so the log and the state agree):
:meth:`LogSource.propose` says whether the save can be a log version of the steps since
the last full version, by :func:`choose` (bytes and the estimated replay time); a full
version (base or diff) resets the log. A log version's shard is laid out by
:func:`build`: the logged gradients first, then the state's leaves that a replay does not
reproduce; the replayed ones become ``{"r": NAME}`` nodes of the tree. From there the
save pipeline (hash, 2PC, every tier) is the one of any version.

**Restoring.** :func:`replay_version` runs a log version's steps on the guarded optimizer,
which holds its base version's state, and verifies the fingerprints; the restore then
loads the log version's own leaves (:func:`tiercheck.restore.loading.materialize` with the
replayed tensors). A log version of DTensor state saved by another number of ranks is
replayed on the layout that saved it, one rank's log at a time over copies of that rank's
pieces of the base, and the verified pieces are resharded into the guarded optimizer's
tensors (:func:`replay_version_resharded`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

from tiercheck.core.chunking import Layout, plan_layout
from tiercheck.core.entries import Leaf, torch_dtype
from tiercheck.formats.manifest import Entry, ReplayLog, ShardManifest
from tiercheck.logversions.fingerprint import fingerprints
from tiercheck.logversions.replay import ReplayReport, replay
from tiercheck.logversions.update_log import (
    LoggedSteps,
    UpdateLog,
    estimate_replay_seconds,
    plan_log,
    replayed_leaves,
    replayed_tensors,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DENSE_FRACTION",
    "LogProposal",
    "LogSource",
    "LogVersion",
    "build",
    "choose",
    "gradients_of",
    "replay_offline",
    "replay_offline_leaves",
    "replay_resharded",
    "replay_version",
    "replay_version_resharded",
    "replayed_keys",
    "with_fingerprints",
]

log = logging.getLogger(__name__)

# A full version taken while the optimizer is logged is a base, not a diff, when at least
# this fraction of the replayed bytes changed since the last full version: a diff of a
# dense state stores every chunk anyway, and a base keeps restores one level deep.
DENSE_FRACTION = 0.9


@dataclass(frozen=True)
class LogProposal:
    """What a log version of the state now would cost, or why there can be none.

    ``reason`` is None when the save may be a log version. ``changed_bytes`` estimates
    what a diff would store of the replayed tensors (those of parameters that had a
    gradient in some logged step), ``replayed_bytes`` what a base stores of them.
    """

    reason: str | None
    logged: LoggedSteps | None = None
    replayed: Mapping[str, str] | None = None
    new_bytes: int = 0
    log_bytes: int = 0
    changed_bytes: int = 0
    replayed_bytes: int = 0
    replay_seconds: float = 0.0

    @property
    def dense(self) -> bool:
        """Whether a diff of the state now would store about as much as a base."""
        return (
            self.replayed_bytes > 0 and self.changed_bytes >= DENSE_FRACTION * self.replayed_bytes
        )


def choose(
    *,
    new_bytes: int,
    log_bytes: int,
    changed_bytes: int,
    replayed_bytes: int,
    replay_seconds: float,
    max_replay_seconds: float,
) -> str | None:
    """None if a log version is the cheaper choice, else why a full version is.

    A log version stores the steps no earlier log version of the same base stored
    (``new_bytes``: earlier steps are the same chunks); a diff stores what changed
    (``changed_bytes``). A restore reads and replays every step since the base
    (``log_bytes``, ``replay_seconds``): once that costs more than reading a base of the
    replayed tensors, or takes longer than ``max_replay_seconds``, the next version is full.
    """
    if log_bytes > replayed_bytes:
        return (
            f"the log since the last full version ({log_bytes} bytes) outgrew the state it "
            f"replaces ({replayed_bytes} bytes)"
        )
    if replay_seconds > max_replay_seconds:
        return (
            f"replaying the log would take about {replay_seconds:.1f} s, more than "
            f"max_replay_seconds={max_replay_seconds}"
        )
    if new_bytes >= changed_bytes:
        return f"a diff is cheaper ({changed_bytes} bytes changed, {new_bytes} logged)"
    return None


class LogSource:
    """The update log of one store's guarded optimizer, and the full version it extends.

    Used on the save pipeline thread while the guard holds the trainer (plus ``attach``
    from ``guard()`` and ``invalidate`` from a restore, on the trainer's thread).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        self.ulog = UpdateLog()
        self.ulog.attach(optimizer, scaler, mirrors=mirrors)
        self.scaler = scaler
        self.base: int | None = None  # the full version the ring logs from
        self._stored_steps = 0  # steps of that base a log version has already stored
        self.dense = False  # whether the last log seen changed about all of the state

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        opt = self.ulog.optimizer
        assert opt is not None
        return opt

    @property
    def mirrors(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return self.ulog.mirrors

    def detach(self) -> None:
        self.ulog.detach()

    def propose(
        self, leaves: Sequence[Leaf], max_replay_seconds: float, committed: set[int]
    ) -> LogProposal:
        """Whether the state of ``leaves`` (flattened now) can be a log version of the
        steps since :attr:`base`, and what it would cost. Takes the log (release it with
        :meth:`release`, or :meth:`full` / :meth:`invalidate`)."""
        if self.base is None or self.base not in committed:
            return LogProposal("the full version the log extends is not committed")
        status = self.ulog.status
        if status is not None:
            return LogProposal(status)
        import torch

        tensors = replayed_tensors(self.optimizer, self.mirrors)
        replayed = replayed_leaves(leaves, tensors)
        found = set(replayed.values())
        missing = [
            name
            for name, t in tensors.items()
            if isinstance(t, torch.Tensor) and t.numel() > 0 and name not in found
        ]
        if missing:
            # a replay reproduces only what the base holds: without these it could not
            return LogProposal(
                f"the state saved does not hold every tensor of the guarded optimizer "
                f"(e.g. {missing[0]}: its parameters and state)"
            )
        logged = self.ulog.take(fingerprint=False)
        with_grad = {i for s in logged.steps for i, g in enumerate(s.grads) if g is not None}
        replayed_bytes = changed = 0
        for leaf in leaves:
            name = replayed.get(leaf.key)
            if name is None:
                continue
            replayed_bytes += leaf.nbytes
            kind, _, rest = name.partition("/")
            index = rest.partition("/")[0]
            if kind == "mirror" or (index.isdigit() and int(index) in with_grad):
                changed += leaf.nbytes
        new = sum(s.nbytes for s in logged.steps[self._stored_steps :])
        seconds = estimate_replay_seconds(logged, replayed_bytes)
        reason = choose(
            new_bytes=new,
            log_bytes=logged.nbytes,
            changed_bytes=changed,
            replayed_bytes=replayed_bytes,
            replay_seconds=seconds,
            max_replay_seconds=max_replay_seconds,
        )
        proposal = LogProposal(
            reason, logged, replayed, new, logged.nbytes, changed, replayed_bytes, seconds
        )
        if logged.steps:
            self.dense = proposal.dense
        return proposal

    def release(self, proposal: LogProposal) -> None:
        if proposal.logged is not None:
            self.ulog.release(proposal.logged)

    def stored(self, proposal: LogProposal) -> None:
        """``proposal`` became a log version (its steps' chunks are in the store)."""
        assert proposal.logged is not None
        self._stored_steps = len(proposal.logged.steps)

    def full(self, version: int, state_bytes: int) -> None:
        """Version ``version`` is a full version of the state now: log from here. The
        ring may hold up to the state's size (a longer log is never chosen)."""
        self.ulog.max_bytes = state_bytes + (1 << 20)
        self.ulog.reset()
        self.base = version
        self._stored_steps = 0

    def invalidate(self, reason: str) -> None:
        """The state changed other than by a logged step: the next version is full."""
        self.ulog.invalidate(reason)
        self.base = None
        self._stored_steps = 0


@dataclass(frozen=True)
class LogVersion:
    """A log version's shard, ready for the save pipeline: ``leaves[i]`` is described by
    ``layout.entries[i]`` (gradients first), ``tree`` has ``{"r": NAME}`` nodes for the
    replayed leaves, ``replay`` is the manifest's ``log`` (fingerprints not yet filled)."""

    tree: Any
    leaves: list[Leaf]
    layout: Layout
    replay: ReplayLog


def build(
    tree: Any, leaves: Sequence[Leaf], logged: LoggedSteps, replayed: Mapping[str, str], chunk: int
) -> LogVersion:
    """Lay out a log version of the flattened state ``(tree, leaves)`` (SPEC.md 12.3)."""
    import torch

    grads = plan_log(logged, chunk)
    slots = [
        (step, slot) for step in logged.steps for slot in step.grads if slot is not None
    ]  # the order of plan_log's entries: step by step, parameter order
    grad_leaves: list[Leaf] = []
    for entry, (step, slot) in zip(grads.entries, slots, strict=True):
        raw = step.data[slot.offset : slot.offset + slot.nbytes]
        value = torch.frombuffer(raw, dtype=torch.uint8) if slot.nbytes else torch.empty(0)
        value = value.view(torch_dtype(entry.dtype)).reshape(entry.shape)
        grad_leaves.append(Leaf(entry.key, "tensor", value, entry.dtype, entry.shape, entry.nbytes))
    own = [leaf for leaf in leaves if leaf.key not in replayed]
    own_layout = plan_layout(own, chunk)
    shift = grads.end
    entries = (
        *grads.entries,
        *(replace(e, offset=e.offset + shift) for e in own_layout.entries),
    )
    windows = (*grads.windows, *((o + shift, n) for o, n in own_layout.windows))
    first = len(grads.entries)
    sharded = {first + i: p for i, p in own_layout.sharded.items()}
    layout = Layout(entries, shift + own_layout.stream_bytes, chunk, windows, sharded)
    index = {id(leaf): len(grads.entries) + i for i, leaf in enumerate(own)}
    names = {i: replayed[leaf.key] for i, leaf in enumerate(leaves) if leaf.key in replayed}

    def walk(node: Any) -> Any:
        ((tag, sub),) = node.items()
        if tag in ("e", "s"):  # "s": a DTensor's local piece (FSDP2), replayed on it too
            name = names.get(sub)
            return {"r": name} if name is not None else {tag: index[id(leaves[sub])]}
        if tag == "o":
            return {"o": walk(sub)}
        if tag == "d":
            return {"d": [[k, walk(child)] for k, child in sub]}
        return {tag: [walk(child) for child in sub]}

    return LogVersion(walk(tree), [*grad_leaves, *own], layout, grads.replay)


def with_fingerprints(replay_log: ReplayLog, source: LogSource) -> ReplayLog:
    """The manifest's ``log`` with the fingerprints of the state now (computed where each
    tensor lives; called while the guard holds the next step)."""
    fps = fingerprints(replayed_tensors(source.optimizer, source.mirrors))
    return replace(replay_log, fingerprints=fps)


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
        report = replay(
            source.optimizer,
            manifest.log,
            gradients_of(manifest, stream),
            mirrors=source.mirrors,
            scaler=source.scaler,
        )
    return report, replayed_tensors(source.optimizer, source.mirrors)


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
    from tiercheck.logversions.replay import apply_options

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
