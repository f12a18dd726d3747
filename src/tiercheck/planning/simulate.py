"""Goodput simulation: a checkpointed training job under random failures, many runs at once.

The model (docs/goodput.md explains it for users; every number the planner prints rests on it):

- **Time.** A job trains for ``horizon`` seconds of wall time. Progress is counted in seconds
  of undisturbed training; goodput is the progress at the end divided by the horizon.
- **Saves.** After every ``compute_s`` seconds of training (``progress_s`` of progress: the two
  differ when a per-step capture slows training) the trainer saves a version. It is blocked
  for the version's ``stage_s`` (the copy into staging buffers); hashing (``hash_s``) and the
  writes to the synchronous tiers run in the background, the tiers in parallel. A save cannot
  start before the previous one finished its synchronous part (tiercheck's ``on_busy="wait"``):
  the trainer waits for it, and that wait is overhead too. Versions come in periodic groups
  of ``k`` (the *super-cycle*): position 0 is a base, the others diffs or logs.
- **Tiers.** Each tier takes every version synchronously (``"every"``), base versions
  synchronously (``"base"``), or base versions migrated after their synchronous commit
  (``"migrate"``: one migration at a time, in order, as tiercheck's migration queue does; a
  tier slower than the base cadence falls further behind). A version is in a tier from the
  moment its write there ends; anything in flight when a failure strikes is lost.
- **Failures.** Each class is a Poisson process (rates fixed, failure times independent of the
  schedule) and destroys a *domain*: ``process`` (1), ``node`` (2) or ``cluster`` (3). A tier
  survives a failure iff its ``survives`` order is at least the failure's; the others lose
  everything they held (at job level: a restore needs every rank's shard, and the lost node's
  shards are gone from them) until a new version commits there.
- **Recovery.** The job restarts from the newest version any surviving tier holds, read from
  the fastest surviving tier that holds it; recovery takes the domain's ``restart`` seconds
  plus that tier's restore seconds for that version (a log version's restore includes reading
  its base and logs and replaying them). A failure during recovery starts recovery again.
  If no surviving tier holds anything, the job starts over from progress 0. Restarting begins
  a new super-cycle: the first save after a restore is a base.

Everything is vectorised over configurations (designs x intervals) and runs (seeds), with
common random numbers: every configuration sees the same failures, so differences between
designs are measured far more precisely than each goodput alone.

The closed forms (:func:`young_interval`, :func:`daly_interval`, :func:`expected_goodput`)
are the classical single-tier, blocking-checkpoint results; a test checks the simulator
against :func:`expected_goodput`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "Failures",
    "Schedule",
    "SimResult",
    "TierTrack",
    "daly_interval",
    "draw_failures",
    "expected_goodput",
    "mean_ci",
    "simulate",
    "young_interval",
]

Placement = Literal["every", "base", "migrate"]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


# --- closed forms -----------------------------------------------------------------------


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the compute time between checkpoints that minimises expected waste,
    ``sqrt(2 * cost * MTBF)``, for a checkpoint that blocks for ``cost_s``."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order estimate of the optimum compute time between
    checkpoints: ``sqrt(2 d M) [1 + sqrt(d / 2M) / 3 + (d / 2M) / 9] - d`` for ``d < 2M``,
    else ``M``."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def expected_goodput(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    """Exact long-run goodput of periodic blocking checkpoints under Poisson failures
    (Daly 2006, eq. 13): each segment of ``interval_s`` work plus ``cost_s`` checkpoint is
    redone until it completes without a failure; a failure costs ``restart_s`` (itself
    interruptible) and the segment so far. Expected wall time per segment is
    ``M exp(R/M) (exp((tau + C)/M) - 1)``."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError("interval and MTBF must be positive")
    m = mtbf_s
    expected = m * math.exp(restart_s / m) * math.expm1((interval_s + cost_s) / m)
    return interval_s / expected


# --- inputs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TierTrack:
    """One tier in a schedule: which versions it receives and what they cost there.

    ``write_s`` is ``(base, other)``: seconds to write a base / any other version.
    ``restore_s`` is ``(base, first, increment)``: seconds to restore the base, the version
    after it, and how much more each later one costs (a log version's restore reads and
    replays every log since its base). ``"base"`` and ``"migrate"`` tiers use only the base
    entries. ``survives`` is the failure-domain order the tier survives (1 process, 2 node,
    3 cluster).
    """

    name: str
    survives: int
    placement: Placement
    write_s: tuple[float, float]
    restore_s: tuple[float, float, float]

    def restore_at(self, position: int) -> float:
        """Seconds to restore the version at ``position`` of the super-cycle."""
        base, first, more = self.restore_s
        return base if position == 0 else first + (position - 1) * more


@dataclass(frozen=True)
class Schedule:
    """One design at one interval: the periodic save schedule of a segment.

    A super-cycle is ``k`` versions: a base, then ``k - 1`` others (diffs or logs).
    ``stage_s`` (blocking) and ``hash_s`` (background, before tier writes) are
    ``(base, other)``.
    """

    compute_s: float
    progress_s: float
    k: int
    stage_s: tuple[float, float]
    hash_s: tuple[float, float]
    tiers: tuple[TierTrack, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")
        if not self.compute_s > 0 or not self.progress_s > 0:
            raise ValueError("compute_s and progress_s must be positive")
        numbers = [*self.stage_s, *self.hash_s]
        for t in self.tiers:
            numbers += [*t.write_s, *t.restore_s]
        if any(not math.isfinite(x) or x < 0 for x in numbers):
            raise ValueError("stage, hash, write and restore seconds must be finite and >= 0")
        if not any(t.placement in ("every", "base") for t in self.tiers):
            raise ValueError("a schedule needs at least one synchronous tier")

    def pipeline_s(self) -> tuple[float, float]:
        """Seconds of the synchronous background part of a save: ``(base, other)``."""
        base = max([0.0] + [t.write_s[0] for t in self.tiers if t.placement != "migrate"])
        other = max([0.0] + [t.write_s[1] for t in self.tiers if t.placement == "every"])
        return self.hash_s[0] + base, self.hash_s[1] + other

    def cycle_s(self) -> tuple[float, float]:
        """Wall seconds from the start of a save to the start of the next: ``(base, other)``;
        the next waits for the compute and for this save's synchronous part."""
        wb, wo = self.pipeline_s()
        return self.stage_s[0] + max(self.compute_s, wb), self.stage_s[1] + max(self.compute_s, wo)

    @property
    def period_s(self) -> float:
        """Wall seconds of a super-cycle."""
        lb, lo = self.cycle_s()
        return lb + (self.k - 1) * lo


@dataclass(frozen=True)
class Failures:
    """Pre-drawn failures: ``times[r, i]`` (sorted, ``inf`` past the last) and ``classes``."""

    times: FloatArray
    classes: IntArray
    horizon: float
    n_classes: int

    @property
    def runs(self) -> int:
        return int(self.times.shape[0])


def draw_failures(
    rates_per_s: Sequence[float], horizon_s: float, runs: int, seed: int = 0
) -> Failures:
    """Draw ``runs`` independent failure histories over ``horizon_s`` seconds: each class
    ``c`` a Poisson process of rate ``rates_per_s[c]``."""
    rates = np.asarray(rates_per_s, dtype=np.float64)
    if rates.ndim != 1 or len(rates) == 0 or (rates < 0).any() or not np.isfinite(rates).all():
        raise ValueError("rates must be a non-empty list of non-negative numbers")
    if runs < 1 or not horizon_s > 0:
        raise ValueError("runs must be >= 1 and the horizon positive")
    rng = np.random.default_rng(seed)
    total = float(rates.sum())
    counts = rng.poisson(total * horizon_s, size=runs)
    n = max(int(counts.max()), 1)
    times = rng.uniform(0.0, horizon_s, size=(runs, n))
    times[np.arange(n)[None, :] >= counts[:, None]] = np.inf
    times.sort(axis=1)
    if total > 0:
        classes = rng.choice(len(rates), size=(runs, n), p=rates / total)
    else:
        classes = np.zeros((runs, n), dtype=np.int64)
    return Failures(times, classes.astype(np.int64), float(horizon_s), len(rates))


# --- results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SimResult:
    """Per configuration ``c`` and run ``r`` (and failure class ``f``):

    - ``progress[c, r]``: training progress at the horizon (s); goodput is it / ``horizon``.
    - ``overhead[c, r]``: wall time in training segments not spent training (staging,
      waiting for the previous save, per-step capture).
    - ``lost[c, r, f]``: progress lost to failures of class ``f`` (redone work).
    - ``recovery[c, r, f]``: recovery seconds (restart + restore) started by class ``f``
      failures, each counted in full; ``recovery_wall[c, r]`` is the wall time actually
      spent recovering (interrupted recoveries and one running at the horizon count only
      up to then).
    - ``restore[c, r, f]``: the restore part of ``recovery``.
    - ``counts[r, f]``: failures of class ``f`` in run ``r``.
    - ``served[c, f, t]``: failures of class ``f`` restored from tier ``t`` of configuration
      ``c``'s schedule (``t == len(tiers)``: from nothing, starting over), over all runs.

    ``horizon = progress + lost.sum(-1) + overhead + recovery_wall`` for every ``c, r``.
    """

    horizon: float
    progress: FloatArray
    overhead: FloatArray
    lost: FloatArray
    recovery: FloatArray
    recovery_wall: FloatArray
    restore: FloatArray
    counts: FloatArray
    served: FloatArray

    @property
    def goodput(self) -> FloatArray:
        return self.progress / self.horizon


def mean_ci(samples: npt.ArrayLike, axis: int = -1, level: float = 0.95) -> tuple[Any, Any]:
    """Mean and the half-width of its two-sided Student-t confidence interval over ``axis``.

    The t quantile is the Cornish-Fisher expansion of the normal one (within 0.5% of the
    exact value from 5 samples up)."""
    x = np.asarray(samples, dtype=np.float64)
    n = x.shape[axis]
    mean = x.mean(axis=axis)
    if n < 2:
        return mean, np.full_like(mean, np.inf)
    z = _normal_quantile(0.5 + level / 2.0)
    nu = n - 1
    t = z + (z**3 + z) / (4 * nu) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
    t += (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)
    half = t * x.std(axis=axis, ddof=1) / math.sqrt(n)
    return mean, half


def _normal_quantile(p: float) -> float:
    """The standard normal quantile: Acklam's rational approximation (relative error below
    1.2e-9), refined by one Newton step."""
    if not 0 < p < 1:
        raise ValueError("p must be in (0, 1)")
    a = [-39.69683028665376, 220.9460984245205, -275.9285104469687, 138.3577518672690]
    a += [-30.66479806614716, 2.506628277459239]
    b = [-54.47609879822406, 161.5858368580409, -155.6989798598866, 66.80131188771972]
    b += [-13.28068155288572, 1.0]
    c = [-0.007784894002430293, -0.3223964580411365, -2.400758277161838, -2.549732539343734]
    c += [4.374664141464968, 2.938163982698783]
    d = [0.007784695709041462, 0.3224671290700398, 2.445134137142996, 3.754408661907416, 1.0]

    def poly(coef: list[float], x: float) -> float:
        out = 0.0
        for k in coef:
            out = out * x + k
        return out

    tail = 0.02425
    if tail <= p <= 1 - tail:
        q = p - 0.5
        x = q * poly(a, q * q) / poly(b, q * q)
    else:
        q = math.sqrt(-2 * math.log(min(p, 1 - p)))
        x = poly(c, q) / poly(d, q)
        x = x if p < tail else -x
    err = 0.5 * math.erfc(-x / math.sqrt(2)) - p
    return x - err * math.sqrt(2 * math.pi) * math.exp(x * x / 2)


# --- the simulator ----------------------------------------------------------------------

_NONE = -np.inf


def _position(w: FloatArray, first: FloatArray, every: FloatArray, k: IntArray) -> Any:
    """Position in the super-cycle of the last event at or before ``w`` (time since the
    event of position 0): events at 0, ``first``, ``first + every``, ... (``k`` of them)."""
    later = 1 + np.floor(np.maximum(w - first, 0.0) / every)
    return np.where(w < first, 0, np.minimum(later, k - 1))


def simulate(
    schedules: Sequence[Schedule],
    failures: Failures,
    restart_s: Sequence[float],
    domains: Sequence[int],
) -> SimResult:
    """Run every schedule against every run of ``failures``.

    ``domains[f]`` is the domain order (1 process, 2 node, 3 cluster) failure class ``f``
    destroys; ``restart_s[d]`` the restart seconds of a failure of domain order ``d``
    (indexed 0..3; index 0 unused).
    """
    if not schedules:
        raise ValueError("no schedules to simulate")
    n_cls = failures.n_classes
    if len(domains) != n_cls:
        raise ValueError(f"{len(domains)} domains for {n_cls} failure classes")
    dom = np.asarray(domains, dtype=np.int64)
    if ((dom < 1) | (dom > 3)).any():
        raise ValueError("failure domains must be 1 (process), 2 (node) or 3 (cluster)")
    restart = np.asarray(restart_s, dtype=np.float64)
    if restart.shape != (4,) or (restart < 0).any():
        raise ValueError("restart_s needs 4 non-negative entries (index = domain order)")

    C, R = len(schedules), failures.runs
    horizon = failures.horizon
    n_slots = max(len(s.tiers) for s in schedules)

    def column(values: Sequence[float]) -> FloatArray:
        return np.asarray(values, dtype=np.float64)[:, None]

    # per configuration, as (C, 1) columns: the save cycle
    k = np.array([s.k for s in schedules], dtype=np.int64)[:, None]
    compute = column([s.compute_s for s in schedules])
    per_version = column([s.progress_s for s in schedules])
    rate = per_version / compute
    a0 = compute  # the first save starts after one interval of training
    cycle_b = column([s.cycle_s()[0] for s in schedules])
    cycle_o = column([s.cycle_s()[1] for s in schedules])
    period = column([s.period_s for s in schedules])
    stage_b = column([s.stage_s[0] for s in schedules])
    stage_o = column([s.stage_s[1] for s in schedules])

    # per tier slot: placement (0 absent, 1 every, 2 base, 3 migrate), survival, timings
    code = np.zeros((n_slots, C, 1), dtype=np.int64)
    survives = np.zeros((n_slots, C, 1), dtype=np.int64)
    first = np.full((n_slots, C, 1), np.inf)  # commit (or migration end) of position 0
    second = np.ones((n_slots, C, 1))  # every: commit of position 1, after position 0's
    spacing = np.ones((n_slots, C, 1))  # between later commits (every) or migrations
    restore = np.zeros((n_slots, 3, C, 1))  # base, first other, increment
    for c, sched in enumerate(schedules):
        pb, _ = sched.pipeline_s()
        start = a0[c, 0]
        for slot, track in enumerate(sched.tiers):
            code[slot, c] = {"every": 1, "base": 2, "migrate": 3}[track.placement]
            survives[slot, c] = track.survives
            restore[slot, :, c, 0] = track.restore_s
            spacing[slot, c] = cycle_o[c, 0]
            if track.placement == "migrate":
                first[slot, c] = start + sched.stage_s[0] + pb + track.write_s[0]
                spacing[slot, c] = max(period[c, 0], track.write_s[0])
                continue
            first[slot, c] = start + sched.stage_s[0] + sched.hash_s[0] + track.write_s[0]
            if track.placement == "every":
                later = sched.stage_s[1] + sched.hash_s[1] + track.write_s[1]
                second[slot, c] = start + cycle_b[c, 0] + later - first[slot, c]

    def progress_at(u: FloatArray) -> FloatArray:
        """Progress made ``u >= 0`` seconds into a segment, shape (C, R)."""
        m = np.floor(np.maximum(u - a0, 0.0) / period)
        w = np.maximum(u - a0 - m * period, 0.0)
        j = _position(w, cycle_b, cycle_o, k)
        since = np.where(j == 0, w, w - cycle_b - (j - 1) * cycle_o)
        stage = np.where(j == 0, stage_b, stage_o)
        trained = np.clip(since - stage, 0.0, compute) * rate
        inside = (m * k + j + 1) * per_version + trained
        return np.where(u < a0, u * rate, inside)

    def newest(slot: int, u: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Progress (relative to the segment; -inf: none) and restore seconds of the newest
        version committed in ``slot`` within ``u`` seconds of the segment start."""
        kind = code[slot]
        since = u - first[slot]
        step = np.where(kind == 3, spacing[slot], period)
        m = np.floor(np.maximum(since, 0.0) / step)
        j = np.where(kind == 1, _position(since - m * period, second[slot], spacing[slot], k), 0)
        prog = np.where((since >= 0) & (kind > 0), (m * k + j + 1) * per_version, _NONE)
        r = restore[slot]
        secs = np.where(j == 0, r[0], r[1] + np.maximum(j - 1, 0) * r[2])
        return prog, secs

    # state
    seg_start = np.zeros((C, R))
    base = np.zeros((C, R))  # progress at the segment start
    held_p = np.where(code > 0, 0.0, _NONE) * np.ones((1, 1, R))
    held_r = np.where(code > 0, restore[:, 0], np.inf) * np.ones((1, 1, R))
    lost = np.zeros((C, R, n_cls))
    recovery = np.zeros((C, R, n_cls))
    restore_acc = np.zeros((C, R, n_cls))
    rec_wall = np.zeros((C, R))
    overhead = np.zeros((C, R))
    served = np.zeros(C * n_cls * (n_slots + 1))
    runs = np.arange(R)
    cand_p = np.empty((n_slots, C, R))
    cand_r = np.empty((n_slots, C, R))

    for i in range(failures.times.shape[1]):
        t = failures.times[:, i]
        active = t < horizon
        if not active.any():
            break
        t = np.where(active, t, 0.0)  # keeps inf out of the arithmetic; masked below
        cls = failures.classes[:, i]
        d = dom[cls]
        u = t[None, :] - seg_start
        in_seg = u >= 0
        g = np.where(in_seg, progress_at(np.maximum(u, 0.0)), 0.0)
        for slot in range(n_slots):
            p, r = newest(slot, np.where(in_seg, u, -1.0))
            fresh = p > _NONE
            cand_p[slot] = np.where(fresh, base + p, held_p[slot])
            cand_r[slot] = np.where(fresh, r, held_r[slot])
        alive = survives >= d[None, None, :]
        avail = np.where(alive, cand_p, _NONE)
        best = avail.max(axis=0)
        from_r = np.where(alive & (avail == best[None]), cand_r, np.inf)
        which = from_r.argmin(axis=0)
        best_r = np.take_along_axis(from_r, which[None], axis=0)[0]
        nothing = best == _NONE
        which = np.where(nothing, n_slots, which)
        best = np.where(nothing, 0.0, best)
        best_r = np.where(nothing, 0.0, best_r)

        here = (base + g - best) * active
        rec = restart[d][None, :] + best_r
        lost[:, runs, cls] += here
        recovery[:, runs, cls] += rec * active
        restore_acc[:, runs, cls] += best_r * active
        overhead += np.where(in_seg, u - g, 0.0) * active
        # an interrupted recovery counts only up to this failure
        rec_wall += (rec + np.where(in_seg, 0.0, u)) * active
        flat = (np.arange(C)[:, None] * n_cls + cls[None, :]) * (n_slots + 1) + which
        served += np.bincount(flat[:, active].ravel(), minlength=served.size)

        keep = active[None, None, :]
        held_p = np.where(keep, np.where(alive, cand_p, _NONE), held_p)
        held_r = np.where(keep, np.where(alive, cand_r, np.inf), held_r)
        seg_start = np.where(active, t[None, :] + rec, seg_start)
        base = np.where(active, best, base)

    tail = horizon - seg_start
    running = tail > 0
    g_end = np.where(running, progress_at(np.maximum(tail, 0.0)), 0.0)
    overhead += np.where(running, tail - g_end, 0.0)
    rec_wall += np.where(running, 0.0, tail)  # a recovery still going at the horizon
    counts = np.zeros((R, n_cls))
    valid = failures.times < horizon
    np.add.at(counts, (np.nonzero(valid)[0], failures.classes[valid]), 1.0)
    return SimResult(
        horizon=horizon,
        progress=base + g_end,
        overhead=overhead,
        lost=lost,
        recovery=recovery,
        recovery_wall=rec_wall,
        restore=restore_acc,
        counts=counts,
        served=served.reshape(C, n_cls, n_slots + 1),
    )
