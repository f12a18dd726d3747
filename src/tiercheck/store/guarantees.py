"""Commit semantics in one place: what ``wait()`` and ``wait_migrated()`` promise.

A version is **committed** as soon as one tier holds its commit record: from then on it is
restorable from that tier. What the caller is *told* depends on the store's promises,
which the placement policy states (:mod:`tiercheck.store.policy`):

- ``wait()`` returns only if every **required** synchronous tier that wants the version
  committed it, and, when ``Policy.durability`` is set, some tier that committed it
  survives that failure domain (``process`` < ``node`` < ``cluster``).
- ``wait_migrated()`` returns only if, in addition, every required asynchronous tier that
  wants the version received it, and, when ``Policy.migrated_durability`` is set, some tier
  holding it (synchronous or migrated) survives that domain.

Otherwise they raise :class:`~tiercheck.errors.DurabilityError`, which names each tier that
failed and why, and where the version can be restored from: a shortfall never uncommits
anything. A tier that could not even be opened counts as failed; it is required only when
the configuration says so explicitly (a ``TierPolicy`` with ``mode="sync"`` or
``guarantee="required"``), since without opening it its default placement is unknown.

A tier **skipped** for a version because the version does not fit its memory budget
(:mod:`tiercheck.store.budgets`; state ``"missing"``, the reason in ``errors``) is not a
failed required tier: the budget is the bound the store was given, and keeping inside it
is the promise that wins (a budget skip never fails a save). ``durability`` is still
judged on the tiers that did commit the version: a store that asked for a failure domain
is told when only a skipped tier would have given it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from tiercheck.backends.base import Capabilities, FailureDomain
from tiercheck.errors import DurabilityError
from tiercheck.store.policy import Durability, Policy
from tiercheck.store.tierset import TierSlot

if TYPE_CHECKING:
    from tiercheck.formats.manifest import VersionInfo


class Outcome(Protocol):
    """A save's tier states and errors (a handle's ``result_now()``)."""

    @property
    def tiers(self) -> Mapping[str, str]: ...

    @property
    def errors(self) -> Mapping[str, str]: ...


__all__ = ["Outcome", "Phase", "check", "describe_survival", "judge", "survives"]

Phase = Literal["wait", "migrated"]


def describe_survival(caps: Capabilities) -> str:
    """What a tier's content survives, in words (``ls`` and error messages use it)."""
    if caps.survives == FailureDomain.CLUSTER:
        return "losing the cluster"
    if caps.survives == FailureDomain.NODE:
        return "losing this node" + (" and a reboot" if caps.persistent else "")
    if caps.survives == FailureDomain.PROCESS:
        return "a process crash" + (" and a reboot (node-local)" if caps.persistent else "")
    return "nothing (lost with the process)"


def survives(slot: TierSlot) -> FailureDomain | None:
    return slot.tier.capabilities.survives if slot.tier is not None else None


_LOSS = {"process": "a process crash", "node": "losing a node", "cluster": "losing the cluster"}


def _meets(domain: FailureDomain | None, wanted: Durability) -> bool:
    return domain is not None and domain.order >= FailureDomain(wanted).order


def _counts(slot: TierSlot, policy: Policy, phase: Phase, role: str) -> tuple[bool, bool]:
    """``(applies, required)``: whether ``slot`` is one ``phase`` waits for with a version
    of ``role``, and whether it is required."""
    tp = slot.policy if slot.policy is not None else policy.tiers.get(slot.name)
    if tp is None:  # not opened and no explicit policy: its default placement is unknown
        return phase == "wait", False
    mode = "sync" if phase == "wait" else "async"
    return tp.mode == mode and tp.wants(role), tp.required


def check(
    phase: Phase,
    *,
    version: int | None,
    step: int,
    role: str,
    slots: Sequence[TierSlot],
    policy: Policy,
    states: Mapping[str, str],
    errors: Mapping[str, str],
    rank: int | None = None,
) -> DurabilityError | None:
    """The error ``wait()`` (``phase="wait"``) or ``wait_migrated()`` (``"migrated"``)
    raises for a version whose tiers ended in ``states`` (with ``errors``), or None.

    ``rank`` qualifies the message in a multi-rank job (the tiers are that rank's).
    """
    committed = tuple(s.name for s in slots if states.get(s.name) == "committed")
    failed: dict[str, str] = {}
    for slot in slots:
        applies, required = _counts(slot, policy, phase, role)
        if applies and required and states.get(slot.name) not in ("committed", "missing"):
            cause = errors.get(slot.name) or slot.error or states.get(slot.name, "not written")
            failed[slot.name] = cause
    wanted = policy.durability if phase == "wait" else policy.migrated_durability
    best = max(
        (survives(s) for s in slots if s.name in committed and survives(s) is not None),
        key=lambda d: d.order if d is not None else -1,
        default=None,
    )
    short_domain = wanted is not None and not _meets(best, wanted)
    if not failed and not short_domain:
        return None
    label = f"version {version} (step {step})" + (f" on rank {rank}" if rank is not None else "")
    problems = [f"required tier {name} failed ({cause})" for name, cause in failed.items()]
    if short_domain and wanted is not None:
        have = ", ".join(
            f"{s.name} survives {describe_survival(s.tier.capabilities)}"
            for s in slots
            if s.name in committed and s.tier is not None
        )
        key = "durability" if phase == "wait" else "migrated_durability"
        problems.append(
            f"no tier that took it survives {_LOSS[wanted]} ({key}={wanted!r}; "
            f"{have or 'no tier took it'})"
        )
    where = (
        f"it is committed and can be restored from {', '.join(committed)}"
        if committed
        else "no tier holds it"
    )
    return DurabilityError(
        f"{label} misses the store's guarantees: {'; '.join(problems)}; {where}",
        version=version,
        step=step,
        committed=committed,
        failed=failed,
    )


def judge(
    phase: Phase,
    info: VersionInfo,
    result: Outcome,
    slots: Sequence[TierSlot],
    policy: Policy,
    rank: int | None = None,
) -> DurabilityError | None:
    """:func:`check` of version ``info`` by the tier states and errors of its save's
    ``result`` (a handle's ``result_now()``)."""
    return check(
        phase,
        version=info.id,
        step=info.step,
        role=info.role,
        slots=slots,
        policy=policy,
        states=result.tiers,
        errors=result.errors,
        rank=rank,
    )
