"""Log versions in the save pipeline: when a save becomes one and how it is laid out.

The capture (:mod:`tiercheck.logversions.update_log`), the format (SPEC.md section 12) and
the replay (:mod:`tiercheck.logversions.replay`) exist on their own; this module joins the
capture to the save pipeline. Restoring a log version is :mod:`tiercheck.logversions.replay`'s.

``Checkpointer.guard(optimizer, scaler)`` attaches an
:class:`~tiercheck.logversions.update_log.UpdateLog` to the optimizer through a :class:`LogSource`.
Every save of the store is then planned on the pipeline thread, in order, while the guard
holds the trainer's next ``optimizer.step()`` (so the log and the state agree):
:meth:`LogSource.propose` says whether the save can be a log version of the steps since
the last full version, by :func:`choose` (bytes and the estimated replay time); a full
version (base or diff) resets the log. A log version's shard is laid out by
:func:`build`: the logged gradients first, then the state's leaves that a replay does not
reproduce; the replayed ones become ``{"r": NAME}`` nodes of the tree. From there the
save pipeline (hash, 2PC, every tier) is the one of any version.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tiercheck.core.chunking import Layout, plan_layout
from tiercheck.core.entries import Leaf, torch_dtype
from tiercheck.core.sharded import local_tensor
from tiercheck.formats.manifest import ReplayLog
from tiercheck.logversions.capture import slot_bytes
from tiercheck.logversions.fingerprint import fingerprints
from tiercheck.logversions.update_log import (
    LoggedSteps,
    UpdateLog,
    estimate_replay_seconds,
    flat_params,
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

    The capture pays only where it can win: at each full version, :meth:`full` switches
    it off for the cycle to come when the gradients of the steps between two saves (as
    last seen) are no smaller than what a full version stores of the optimizer, since
    no log version could then be chosen, and on again when they are. ``prepare``
    allocates the ring's first buffers here (in ``guard()``), not in the first step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        *,
        prepare: bool = True,
    ) -> None:
        self.ulog = UpdateLog()
        self.ulog.attach(optimizer, scaler, mirrors=mirrors)
        if prepare:
            self.ulog.prepare()
        self.scaler = scaler
        self.base: int | None = None  # the full version the ring logs from
        self._stored_steps = 0  # steps of that base a log version has already stored
        self.dense = False  # whether the last log seen changed about all of the state
        self._seen_at_full = 0  # ulog.steps_seen at the last full version
        self._saves_since_full = 0  # saves proposed since the last full version
        self._grad_bytes = 0  # gradient bytes of a captured step, as last seen
        self._warned: set[str] = set()  # state keys already warned of as edited

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
        self._saves_since_full += 1
        if self.base is None or self.base not in committed:
            return LogProposal("the full version the log extends is not committed")
        import torch

        tensors = replayed_tensors(self.optimizer, self.mirrors)
        replayed = replayed_leaves(leaves, tensors)
        edited = self.ulog.edited()
        if edited:
            return LogProposal(self._edited(edited, replayed))
        status = self.ulog.status
        if status is not None:
            return LogProposal(status)
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
        captured = [s.nbytes for s in logged.steps if not s.skipped]
        if captured:
            self._grad_bytes = max(captured)
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

    def _edited(self, names: Sequence[str], replayed: Mapping[str, str]) -> str:
        """Why the save is a full version: ``names`` were written outside
        ``optimizer.step()``. Warns once per state key."""
        key_of = {name: key for key, name in replayed.items()}
        keys = [key_of.get(n, n) for n in names]
        new = [k for k in keys if k not in self._warned]
        shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
        reason = (
            f"{shown} changed outside optimizer.step() since the last step (a clamp, a "
            "manual edit): no replay can reproduce that"
        )
        if new:
            self._warned.update(new)
            log.warning(
                "%s; such saves are full versions (base or diff) while it goes on. To keep "
                "log versions, make the change inside the optimizer's step",
                reason,
            )
        return reason

    def full(self, version: int, state_bytes: int) -> None:
        """Version ``version`` is a full version of the state now: log from here. The
        ring may hold up to the state's size (a longer log is never chosen).

        Capture is switched off for the cycle to come when the gradients of a save's
        steps cannot be smaller than what a full version stores of the optimizer's
        tensors (``state_bytes`` at least), on otherwise."""
        import torch

        self.ulog.max_bytes = state_bytes + (1 << 20)
        seen = self.ulog.steps_seen
        steps = seen - self._seen_at_full
        per_save = max(steps, 1) / max(self._saves_since_full, 1)
        tensors = replayed_tensors(self.optimizer, self.mirrors)
        replayed = sum(
            local_tensor(t).nbytes for t in tensors.values() if isinstance(t, torch.Tensor)
        )
        grads = self._grad_bytes or slot_bytes(
            [local_tensor(p) for _, p in flat_params(self.optimizer) if p.requires_grad]
        )
        whole = max(replayed, state_bytes)
        capture = per_save * grads < whole
        self.ulog.reset(
            capture=capture,
            reason=(
                f"capture is off until the next full version: {per_save:g} step(s) of "
                f"{grads} gradient bytes per save are no smaller than the {whole} bytes of "
                "a full version"
            ),
        )
        if not capture:
            log.debug("version %d: the update log does not capture the next cycle", version)
        self._seen_at_full = seen
        self._saves_since_full = 0
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
