"""``tiercheck plan``: checkpoint intervals and tier designs for a job at scale."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from tiercheck.cli.common import UsageError, emit_json, make_console, output_path, plain
from tiercheck.errors import ConfigError


def _plan_inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, list[Any]]:
    """The job, failure model, hardware, measured rates and designs ``plan`` was given."""
    from dataclasses import replace

    from tiercheck.planning import failure_model, tier_costs
    from tiercheck.planning import intervals as plan

    # the default node size is a node's: a smaller job is one node of its GPUs
    default = min(plan.Job.gpus_per_node, args.gpus)
    per_node = default if args.gpus_per_node is None else args.gpus_per_node
    try:
        job = plan.Job(
            gpus=args.gpus,
            gpus_per_node=per_node,
            state_bytes_per_rank=float(args.state_per_rank),
            mean_state_bytes_per_rank=float(
                min(396e6, args.state_per_rank)
                if args.mean_state_per_rank is None
                else args.mean_state_per_rank
            ),
            step_seconds=args.step_time,
            days=args.days,
        )
        failures = (
            failure_model.load_failure_model(args.failures)
            if args.failures
            else failure_model.DEFAULT_FAILURE_MODEL
        )
        hardware = (
            tier_costs.load_hardware(args.hardware) if args.hardware else tier_costs.Hardware()
        )
        if args.remote_gbps is not None:
            hardware = replace(
                hardware, remote_write_gbps=args.remote_gbps, remote_read_gbps=args.remote_gbps
            )
        measured = (
            tier_costs.Measured.from_benchmarks(args.bench) if args.bench else tier_costs.Measured()
        )
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    designs = list(plan.DESIGNS)
    if args.design:
        known = {d.name: d for d in designs}
        unknown = [n for n in args.design if n not in known]
        if unknown:
            raise UsageError(f"unknown design {unknown[0]!r} (designs: {', '.join(known)})")
        designs = [known[n] for n in dict.fromkeys(args.design)]
    return job, failures, hardware, measured, designs


def _protocol_model(args: argparse.Namespace) -> Any:
    """The commit protocol's model: from ``--bench DIR``'s protocol.json where it has one."""
    from tiercheck.planning.protocol_cost import ProtocolModel

    if args.bench and (Path(args.bench) / "protocol.json").exists():
        try:
            return ProtocolModel.from_benchmarks(args.bench)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    return ProtocolModel()


def _seconds(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x >= 3600:
        return f"{x / 3600:.1f} h"
    if x >= 100:
        return f"{x / 60:.1f} min"
    return f"{x:.3g} s"


def _percent(x: float | None, ci: float | None = None, sign: bool = False) -> str:
    if x is None:
        return "-"
    text = f"{100 * x:+.2f}%" if sign else f"{100 * x:.2f}%"
    return text if ci is None else f"{text} ± {100 * ci:.2f}"


def cmd_plan(args: argparse.Namespace) -> int:
    from tiercheck.planning import failure_model, tier_costs
    from tiercheck.planning import intervals as plan

    for out in (args.write_failures, args.write_hardware, args.config_out):
        if out:
            output_path(out)  # before the simulation, and before the other file is written
    if args.write_failures or args.write_hardware:
        wrote = []
        if args.write_failures:
            failure_model.save_failure_model(
                args.write_failures, failure_model.DEFAULT_FAILURE_MODEL
            )
            wrote.append(("failure", args.write_failures))
        if args.write_hardware:
            tier_costs.save_hardware(args.write_hardware, tier_costs.Hardware())
            wrote.append(("hardware", args.write_hardware))
        if args.json:
            emit_json({"wrote": {what: path for what, path in wrote}})
        else:
            for what, path in wrote:
                make_console().print(f"wrote the default {what} model to {plain(path)}")
        return 0
    job, failures, hardware, measured, designs = _plan_inputs(args)
    try:
        result = plan.plan(
            job,
            failures,
            hardware,
            measured,
            designs,
            protocol=_protocol_model(args),
            log_bytes_per_step=args.log_bytes_per_step,
            runs=args.runs,
            seed=args.seed,
        )
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    toml_text = plan.recommended_config(result)
    if args.config_out:
        tier_costs.write_text_atomic(Path(args.config_out), toml_text)
    if args.json:
        emit_json({**result.to_json(), "recommended_toml": toml_text})
        return 0
    from rich.table import Table

    from tiercheck.planning.tier_costs import survival_text

    console = make_console()
    mtbf = failures.mtbf_seconds(job.gpus)
    console.print(
        f"[bold]{job.gpus} GPUs[/bold] ({job.nodes} nodes), {job.state_bytes_per_rank / 1e9:.3g} GB"
        f" largest / {job.mean_state / 1e9:.3g} GB mean state per rank, {job.step_seconds:g} s "
        f"steps, {job.days:g} days; a failure every {_seconds(mtbf)} "
        f"({sum(c.count for c in failures.classes):g} in {failures.window_days:g} days on "
        f"{failures.reference_gpus} GPUs, scaled)"
    )
    rt = Table(
        title="tier costs per version (one rank; all ranks in parallel)", title_justify="left"
    )
    for col in ("tier", "survives", "save", "restore", "bound by (save / restore)"):
        rt.add_column(col)
    for name, r in result.rates.items():
        w, rd = r.limits()
        rt.add_row(
            name,
            survival_text(name),
            _seconds(r.write_seconds(job.state_bytes_per_rank, job.mean_state)),
            _seconds(r.read_seconds(job.state_bytes_per_rank, job.mean_state)),
            f"{w} / {rd}",
        )
    console.print(rt)
    console.print(
        f"commit protocol per save at {job.gpus} ranks: {_seconds(result.protocol_s)}, "
        f"{result.protocol_bytes / 1e3:.3g} KB received per rank (benchmarks/protocol.py's "
        "model; in each synchronous tier's save time)"
    )
    dt = Table(
        title=f"designs at their best interval ({result.runs} runs, 95% CI)", title_justify="left"
    )
    for col in ("design", "tiers", "interval", "base every", "goodput", "vs remote", "blocked",
                "lost", "recovery"):  # fmt: skip
        dt.add_column(col, justify="left" if col in ("design", "tiers") else "right")
    for d in result.designs:
        note = "" if d.keeps_up else " [red](remote falls behind)[/red]"
        logs = " (logs)" if d.uses_logs else ""
        dt.add_row(
            f"{d.design.name}{note}",
            "+".join(d.design.tiers) + logs,
            f"{_seconds(d.interval_s)} ({d.steps_per_version} steps)",
            str(d.base_every),
            _percent(d.goodput, d.goodput_ci),
            _percent(d.gain, d.gain_ci, sign=True),
            _percent(d.overhead),
            _percent(d.lost),
            _percent(d.recovery),
        )
    console.print(dt)
    best = result.best
    tt = Table(title=f"{best.design.name}: intervals per tier", title_justify="left")
    for col in ("tier", "survives", "gets", "interval", "save", "restore", "Young", "Daly",
                "restores after"):  # fmt: skip
        tt.add_column(col)
    for t in best.tiers:
        tt.add_row(
            t.tier,
            survival_text(t.tier),
            {"every": "every version", "base": "bases", "migrate": "bases, migrated"}[t.placement],
            _seconds(t.interval_s),
            _seconds(t.save_s),
            _seconds(t.restore_s),
            _seconds(t.young_s),
            _seconds(t.daly_s),
            f"{len(t.serves)} classes" if t.serves else "-",
        )
    console.print(tt)
    ct = Table(title=f"{best.design.name}: per failure class", title_justify="left")
    for col in ("failure", "domain", "per day", "restored from", "lost work", "recovery",
                "Young", "Daly"):  # fmt: skip
        ct.add_column(
            col, justify="left" if col in ("failure", "domain", "restored from") else "right"
        )
    for c in best.classes:
        ct.add_row(
            plain(c.name),
            plain(c.domain),
            f"{c.per_day:.2f}",
            c.restored_from,
            _seconds(c.lost_work_s),
            _seconds(c.recovery_s),
            _seconds(c.young_s),
            _seconds(c.daly_s),
        )
    console.print(ct)
    console.print(
        f"simulated {result.configurations} schedules x {result.runs} runs in "
        f"{result.seconds:.1f} s; blocked = trainer waiting, lost = redone work, recovery = "
        "restart + restore, as fractions of wall time"
    )
    if args.config_out:
        console.print(f"wrote the recommended tiercheck.toml for {best.design.name} to "
                      f"{plain(args.config_out)}")  # fmt: skip
    return 0
