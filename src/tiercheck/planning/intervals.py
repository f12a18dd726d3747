"""Plan checkpoint intervals and compare tier designs for a job at scale.

``plan()`` takes a job (GPUs, GPUs per node, state per rank, step time), a failure model
(:mod:`tiercheck.planning.failure_model`) and tier costs
(:mod:`tiercheck.planning.tier_costs`), builds the save schedule of each design at many
intervals and base cadences, simulates them all against the same failures
(:mod:`tiercheck.planning.simulate`), and reports for each design the best interval
found, its goodput with a confidence interval, its gain over a single remote tier, and per
failure class the lost work, the recovery time, the tier that served the restore and the
Young/Daly intervals::

    from tiercheck.planning.intervals import Job, plan
    result = plan(Job(gpus=16384, state_bytes_per_rank=4e9, step_seconds=5.9))
    for d in result.designs:
        print(d.design.name, d.interval_s, d.goodput)

The designs (:data:`DESIGNS`): a single remote tier taking every version; tiercheck's
default store (shm every version, LMDB and the remote tier every base, the remote one
migrated); the full tiered store (the same plus peer memory every version); each also with
*log versions* (a version that holds the optimizer inputs of each step since the previous
one, ``log_bytes_per_step`` of the state per step, captured every step, replayed on
restore). docs/goodput.md states the model and its assumptions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tiercheck.errors import ConfigError
from tiercheck.planning.failure_model import DEFAULT_FAILURE_MODEL, FailureModel
from tiercheck.planning.protocol_cost import ProtocolModel
from tiercheck.planning.simulate import (
    Schedule,
    TierTrack,
    daly_interval,
    draw_failures,
    mean_ci,
    simulate,
    young_interval,
)
from tiercheck.planning.tier_costs import Hardware, Measured, TierRates, tier_rates

__all__ = [
    "DESIGNS",
    "ClassOutcome",
    "Design",
    "DesignResult",
    "Job",
    "Plan",
    "TierInterval",
    "plan",
    "recommended_config",
]

GB = 1e9
_DOMAINS = ("process", "node", "cluster")


@dataclass(frozen=True)
class Job:
    """The training job.

    - ``state_bytes_per_rank``: the largest rank's checkpointed state; it paces node-local
      tiers and staging. Default 4 GB: the largest per-GPU state the reference run reports
      ("1 MB to 4 GB per GPU").
    - ``mean_state_bytes_per_rank``: the mean over ranks of what each rank adds to a shared
      tier (after dedup of replicated content); it paces the remote store. Default 396 MB:
      405e9 parameters x 16 bytes (bf16 weights, fp32 master, Adam moments) / 16,384 GPUs.
      ``None``: the same as ``state_bytes_per_rank``.
    - ``step_seconds``: one training step. Default 5.9 s: 405e9 x 6 FLOP x 16M tokens per
      step at 400 TFLOP/s on each of 16,384 GPUs.
    - ``days``: the length of the run simulated.
    """

    gpus: int = 16384
    gpus_per_node: int = 8
    state_bytes_per_rank: float = 4e9
    mean_state_bytes_per_rank: float | None = 396e6
    step_seconds: float = 5.9
    days: float = 54.0

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ConfigError(f"gpus must be an int >= 1, got {self.gpus!r}")
        if not isinstance(self.gpus_per_node, int) or not 1 <= self.gpus_per_node <= self.gpus:
            raise ConfigError(
                f"gpus_per_node must be an int in 1..gpus, got {self.gpus_per_node!r}"
            )
        for name in ("state_bytes_per_rank", "step_seconds", "days"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        mean = self.mean_state_bytes_per_rank
        if mean is not None and (
            not isinstance(mean, (int, float)) or not 0 < mean <= self.state_bytes_per_rank
        ):
            raise ConfigError(
                f"mean_state_bytes_per_rank must be in (0, state_bytes_per_rank = "
                f"{self.state_bytes_per_rank:.4g}], got {mean!r}"
            )

    @property
    def mean_state(self) -> float:
        m = self.mean_state_bytes_per_rank
        return self.state_bytes_per_rank if m is None else float(m)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mean_state_bytes_per_rank": self.mean_state, "nodes": self.nodes}


@dataclass(frozen=True)
class Design:
    """A set of tiers (names from :data:`tiercheck.planning.tier_costs.TIER_SURVIVES`) and whether
    diff versions may be logs. A single tier takes every version; with several, ``shm`` and
    ``peer`` take every version, ``lmdb`` every base, and ``remote`` every base, migrated."""

    name: str
    tiers: tuple[str, ...]
    log: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        known = ("shm", "peer", "lmdb", "remote")
        bad = [t for t in self.tiers if t not in known]
        if not self.tiers or bad or len(set(self.tiers)) != len(self.tiers):
            raise ConfigError(
                f"design {self.name!r}: tiers must be distinct names of {known}, got {self.tiers}"
            )
        if len(self.tiers) > 1 and not ({"shm", "peer", "lmdb"} & set(self.tiers)):
            raise ConfigError(f"design {self.name!r}: needs a synchronous tier")

    def placement(self, tier: str) -> str:
        if len(self.tiers) == 1:
            return "every"
        return {"shm": "every", "peer": "every", "lmdb": "base", "remote": "migrate"}[tier]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tiers": list(self.tiers),
            "log": self.log,
            "placement": {t: self.placement(t) for t in self.tiers},
            "description": self.description,
        }


DESIGNS: tuple[Design, ...] = (
    Design("remote", ("remote",), False, "one remote tier takes every version"),
    Design("remote+log", ("remote",), True, "one remote tier, diffs as log versions"),
    Design(
        "local+remote",
        ("shm", "lmdb", "remote"),
        False,
        "tiercheck's default store: shm every version, LMDB and remote every base",
    ),
    Design("local+remote+log", ("shm", "lmdb", "remote"), True, "the default store with logs"),
    Design(
        "tiered",
        ("shm", "peer", "lmdb", "remote"),
        False,
        "shm and peer memory every version, LMDB and remote every base",
    ),
    Design("tiered+log", ("shm", "peer", "lmdb", "remote"), True, "the tiered store with logs"),
)


# --- results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TierInterval:
    """One tier of a design at its best schedule."""

    tier: str
    survives: str
    placement: str
    interval_s: float  # training seconds between the versions this tier receives
    save_s: float  # seconds to write a full version there
    restore_s: float  # seconds to restore a full version from it (restart excluded)
    serves: tuple[str, ...]  # failure classes it is the first surviving tier for
    young_s: float | None  # Young's interval for the failures it serves
    daly_s: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"serves": list(self.serves)}


@dataclass(frozen=True)
class ClassOutcome:
    """One failure class under one design at its best schedule (means per failure)."""

    name: str
    domain: str
    per_day: float
    restored_from: str  # the tier most of its failures restored from ("nothing": restart)
    lost_work_s: float
    recovery_s: float  # restart + restore
    restore_s: float
    young_s: float  # Young's interval for this class alone
    daly_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DesignResult:
    """A design at the best schedule the simulation found, and its goodput curve.

    ``goodput`` and ``gain`` (over the ``remote`` design, paired on the same failures) are
    means over runs with ``*_ci`` the half-width of their 95% confidence interval.
    ``curve`` holds ``(interval_s, goodput, ci)`` at the best base cadence.
    """

    design: Design
    steps_per_version: int
    base_every: int
    interval_s: float
    goodput: float
    goodput_ci: float
    gain: float | None
    gain_ci: float | None
    blocked_s: float  # trainer blocked per version (staging, capture, waiting)
    overhead: float  # fractions of wall time
    lost: float
    recovery: float
    uses_logs: bool
    keeps_up: bool  # False: no schedule found whose migrations keep up with the bases
    tiers: tuple[TierInterval, ...]
    classes: tuple[ClassOutcome, ...]
    curve: tuple[tuple[float, float, float], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "design": self.design.to_json(),
            "steps_per_version": self.steps_per_version,
            "base_every": self.base_every,
            "interval_s": self.interval_s,
            "goodput": self.goodput,
            "goodput_ci": self.goodput_ci,
            "gain_over_remote": self.gain,
            "gain_ci": self.gain_ci,
            "blocked_s_per_version": self.blocked_s,
            "fractions": {"overhead": self.overhead, "lost": self.lost, "recovery": self.recovery},
            "uses_logs": self.uses_logs,
            "keeps_up": self.keeps_up,
            "tiers": [t.to_json() for t in self.tiers],
            "classes": [c.to_json() for c in self.classes],
            "curve": [list(p) for p in self.curve],
        }


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` found. ``designs`` in the order asked; ``best`` has the highest
    mean goodput."""

    job: Job
    failures: FailureModel
    hardware: Hardware
    measured: Measured
    rates: dict[str, TierRates]
    log_bytes_per_step: float
    runs: int
    seed: int
    configurations: int
    seconds: float
    designs: tuple[DesignResult, ...]
    protocol: ProtocolModel = field(default_factory=ProtocolModel)

    @property
    def protocol_s(self) -> float:
        """Seconds of commit protocol per save and rank at the job's rank count (each
        synchronous tier's commit includes them)."""
        return self.protocol.seconds(
            self.job.gpus, self.protocol.chunks(self.job.state_bytes_per_rank)
        )

    @property
    def protocol_bytes(self) -> float:
        """Bytes the commit protocol delivers to a rank per save at the job's rank count."""
        return self.protocol.bytes(
            self.job.gpus, self.protocol.chunks(self.job.state_bytes_per_rank)
        )

    @property
    def best(self) -> DesignResult:
        return max(self.designs, key=lambda d: d.goodput)

    def design(self, name: str) -> DesignResult:
        for d in self.designs:
            if d.design.name == name:
                return d
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job.to_json(),
            "failures": self.failures.to_json(),
            "mtbf_s": self.failures.mtbf_seconds(self.job.gpus),
            "hardware": self.hardware.to_json(),
            "measured": self.measured.to_json(),
            "tier_rates": {k: v.to_json() for k, v in self.rates.items()},
            "log_bytes_per_step": self.log_bytes_per_step,
            "protocol": {
                "seconds_per_save": self.protocol_s,
                "bytes_per_rank_per_save": self.protocol_bytes,
                "ranks": self.job.gpus,
                "chunks_per_rank": self.protocol.chunks(self.job.state_bytes_per_rank),
                "model": self.protocol.to_json(),
            },
            "runs": self.runs,
            "seed": self.seed,
            "configurations": self.configurations,
            "seconds": self.seconds,
            "best": self.best.design.name,
            "designs": [d.to_json() for d in self.designs],
        }


# --- schedules --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Costs:
    job: Job
    hardware: Hardware
    rates: dict[str, TierRates]
    log_bytes_per_step: float
    protocol_s: float = 0.0  # the commit protocol, once per version, before a sync commit
    domain_order: dict[str, int] = field(
        default_factory=lambda: {"process": 1, "node": 2, "cluster": 3}
    )

    def stage_s(self, fraction: float = 1.0) -> float:
        return fraction * self.job.state_bytes_per_rank / (self.hardware.pcie_gbps * GB)

    def replay_s(self) -> float:
        # an optimizer step reads and writes each byte of the state about once, in GPU memory
        return 2.0 * self.job.state_bytes_per_rank / (self.hardware.hbm_gbps * GB)

    def keeps_up(self, design: Design, n: int, k: int) -> bool:
        """Whether every migrated tier finishes a base before the next one is committed (a
        slower one falls further behind with every base: an unbounded backlog)."""
        sched = self.schedule(design, n, k)
        return all(t.write_s[0] <= sched.period_s for t in sched.tiers if t.placement == "migrate")

    def uses_logs(self, design: Design, n: int, k: int) -> bool:
        # the placement policy logs only when the log of an interval is smaller than a diff
        return design.log and k > 1 and self.log_bytes_per_step * n < 1.0

    def schedule(self, design: Design, n: int, k: int) -> Schedule:
        job = self.job
        logs = self.uses_logs(design, n, k)
        f = self.log_bytes_per_step * n if logs else 1.0  # size of a non-base version
        capture = self.stage_s(self.log_bytes_per_step) if logs else 0.0
        big, mean = job.state_bytes_per_rank, job.mean_state
        tracks = []
        for name in design.tiers:
            r = self.rates[name]
            # a version is committed in a synchronous tier after the ranks agree on it
            sync = self.protocol_s if design.placement(name) != "migrate" else 0.0
            full = r.read_seconds(big, mean) + self.stage_s()
            if logs:
                # a log restores its base, then every log since it, then replays their steps
                more = f * (r.read_seconds(big, mean) + self.stage_s()) + n * self.replay_s()
                restore = (full, full + more, more)
            else:
                restore = (full, full, 0.0)
            tracks.append(
                TierTrack(
                    name=name,
                    survives=self.domain_order[r.survives.value],
                    placement=design.placement(name),  # type: ignore[arg-type]
                    write_s=(
                        r.write_seconds(big, mean) + sync,
                        r.write_seconds(f * big, f * mean) + sync,
                    ),
                    restore_s=restore,
                )
            )
        return Schedule(
            compute_s=n * (job.step_seconds + capture),
            progress_s=n * job.step_seconds,
            k=k,
            stage_s=(self.stage_s(), 0.0 if logs else self.stage_s()),
            hash_s=(0.0, 0.0),  # hashing is inside the measured end-to-end tier rates
            tiers=tuple(tracks),
        )


def _grid(lo: int, hi: int, count: int) -> list[int]:
    return sorted({round(float(x)) for x in np.geomspace(lo, max(hi, lo), count)})


def _cadences(design: Design) -> list[int]:
    has_bases = design.log or any(design.placement(t) != "every" for t in design.tiers)
    return [1, 3, 10, 30, 100] if has_bases else [1]


# --- the planner ------------------------------------------------------------------------


def plan(
    job: Job | None = None,
    failures: FailureModel | None = None,
    hardware: Hardware | None = None,
    measured: Measured | None = None,
    designs: Sequence[Design] = DESIGNS,
    *,
    protocol: ProtocolModel | None = None,
    log_bytes_per_step: float = 0.35,
    runs: int = 16,
    seed: int = 0,
    intervals: int = 20,
) -> Plan:
    """Simulate every design over a grid of intervals (``intervals`` values, geometric from
    one step to three MTBFs) and base cadences, refine around each design's best, and
    report. ``runs`` independent failure histories (seeded by ``seed``) give the
    confidence intervals; every design sees the same ones."""
    t0 = time.perf_counter()
    job = job or Job()
    failures = failures or DEFAULT_FAILURE_MODEL
    hardware = hardware or Hardware()
    measured = measured or Measured()
    protocol = protocol or ProtocolModel()
    if not designs:
        raise ConfigError("no designs to compare")
    if len({d.name for d in designs}) != len(designs):
        raise ConfigError("design names must be unique")
    if not 0 < log_bytes_per_step <= 10 or not math.isfinite(log_bytes_per_step):
        raise ConfigError(f"log_bytes_per_step must be in (0, 10], got {log_bytes_per_step!r}")
    if runs < 2:
        raise ConfigError("runs must be >= 2 (confidence intervals need two)")
    if intervals < 2:
        raise ConfigError("intervals must be >= 2")
    rates = tier_rates(hardware, measured, gpus=job.gpus, gpus_per_node=job.gpus_per_node)
    protocol_s = protocol.seconds(job.gpus, protocol.chunks(job.state_bytes_per_rank))
    costs = _Costs(job, hardware, rates, log_bytes_per_step, protocol_s)

    lam = failures.rates_per_second(job.gpus)
    total = sum(lam)
    mtbf = 1.0 / total if total > 0 else math.inf
    horizon = job.days * 86400.0
    draws = draw_failures(lam, horizon, runs, seed)
    domains = [costs.domain_order[c.domain.value] for c in failures.classes]
    restart = [0.0] + [float(failures.restart_seconds.get(d, 0.0)) for d in _DOMAINS]

    n_max = max(2, int(min(3 * mtbf, horizon / 4) / job.step_seconds))
    n_grid = _grid(1, n_max, intervals)

    def run(points: list[tuple[int, int, int]]) -> Any:
        # designs often coincide at a point (a log design that does not log there): simulate
        # each distinct schedule once
        schedules = [costs.schedule(designs[d], n, k) for d, n, k in points]
        unique: dict[Schedule, int] = {}
        index = np.array([unique.setdefault(s, len(unique)) for s in schedules])
        res = simulate(list(unique), draws, restart, domains)
        return _Rows(res, index)

    def canonical(d: int, n: int, k: int) -> tuple[int, int, int]:
        # with no base-only tier and no logs at this point, every version is alike: k is moot
        design = designs[d]
        single = all(design.placement(t) == "every" for t in design.tiers)
        if single and not costs.uses_logs(design, n, k):
            return d, n, 1
        return d, n, k

    coarse = list(
        dict.fromkeys(
            canonical(d, n, k)
            for d in range(len(designs))
            for k in _cadences(designs[d])
            for n in n_grid
        )
    )
    res1 = run(coarse)
    good1 = res1.goodput.mean(axis=1)
    keeps_up = {p: costs.keeps_up(designs[p[0]], p[1], p[2]) for p in coarse}

    def best_point(pts: list[tuple[int, int, int]], means: Any, d: int) -> int:
        # the highest mean goodput among points whose migrations keep up (all points if none
        # does); among equal ones (a cadence that changes nothing) the least I/O
        idx = [i for i, p in enumerate(pts) if p[0] == d]
        ok = [i for i in idx if keeps_up[pts[i]]] or idx
        return max(ok, key=lambda i: (round(float(means[i]), 12), pts[i][2], pts[i][1]))

    # refine around each design's best point: the neighbouring intervals and cadences
    fine: list[tuple[int, int, int]] = []
    for d in range(len(designs)):
        _, n0, k0 = coarse[best_point(coarse, good1, d)]
        pos = n_grid.index(n0)
        lo, hi = n_grid[max(pos - 1, 0)], n_grid[min(pos + 1, len(n_grid) - 1)]
        ns = sorted(set(np.linspace(lo, hi, 9).round().astype(int).tolist()) | {n0})
        top = max(_cadences(designs[d]))
        ks = sorted({k0, max(1, round(k0 / 1.7)), min(top, round(k0 * 1.7))})
        new = dict.fromkeys(canonical(d, n, k) for k in ks for n in ns)
        fine += [p for p in new if p not in keeps_up]
        keeps_up.update({p: costs.keeps_up(designs[p[0]], p[1], p[2]) for p in fine})
    # then the whole interval grid at each design's best cadence, for the goodput curves
    rows = [res1] + ([run(fine)] if fine else [])
    points = coarse + fine
    means = np.concatenate([r.goodput for r in rows]).mean(axis=1)
    best_of = {d: best_point(points, means, d) for d in range(len(designs))}
    seen = set(points)
    extra = list(
        dict.fromkeys(
            p
            for d in range(len(designs))
            for n in n_grid
            if (p := canonical(d, n, points[best_of[d]][2])) not in seen
        )
    )
    if extra:
        rows.append(run(extra))
        points += extra
        keeps_up.update({p: costs.keeps_up(designs[p[0]], p[1], p[2]) for p in extra})
    goodput = np.concatenate([r.goodput for r in rows])
    offsets = np.cumsum([0] + [len(r.index) for r in rows])

    def pick(field_name: str, i: int) -> Any:
        block = int(np.searchsorted(offsets, i, side="right")) - 1
        return getattr(rows[block], field_name)[i - offsets[block]]

    baseline = next((d for d, x in enumerate(designs) if x.name == "remote"), None)

    results = []
    for d, design in enumerate(designs):
        i = best_of[d]
        _, n, k = points[i]
        gain = gain_ci = None
        if baseline is not None:
            gain_m, gain_h = mean_ci(goodput[i] - goodput[best_of[baseline]])
            gain, gain_ci = float(gain_m), float(gain_h)
        curve: list[tuple[float, float, float]] = []
        for j, (dj, nj, kj) in enumerate(points):
            if dj == d and kj == k:
                m, h = mean_ci(goodput[j])
                curve.append((nj * job.step_seconds, float(m), float(h)))
        curve.sort()
        stats = {name: pick(name, i) for name in _PER_CONFIG}
        stats["keeps_up"] = keeps_up[points[i]]
        results.append(
            _design_result(
                design,
                costs,
                failures,
                n,
                k,
                goodput[i],
                gain,
                gain_ci,
                stats,
                rows[0].counts,
                horizon,
                tuple(curve),
            )
        )
    return Plan(
        job=job,
        failures=failures,
        hardware=hardware,
        measured=measured,
        rates=rates,
        log_bytes_per_step=log_bytes_per_step,
        runs=runs,
        seed=seed,
        configurations=len(points),
        seconds=time.perf_counter() - t0,
        designs=tuple(results),
        protocol=protocol,
    )


@dataclass(frozen=True)
class _Rows:
    """A simulation's results for a list of points, some of which share a schedule."""

    res: Any
    index: Any

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.res, name)
        return value[self.index] if name in _PER_CONFIG or name == "goodput" else value


_PER_CONFIG = ("overhead", "lost", "recovery_wall", "recovery", "restore", "served")


def _design_result(
    design: Design,
    costs: _Costs,
    failures: FailureModel,
    n: int,
    k: int,
    goodput: Any,
    gain: float | None,
    gain_ci: float | None,
    stats: dict[str, Any],
    counts: Any,
    horizon: float,
    curve: tuple[tuple[float, float, float], ...],
) -> DesignResult:
    job = costs.job
    sched = costs.schedule(design, n, k)
    wb, wo = (max(w - sched.compute_s, 0.0) for w in sched.pipeline_s())
    capture = sched.compute_s - sched.progress_s
    blocked = (sched.stage_s[0] + wb + (k - 1) * (sched.stage_s[1] + wo)) / k + capture
    base_blocked = sched.stage_s[0] + wb + capture
    lam = failures.rates_per_second(job.gpus)
    per_class = counts.sum(axis=0)
    names = [*design.tiers, "nothing"]

    classes = []
    for c, fc in enumerate(failures.classes):
        seen = per_class[c]

        def per_failure(a: Any, c: int = c, seen: float = seen) -> float:
            return float(a[:, c].sum() / seen) if seen else 0.0

        served = stats["served"][c]
        mtbf = 1.0 / lam[c] if lam[c] > 0 else math.inf
        classes.append(
            ClassOutcome(
                name=fc.name,
                domain=fc.domain.value,
                per_day=lam[c] * 86400.0,
                restored_from=names[int(np.argmax(served))] if served.sum() else "-",
                lost_work_s=per_failure(stats["lost"]),
                recovery_s=per_failure(stats["recovery"]),
                restore_s=per_failure(stats["restore"]),
                young_s=young_interval(blocked, mtbf) if blocked > 0 else math.inf,
                daly_s=daly_interval(blocked, mtbf) if blocked > 0 else math.inf,
            )
        )

    tiers = []
    for slot, name in enumerate(design.tiers):
        track = sched.tiers[slot]
        serves = tuple(c.name for c in classes if c.restored_from == name)
        rate = sum(lam[i] for i, c in enumerate(classes) if c.name in serves)
        cost = blocked if track.placement == "every" else base_blocked
        every = track.placement == "every"
        young = daly = None
        if rate > 0 and cost > 0:
            young, daly = young_interval(cost, 1 / rate), daly_interval(cost, 1 / rate)
        tiers.append(
            TierInterval(
                tier=name,
                survives=costs.rates[name].survives.value,
                placement=track.placement,
                interval_s=n * job.step_seconds * (1 if every else k),
                save_s=track.write_s[0],
                restore_s=track.restore_at(0),
                serves=serves,
                young_s=young,
                daly_s=daly,
            )
        )
    g, g_ci = mean_ci(goodput)
    return DesignResult(
        design=design,
        steps_per_version=n,
        base_every=k,
        interval_s=n * job.step_seconds,
        goodput=float(g),
        goodput_ci=float(g_ci),
        gain=gain,
        gain_ci=gain_ci,
        blocked_s=blocked,
        overhead=float(stats["overhead"].mean() / horizon),
        lost=float(stats["lost"].sum(axis=-1).mean() / horizon),
        recovery=float(stats["recovery_wall"].mean() / horizon),
        uses_logs=costs.uses_logs(design, n, k),
        keeps_up=bool(stats["keeps_up"]),
        tiers=tuple(tiers),
        classes=tuple(classes),
        curve=curve,
    )


def recommended_config(result: Plan, design: str | None = None) -> str:
    """A ``tiercheck.toml`` for ``design`` (default: the best one) at its best schedule.

    URLs are placeholders to replace: the bucket, the NVMe path and, for a peer tier, each
    rank's partner daemon on another node (computed per node, see docs/multi-rank.md). The
    save interval is the trainer's: the header says every how many steps to call ``save``.
    """
    import tomli_w

    d = result.best if design is None else result.design(design)
    tiers: dict[str, dict[str, Any]] = {
        "shm": {
            "url": "shm://ckpt-{local_rank}",
            "versions": "all",
            "mode": "sync",
            "codec": "raw",
            "keep_bases": 1,
            "keep_diffs": 2,
        },
        "peer": {
            "url": "peer://PARTNER-HOST:7480/r{rank}",
            "versions": "all",
            "mode": "sync",
            "codec": "raw",
            "keep_bases": 1,
            "keep_diffs": 1,
            "options": {"token_file": "/etc/tiercheck/token"},
        },
        "lmdb": {
            "url": "lmdb:///local/nvme/ckpt/lmdb-{local_rank}",
            "versions": "base",
            "mode": "sync",
            "codec": "raw",
            "keep_bases": 2,
        },
        "remote": {
            "url": "s3://BUCKET/RUN",
            "versions": "base",
            "mode": "async",
            "codec": "zstd",
            "keep_bases": 2,
            "options": {"survives": "cluster", "shared": True},
        },
    }
    only = len(d.design.tiers) == 1
    body: dict[str, Any] = {
        "format": 1,
        "policy": {"base_every": d.base_every},
        "tier": [],
    }
    # the remote tier receives a base once per base interval of this schedule, counted in
    # steps (a duration would skip a base that came a little early)
    remote_every = d.steps_per_version * d.base_every
    if not only:
        body["policy"]["remote_every"] = remote_every
    for name in d.design.tiers:
        entry = {"name": name, **tiers[name]}
        if only:  # a single tier takes every version, synchronously
            entry.update(versions="all", mode="sync")
        elif entry.get("mode") == "async":
            entry["every"] = remote_every
        body["tier"].append(entry)
    job = result.job
    every = "every base version" if not only else "every version"
    header = [
        f"# tiercheck.toml recommended by `tiercheck plan` for design {d.design.name!r}:",
        f"# {job.gpus} GPUs ({job.gpus_per_node} per node), "
        f"{job.state_bytes_per_rank / GB:.3g} GB state per rank, {job.step_seconds:g} s steps.",
        f"# Call save() every {d.steps_per_version} steps ({d.interval_s:.0f} s of training);",
        f"# expected goodput {100 * d.goodput:.2f}% (+/- {100 * d.goodput_ci:.2f}).",
        f"# base_every = {d.base_every}: the remote tier receives {every}"
        + (
            f", at most one per {remote_every} steps ({d.interval_s * d.base_every:.0f} s; "
            "remote_every)."
            if not only
            else "."
        ),
        "# Replace the placeholder URLs; a peer URL names a daemon on another node.",
        "",
    ]
    if d.uses_logs:
        header.insert(-1, "# Diff versions are logs: guard the optimizer (issue 11's log role).")
    return "\n".join(header) + "\n" + str(tomli_w.dumps(body))
