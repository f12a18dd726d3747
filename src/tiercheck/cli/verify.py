"""``tiercheck verify``: read every blob of every version, report damage, optionally repair."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from tiercheck.cli.common import (
    dcp_ranks,
    emit_json,
    human_size,
    label,
    make_console,
    open_store,
    plain,
    progress_bar,
    tier_names,
)

if TYPE_CHECKING:
    from tiercheck.history import verify as history_verify

#: what ``--repair`` rewrites (from an intact copy in another tier)
REPAIRABLE = ("corrupt", "missing")


def cmd_verify(args: argparse.Namespace) -> int:
    ranks = dcp_ranks(args.root)
    if ranks:  # a DCP root: every rank's store
        reports = [_verify_one(str(path), args) for path in ranks]
        if args.json:
            emit_json(
                {
                    "root": str(Path(args.root).expanduser().resolve()),
                    "dcp": True,
                    "ok": all(r.ok for r in reports),
                    "ranks": [{"root": str(p), **r.to_json()} for p, r in zip(ranks, reports)],
                }
            )
        return 0 if all(r.ok for r in reports) else 1
    report = _verify_one(args.root, args)
    if args.json:
        emit_json(report.to_json())
    return 0 if report.ok else 1


def _verify_one(root: str, args: argparse.Namespace) -> history_verify.VerifyReport:
    from tiercheck.history import verify as history_verify

    with contextlib.closing(open_store(root, write=args.repair)) as ckpt:
        tiers = tier_names(ckpt, args.tier)
        with progress_bar(not args.json, "verifying", "blobs") as progress:
            report = history_verify.verify(ckpt, tiers=tiers, repair=args.repair, progress=progress)
        if not args.json:
            from rich.table import Table

            console = make_console()
            t = Table(title=f"verify {plain(label(ckpt))}", title_justify="left")
            for col in ("tier", "versions", "blobs", "bytes", "problems"):
                t.add_column(col)
            for tv in report.tiers:
                n = sum(1 for p in report.problems if p.tier == tv.tier and not p.repaired)
                t.add_row(
                    plain(tv.tier),
                    str(tv.versions),
                    str(tv.blobs),
                    human_size(tv.bytes),
                    ("[red]" if n else "[green]") + str(n) + "[/]"
                    if tv.reachable
                    else "[red]unreachable[/red]",
                )
            console.print(t)
            for p in report.problems:
                if p.repaired:
                    status = "[green]repaired[/green]"
                elif p.kind == "newer-format":
                    status = "[yellow]newer-format[/yellow]"
                else:
                    status = f"[red]{p.kind}[/red]"
                where = f" (versions {', '.join(map(str, p.versions))})" if p.versions else ""
                console.print(f"{plain(p.tier)} {p.id or '-'}: {status}{where}: {plain(p.detail)}")
            left = [p for p in report.problems if not p.repaired]
            newer = sum(p.kind == "newer-format" for p in left)
            if report.ok:
                console.print(
                    "all blobs intact"
                    + (f" ({report.repaired} repaired)" if report.repaired else "")
                )
            if newer:
                console.print(
                    f"{newer} blob(s) were written by a newer tiercheck format than this one "
                    "reads: not known to be damaged, but not checked; upgrade tiercheck and "
                    "verify again"
                )
            fixable = [p for p in left if p.kind in REPAIRABLE and p.id]
            # --repair copies from another tier: a tier URL is opened alone (and read-only)
            sources = sum(s.tier is not None for s in ckpt.tierset.slots)
            if not args.repair and fixable and sources > 1:
                console.print(
                    f"{len(fixable)} damaged or missing copies; run again with --repair to "
                    "rewrite them from another tier"
                )
            elif not args.repair and fixable:
                console.print(
                    f"{len(fixable)} damaged or missing copies, and no other tier to repair "
                    "them from"
                )
            others = [p for p in left if p not in fixable and p.kind != "newer-format"]
            down = sorted({p.tier for p in others if p.kind == "unreadable" and not p.id})
            others = [p for p in others if p.tier not in down]
            if down:  # the tier itself could not be opened or its log read
                console.print(
                    f"tier {plain(', '.join(down))} cannot be read now: a remote that is down "
                    "or a file system not mounted is reopened by the store once it is back; "
                    "a shm segment a reboot emptied is started afresh by the store's next "
                    "writable open (`tiercheck ls` lists the versions lost with it)"
                )
            if others:
                where = plain(", ".join(sorted({p.tier for p in others})))
                console.print(
                    f"{len(others)} problem(s) --repair cannot fix (tier {where}: unreadable, "
                    "its content gone, or a damaged log); move the damaged tier aside and let "
                    "the store rebuild it, see docs/troubleshooting.md"
                )
        return report
