"""What the tiers buy at 16,384 GPUs: the plots and tables of docs/goodput.md.

Runs the planner (tiercheck.planning.intervals, a simulation, no hardware involved) on the reference
scenario and on a sweep of remote-store bandwidths and state sizes, then writes:

- ``docs/goodput/goodput.png``: goodput against the checkpoint interval for every design,
  on the reference scenario and on one with a slower remote store;
- ``docs/goodput/gain.png``: the tiered store's gain over a single remote tier against the
  remote store's bandwidth;
- ``benchmarks/results/goodput.json``: every number, and the markdown tables on stdout.

    python benchmarks/goodput.py [--runs 32] [--bench benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tiercheck.planning.intervals import DESIGNS, Job, Plan, plan, recommended_config
from tiercheck.planning.tier_costs import Hardware, Measured

REPO = Path(__file__).resolve().parents[1]
BANDWIDTHS = (2000.0, 1000.0, 500.0, 200.0, 100.0, 50.0)
STYLE = {
    "remote": ("tab:red", "-"),
    "remote+log": ("tab:red", ":"),
    "local+remote": ("tab:orange", "-"),
    "local+remote+log": ("tab:orange", ":"),
    "tiered": ("tab:blue", "-"),
    "tiered+log": ("tab:blue", ":"),
}


def pct(x: float | None, ci: float | None = None, sign: bool = False) -> str:
    if x is None:
        return "-"
    text = f"{100 * x:+.2f}%" if sign else f"{100 * x:.2f}%"
    return text if ci is None else f"{text} ± {100 * ci:.2f}"


def secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 60:.1f} min" if x >= 100 else f"{x:.3g} s"


def design_table(result: Plan) -> str:
    rows = [
        "| design | tiers | interval | base every | goodput | vs remote | blocked | lost "
        "| recovery |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in result.designs:
        logs = " (logs)" if d.uses_logs else ""
        rows.append(
            f"| {d.design.name} | {'+'.join(d.design.tiers)}{logs} | {secs(d.interval_s)} "
            f"({d.steps_per_version} steps) | {d.base_every} | {pct(d.goodput, d.goodput_ci)} "
            f"| {pct(d.gain, d.gain_ci, sign=True)} | {pct(d.overhead)} | {pct(d.lost)} "
            f"| {pct(d.recovery)} |"
        )
    return "\n".join(rows)


def class_table(result: Plan, names: tuple[str, ...]) -> str:
    designs = [result.design(n) for n in names]
    head = "| failure | domain | per day | " + " | ".join(
        f"{n}: from, lost, recovery" for n in names
    )
    rows = [head + " |", "|---|---|---|" + "---|" * len(names)]
    for i, c in enumerate(designs[0].classes):
        cells = [
            f"{d.classes[i].restored_from}, {secs(d.classes[i].lost_work_s)}, "
            f"{secs(d.classes[i].recovery_s)}"
            for d in designs
        ]
        rows.append(f"| {c.name} | {c.domain} | {c.per_day:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tier_table(result: Plan, name: str) -> str:
    d = result.design(name)
    rows = [
        "| tier | survives | gets | interval | save | restore | Young | Daly | restores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gets = {"every": "every version", "base": "bases", "migrate": "bases, migrated"}
    for t in d.tiers:
        rows.append(
            f"| {t.tier} | {t.survives} | {gets[t.placement]} | {secs(t.interval_s)} "
            f"| {secs(t.save_s)} | {secs(t.restore_s)} | {secs(t.young_s)} | {secs(t.daly_s)} "
            f"| {len(t.serves)} classes |"
        )
    return "\n".join(rows)


def plot_curves(panels: list[tuple[str, Plan]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4))
    for ax, (title, result) in zip(axes, panels):
        for d in result.designs:
            color, line = STYLE.get(d.design.name, ("gray", "-"))
            xs = [p[0] for p in d.curve]
            ys = [100 * p[1] for p in d.curve]
            ci = [100 * p[2] for p in d.curve]
            label = f"{d.design.name} (base every {d.base_every})"
            ax.plot(xs, ys, line, color=color, label=label, lw=1.6)
            ax.fill_between(
                xs, [y - c for y, c in zip(ys, ci)], [y + c for y, c in zip(ys, ci)],
                color=color, alpha=0.12, lw=0,
            )  # fmt: skip
            ax.plot([d.interval_s], [100 * d.goodput], "o", color=color, ms=4)
        best = max(100 * d.goodput for d in result.designs)
        worst = min(100 * d.goodput for d in result.designs)
        ax.set_xscale("log")
        ax.set_xlim(result.job.step_seconds * 0.8, 1e4)
        ax.set_ylim(min(worst - 2, best - 4), best + 0.6)
        ax.set_xlabel("training seconds between versions (log scale)")
        ax.set_ylabel("goodput, % (95% CI shaded; dot: best)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_gain(sweep: dict[str, list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (label, rows), line in zip(sweep.items(), ("-o", "--s")):
        xs = [r["remote_gbps"] for r in rows]
        for name in ("tiered", "local+remote"):
            ys = [100 * r[name]["gain"] for r in rows]
            err = [100 * r[name]["gain_ci"] for r in rows]
            color = STYLE[name][0]
            ax.errorbar(
                xs, ys, yerr=err, fmt=line, color=color, ms=3, capsize=2, label=f"{name}, {label}"
            )
    ax.set_xscale("log")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("remote store aggregate bandwidth, GB/s (log scale)")
    ax.set_ylabel("goodput gain over one remote tier, points")
    ax.set_title("16,384 GPUs, 419 failures in 54 days: what the tiers buy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def summary(result: Plan) -> dict[str, Any]:
    return {
        d.design.name: {
            "goodput": d.goodput,
            "goodput_ci": d.goodput_ci,
            "gain": d.gain,
            "gain_ci": d.gain_ci,
            "interval_s": d.interval_s,
            "base_every": d.base_every,
            "uses_logs": d.uses_logs,
        }
        for d in result.designs
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=32)
    ap.add_argument("--bench", type=Path, help="a benchmarks/results directory to read")
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "goodput")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "goodput.json")
    args = ap.parse_args()
    measured = Measured.from_benchmarks(args.bench) if args.bench else Measured()
    t0 = time.perf_counter()

    job = Job()  # the reference scenario: 16,384 GPUs, 4 GB / 396 MB per rank, 5.9 s steps
    unsharded = replace(job, mean_state_bytes_per_rank=job.state_bytes_per_rank)
    reference = plan(job, measured=measured, runs=args.runs)
    slow_hw = Hardware(remote_write_gbps=200.0, remote_read_gbps=200.0)
    slow = plan(unsharded, hardware=slow_hw, measured=measured, runs=args.runs)

    sweep: dict[str, list[dict[str, Any]]] = {}
    for label, j in (("396 MB mean per rank", job), ("4 GB every rank", unsharded)):
        rows = []
        for bw in BANDWIDTHS:
            hw = Hardware(remote_write_gbps=bw, remote_read_gbps=bw)
            r = plan(j, hardware=hw, measured=measured, designs=DESIGNS[::2], runs=args.runs)
            rows.append({"remote_gbps": bw, **summary(r)})
        sweep[label] = rows

    args.docs.mkdir(parents=True, exist_ok=True)
    plot_curves(
        [
            ("reference: 2 TB/s remote store, 396 MB mean state per rank", reference),
            ("200 GB/s remote store, 4 GB state on every rank", slow),
        ],
        args.docs / "goodput.png",
    )
    plot_gain(sweep, args.docs / "gain.png")

    out = {
        "benchmark": "goodput",
        "note": (
            "a simulation: tiercheck.planning.intervals over the failure record of a 54-day, "
            "16,384-GPU run"
        ),
        "runs": args.runs,
        "measured": measured.to_json(),
        "seconds": round(time.perf_counter() - t0, 1),
        "reference": reference.to_json(),
        "slow_remote": slow.to_json(),
        "sweep": sweep,
        "recommended_toml": recommended_config(reference, "tiered"),
    }
    args.out.write_text(json.dumps(out, indent=1, allow_nan=True) + "\n")

    print("## reference\n")
    print(design_table(reference), "\n")
    print(tier_table(reference, "tiered"), "\n")
    print(class_table(reference, ("remote", "tiered")), "\n")
    print("## slow remote (200 GB/s, 4 GB every rank)\n")
    print(design_table(slow), "\n")
    print("## sweep: gain over one remote tier\n")
    for label, rows in sweep.items():
        print(f"### {label}\n")
        print("| remote GB/s | remote goodput | local+remote | tiered | tiered interval |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['remote_gbps']:g} | {pct(r['remote']['goodput'])} "
                f"| {pct(r['local+remote']['gain'], r['local+remote']['gain_ci'], sign=True)} "
                f"| {pct(r['tiered']['gain'], r['tiered']['gain_ci'], sign=True)} "
                f"| {secs(r['tiered']['interval_s'])} |"
            )
        print()
    print("## recommended tiercheck.toml (tiered)\n")
    print(recommended_config(reference, "tiered"))
    print(f"wrote {args.out} and {args.docs}/*.png in {out['seconds']} s")


if __name__ == "__main__":
    main()
