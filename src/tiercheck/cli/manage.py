"""``tiercheck rm``, ``adopt``, ``gc`` (also ``gc --orphans``) and ``migrate``: the commands
that change a store."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercheck.cli.common import (
    UsageError,
    dcp_ranks,
    emit_json,
    human_size,
    make_console,
    open_store,
    pick_version,
    plain,
    progress_bar,
)
from tiercheck.core.urls import without_userinfo
from tiercheck.errors import (
    ConfigError,
    InvalidURL,
    StoreLocked,
)

if TYPE_CHECKING:
    from tiercheck.store.lifecycle import DestroyReport


def cmd_rm(args: argparse.Namespace) -> int:
    from tiercheck.store.lifecycle import destroy_segment, destroy_store

    if "://" in args.root and not args.root.startswith("shm://"):
        raise UsageError(
            f"{without_userinfo(args.root)}: rm deletes a store by its root directory (or an "
            "shm segment, shm://NAME), not by a tier URL: give the store's root"
        )
    ranks = dcp_ranks(args.root)  # a DCP root: every rank's store, or none of them
    try:
        if args.root.startswith("shm://"):  # a segment that is no store's tier
            reports = [destroy_segment(args.root, dry_run=args.dry_run)]
        else:
            for path in ranks:  # one held by a live process stops it before any is deleted
                destroy_store(path, dry_run=True)
            reports = [destroy_store(path, dry_run=args.dry_run) for path in ranks or [args.root]]
    except StoreLocked as exc:
        raise UsageError(str(exc)) from None
    except (ConfigError, FileNotFoundError) as exc:
        raise UsageError(f"{args.root}: {exc}") from None
    if ranks and not args.dry_run:
        with contextlib.suppress(OSError):  # what else is there is the user's
            Path(args.root).expanduser().rmdir()
    if args.json:
        rows = [
            {
                "root": report.root,
                "dry_run": report.dry_run,
                "segments": list(report.segments),
                "freed_bytes": report.freed,
                "lmdb": list(report.lmdb),
                "kept": list(report.kept),
                "failed_open": report.failed_open,
            }
            for report in reports
        ]
        if ranks:
            root = str(Path(args.root).expanduser().resolve())
            emit_json({"root": root, "dcp": True, "ranks": rows})
        else:
            emit_json(rows[0])
        return 0
    for report in reports:
        _print_removal(report)
    return 0


def _print_removal(report: DestroyReport) -> None:
    verb = "would delete" if report.dry_run else "deleted"
    if report.failed_open:
        print(
            f"{verb} {report.root}: no store, what a failed open left (its lock file, "
            "no tiercheck.toml)"
        )
    else:
        print(f"{verb} {report.root}")
    for seg in report.segments:
        print(f"{verb} shm segment {seg}")
    for env in report.lmdb:
        print(f"{verb} LMDB environment {env}")
    print(
        f"{'would free' if report.dry_run else 'freed'} {human_size(report.freed)} of shared memory"
    )
    for tier in report.kept:
        print(f"kept tier {tier}: delete its data yourself if you no longer need it")


def cmd_adopt(args: argparse.Namespace) -> int:
    from tiercheck.store.lifecycle import adopt_store

    try:
        report = adopt_store(args.root)
    except StoreLocked as exc:
        raise UsageError(str(exc)) from None
    except ConfigError as exc:
        raise UsageError(f"{args.root}: {exc}") from None
    if args.json:
        emit_json(
            {
                "root": report.root,
                "old_store_id": report.old_id,
                "store_id": report.new_id,
                "renamed": report.renamed,
                "claimed": list(report.claimed),
                "left": list(report.left),
            }
        )
        return 0
    print(f"{report.root} is now store {report.new_id} (was {report.old_id})")
    for old, new in report.renamed.items():
        print(f"shm tier {old} is now {new} (empty: the old segment stays its owner's)")
    for tier in report.claimed:
        print(f"owns tier {tier}")
    for tier in report.left:
        print(f"left tier {tier} to its owner: point it elsewhere if another store owns it")
    return 0


def cmd_gc_orphans(args: argparse.Namespace) -> int:
    from tiercheck.backends import DEFAULT_SHM_ROOT
    from tiercheck.store.lifecycle import find_orphans, remove_orphans

    roots = args.shm_root or [DEFAULT_SHM_ROOT]
    orphans = find_orphans(roots)
    delete = bool(args.yes)
    freed = remove_orphans(orphans) if delete else 0
    rows: list[dict[str, Any]] = [
        {
            "path": o.segment.path,
            "store": o.segment.store,
            "pid": o.segment.pid,
            "created": o.segment.created,
            "bytes": o.segment.nbytes,
            "reason": o.reason,
        }
        for o in orphans
    ]
    if args.json:
        emit_json({"dry_run": not delete, "orphans": rows, "freed_bytes": freed})
        return 0
    if not rows:
        print(f"no orphaned shm segments under {', '.join(roots)}")
        return 0
    total = sum(r["bytes"] or 0 for r in rows)
    for r in rows:
        print(f"{r['path']}  {human_size(r['bytes'] or 0)}  {r['reason']}")
    if delete:
        print(f"deleted {len(rows)} orphaned segment(s), freed {human_size(freed)}")
    else:
        print(
            f"{len(rows)} orphaned segment(s), {human_size(total)} (dry run: pass --yes to "
            "delete them)"
        )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from tiercheck.history.manage import collect

    if args.orphans:
        if args.root is not None:
            raise UsageError("gc --orphans takes no ROOT: it scans this node's shared memory")
        return cmd_gc_orphans(args)
    if args.root is None:
        raise UsageError("gc needs a store ROOT (or --orphans)")
    if args.yes:
        raise UsageError("--yes goes with --orphans")
    with contextlib.closing(open_store(args.root, write=not args.dry_run)) as ckpt:
        with progress_bar(not args.json, "collecting", "steps") as progress:
            if progress is not None:
                progress(0, 1)
            reports = collect(ckpt, dry_run=args.dry_run, grace=args.grace)
            if progress is not None:
                progress(1, 1)
        rows: list[dict[str, Any]] = [
            {
                "tier": r.tier,
                "kept": r.kept,
                "unreferenced": r.unreferenced,
                "deleted": r.deleted,
                "would_delete": len(r.deleted_ids) if args.dry_run else 0,
                "waiting": r.waiting,
                "fenced": r.fenced,
            }
            for r in reports
        ]
        if args.json:
            emit_json({"dry_run": args.dry_run, "tiers": rows})
            return 0
        from rich.table import Table

        t = Table(title="gc (dry run)" if args.dry_run else "gc", title_justify="left")
        cols = ["tier", "kept", "unreferenced", "would delete" if args.dry_run else "deleted"]
        for col in [*cols, "in grace period"]:
            t.add_column(col)
        for r in rows:
            gone = r["would_delete"] if args.dry_run else r["deleted"]
            t.add_row(
                plain(r["tier"]),
                str(r["kept"]),
                str(r["unreferenced"]),
                str(gone),
                str(r["waiting"]),
            )
        console = make_console()
        console.print(t)
        for r in rows:
            if r["fenced"]:
                console.print(f"tier {plain(r['tier'])} was not swept: {plain(r['fenced'])}")
        if any(r["waiting"] for r in rows):
            console.print(
                "blobs younger than the grace period are kept (their age counts from when "
                "they were written, where the tier says; else from now); pass --grace 0 to "
                "delete them now"
            )
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from tiercheck.history.manage import migrate

    with contextlib.closing(open_store(args.root)) as probe:
        configured = any(args.to in (s.name, s.spec.url) for s in probe.tierset.slots)
    with contextlib.closing(open_store(args.root, write=configured)) as ckpt:
        v = pick_version(ckpt, args.version)
        try:
            with progress_bar(not args.json, "migrating", "shards") as progress:
                report = migrate(ckpt, v, args.to, progress=progress)
        except InvalidURL as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            emit_json(report.to_json())
        else:
            console = make_console()
            if report.versions:
                console.print(
                    f"copied versions {', '.join(map(str, report.versions))} to "
                    f"{plain(report.url)}: "
                    f"{report.chunks_written} chunks, {human_size(report.bytes_written)} "
                    f"in {report.seconds:.2f}s"
                )
            if report.already:
                console.print(
                    f"{plain(report.url)} already held versions "
                    f"{', '.join(map(str, report.already))}"
                )
            if not report.configured:
                console.print(
                    f"{plain(report.url)} is not a tier of this store: it now holds a "
                    f"self-contained copy; browse it with `tiercheck ls {plain(report.url)}`, "
                    "restore from it with Checkpointer(root, tiers=\\[url], read_only=True)"
                )
    return 0
