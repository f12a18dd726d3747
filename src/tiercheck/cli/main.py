"""The ``tiercheck`` command line (also ``python -m tiercheck``).

Commands: ``ls``, ``show``, ``diff``, ``verify``, ``gc`` (also ``gc --orphans``), ``rm``,
``export``, ``migrate``, ``peer serve`` / ``peer status`` / ``peer token`` and ``plan``.
Every command takes ``--json`` for scripts (stable keys, one JSON document on stdout). Long
commands draw a progress bar on stderr when it is a terminal and stay quiet otherwise. Exit
status: 0 ok, 1 problems found (or an operation failed), 2 usage errors (bad arguments,
store root, version, tier or output path), each reported as one line on stderr.

Commands that only read open the store read-only (no writer lock), so they work next to a
running trainer; ``verify --repair``, ``gc`` (without ``--dry-run``) and ``migrate`` to one
of the store's own tiers take the writer lock.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercheck.errors import (
    ConfigError,
    FormatVersionError,
    InvalidURL,
    NoRestorableVersion,
    StoreLocked,
    TiercheckError,
)

# The engine is imported by the commands that open a store, not here: `peer serve`,
# `peer status` and `--help` start without it (and without torch, which it imports).
if TYPE_CHECKING:
    from tiercheck.history import versions as history

__all__ = [
    "UsageError",
    "absolute_time",
    "build_parser",
    "emit_json",
    "human_size",
    "main",
    "relative_time",
]

PROG = "tiercheck"
EXPORT_SUFFIXES = (".safetensors", ".pt", ".pth")


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit status 2."""


# --- formatting helpers -----------------------------------------------------------------


def human_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    x = float(n)
    for unit in units:
        if abs(x) < 1024 or unit == units[-1]:
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def relative_time(t: float, now: float | None = None) -> str:
    """``"3m ago"``, ``"2h ago"``, ``"5d ago"`` (``"in 2m"`` for a clock ahead of ours)."""
    delta = (time.time() if now is None else now) - t
    ahead = delta < 0
    delta = abs(delta)
    for size, unit in ((86400 * 365, "y"), (86400, "d"), (3600, "h"), (60, "m"), (1, "s")):
        if delta >= size:
            text = f"{int(delta // size)}{unit}"
            break
    else:
        return "just now"
    return f"in {text}" if ahead else f"{text} ago"


def absolute_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).hex()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "item"):  # NumPy scalars in metadata
        return obj.item()
    return repr(obj)


def _clean_floats(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean_floats(v) for v in obj]
    return obj


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON (non-finite floats as strings, bytes as hex): indented on a
    terminal, compact when piped (json's C encoder only runs without indentation)."""
    indent = 2 if sys.stdout.isatty() else None
    text = json.dumps(_clean_floats(obj), indent=indent, default=_json_default, allow_nan=False)
    sys.stdout.write(text + "\n")


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


@contextlib.contextmanager
def progress_bar(enabled: bool, description: str) -> Iterator[history.Progress | None]:
    """A ``progress(done, total)`` callback drawing a rich bar on stderr, or None."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


# --- opening stores and versions --------------------------------------------------------


def dcp_ranks(root: str) -> list[Path]:
    """The per-rank stores of a DCP root (``TierWriter(root)`` makes ``root/rank{r}``), or
    ``[]`` when ``root`` is not one."""
    from tiercheck.engine.config import CONFIG_NAME

    path = Path(root).expanduser()
    if "://" in root or not path.is_dir() or (path / CONFIG_NAME).is_file():
        return []
    found = sorted(
        (int(p.parent.name[4:]), p.parent)
        for p in path.glob(f"rank*/{CONFIG_NAME}")
        if p.parent.name[4:].isdigit()
    )
    return [p for _, p in found]


def label(ckpt: Any) -> str:
    """How a store is named on screen: its root, or the tier URL it was opened from."""
    return str(getattr(ckpt, "cli_label", ckpt.root))


def open_store(root: str, *, write: bool = False) -> Any:
    """Open the store at ``root`` (read-only unless ``write``); UsageError if it is not one.

    ``root`` may also be a tier URL (``file:///...``, ``s3://...``, ``lmdb:///...``, e.g. where
    ``migrate --to URL`` copied versions): the tier alone is opened, read-only.
    """
    from tiercheck.checkpointer import Checkpointer
    from tiercheck.engine.config import CONFIG_NAME
    from tiercheck.engine.coordinator import LocalCoordinator

    if "://" in root:
        if write:
            raise UsageError(f"{root}: a tier URL is opened read-only; this command writes")
        try:
            ckpt: Any = Checkpointer(
                Path.cwd(), tiers=[root], read_only=True, coordinator=LocalCoordinator()
            )
        except (ConfigError, InvalidURL, FormatVersionError) as exc:
            raise UsageError(f"{root}: {exc}") from None
        down = [s for s in ckpt.tierset.slots if s.tier is None]
        if down:
            ckpt.close()
            raise UsageError(f"{root}: cannot open the tier: {down[0].error}")
        ckpt.cli_label = root
        return ckpt
    path = Path(root).expanduser()
    if not path.exists():
        raise UsageError(f"{root}: no such store root")
    if not path.is_dir():
        raise UsageError(f"{root}: not a directory")
    ranks = dcp_ranks(root)
    if ranks:
        raise UsageError(
            f"{root}: a DCP root holding one store per rank ({ranks[0].name}..{ranks[-1].name});"
            f" `ls`, `verify` and `export` take it as it is, other commands one rank's store, "
            f"e.g. {ranks[0]}"
        )
    if not (path / CONFIG_NAME).is_file():
        raise UsageError(f"{root}: not a tiercheck store (no {CONFIG_NAME})")
    try:
        # one process, never in a process group: saying so spares importing torch.distributed
        return Checkpointer(path, read_only=not write, coordinator=LocalCoordinator())
    except StoreLocked as exc:
        raise UsageError(str(exc)) from None
    except (ConfigError, InvalidURL, FormatVersionError) as exc:
        raise UsageError(f"{root}: {exc}") from None


def pick_version(ckpt: Any, spec: str, rank: int | None = None) -> history.Version:
    """The version ``spec`` names (id, ``latest``, ``step:N``); UsageError if none."""
    from tiercheck.history import versions as history

    try:
        history.parse_version_spec(spec)
        return ckpt.version(spec, rank=rank)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except NoRestorableVersion as exc:
        raise UsageError(f"{ckpt.root}: {exc}") from None


def _tier_names(ckpt: Any, wanted: Sequence[str] | None) -> list[str] | None:
    if not wanted:
        return None
    names = []
    for w in wanted:
        for slot in ckpt.tierset.slots:
            if w in (slot.name, slot.spec.url):
                names.append(slot.name)
                break
        else:
            known = ", ".join(s.name for s in ckpt.tierset.slots)
            raise UsageError(f"{w}: not a tier of this store (tiers: {known})")
    return names


# --- commands ---------------------------------------------------------------------------


def _tiers_json(ckpt: Any) -> list[dict[str, Any]]:
    from tiercheck.engine.guarantees import describe_survival

    out = []
    for slot in ckpt.tierset.slots:
        pol = slot.policy
        out.append(
            {
                "name": slot.name,
                "url": slot.spec.url,
                "available": slot.tier is not None,
                "error": slot.error,
                "speed_rank": slot.speed_rank if slot.tier is not None else None,
                "survives": slot.tier.capabilities.survives.value if slot.tier else None,
                "survives_text": describe_survival(slot.tier.capabilities) if slot.tier else None,
                "persistent": slot.tier.capabilities.persistent if slot.tier else None,
                "shared": slot.tier.capabilities.shared if slot.tier else None,
                "policy": None
                if pol is None
                else {
                    "versions": pol.versions,
                    "mode": pol.mode,
                    "codec": pol.codec,
                    "keep_bases": pol.keep_bases,
                    "keep_diffs": pol.keep_diffs,
                    "guarantee": "required" if pol.required else "best_effort",
                },
            }
        )
    return out


_STATE_STYLE = {
    "committed": "green",
    "migrating": "yellow",
    "missing": "dim",
    "dropped": "dim",
    "unreachable": "red",
}


def cmd_ls(args: argparse.Namespace) -> int:
    ranks = dcp_ranks(args.root)
    if ranks:  # a DCP root: every rank's store, rank 0's versions carry the DCP metadata
        listed = []
        for path in ranks:
            with contextlib.closing(open_store(str(path))) as ckpt:
                listed.append(_ls_one(ckpt, args))
        if args.json:
            emit_json(
                {"root": str(Path(args.root).expanduser().resolve()), "dcp": True, "ranks": listed}
            )
        return 0
    with contextlib.closing(open_store(args.root)) as ckpt:
        data = _ls_one(ckpt, args)
        if args.json:
            emit_json(data)
    return 0


def _ls_one(ckpt: Any, args: argparse.Namespace) -> dict[str, Any]:
    """List one store (as a table unless ``--json``); returns its JSON document."""
    versions = ckpt.history()
    if args.limit is not None:
        versions = versions[-args.limit :] if args.limit > 0 else []
    data = {
        "root": label(ckpt),
        "tiers": _tiers_json(ckpt),
        "versions": [v.to_json() for v in versions],
    }
    if not args.json:
        _ls_table(ckpt, versions)
    return data


def _ls_table(ckpt: Any, versions: list[history.Version]) -> None:
    from rich.table import Table

    names = [s.name for s in ckpt.tierset.slots]
    table = Table(title=label(ckpt), title_justify="left")
    for col, justify in (
        ("version", "right"),
        ("step", "right"),
        ("role", "left"),
        ("time", "left"),
        ("size", "right"),
        ("stored", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for n in names:
        table.add_column(n)
    now = time.time()
    for v in versions:
        role = _role(v)
        mark = "" if v.restorable else " [red](not restorable)[/red]"
        cells = [
            f"[{_STATE_STYLE.get(v.tiers[n], '')}]{v.tiers[n]}[/]" if v.tiers[n] else ""
            for n in names
        ]
        table.add_row(
            f"{v.id}{mark}",
            str(v.step),
            role,
            f"{absolute_time(v.time)} ({relative_time(v.time, now)})",
            human_size(v.logical_bytes),
            human_size(v.stored_bytes),
            *cells,
        )
    console = _console()
    console.print(table)
    from tiercheck.engine.guarantees import describe_survival

    for s in ckpt.tierset.slots:  # what each column's copies survive
        if s.tier is None:
            console.print(f"[red]tier {s.name} ({s.spec.url}) is unavailable: {s.error}[/red]")
        else:
            console.print(f"{s.name}: survives {describe_survival(s.tier.capabilities)}")
    if not versions:
        console.print("no committed versions")
    elif any(v.role == "log" for v in versions):
        console.print(
            "log of N: the state of version N with the optimizer steps logged since replayed "
            "(on read; `show` lists which entries are replayed)"
        )


def _role(v: history.Version, of: str = "") -> str:
    """A version's role as ls, show and diff print it: ``base``, ``diff of 3``, ``log of 3``."""
    return v.role if v.base is None else f"{v.role} of {of}{v.base}"


def _show_data(v: history.Version) -> dict[str, Any]:
    m = v.manifest
    ids = [c.id for c in m.chunks]
    lengths: dict[str, int] = {}
    for c in m.chunks:
        lengths.setdefault(c.id, c.length)
    unique_bytes = sum(lengths.values())
    base_info: dict[str, Any] | None = None
    replay_info: dict[str, Any] | None = None
    if m.log is not None:
        from tiercheck.logversions.planner import replayed_keys

        steps = m.log.steps
        logged = {i for s in steps for i in s.grads if i is not None}
        replay_info = {
            "base": v.base,
            "steps": len(steps),
            "skipped": sum(1 for s in steps if s.skipped),
            "optimizer": m.log.optimizer,
            "torch": m.log.torch,
            "device": m.log.device,
            "replayed_leaves": replayed_keys(m.tree),
            "fingerprints": len(m.log.fingerprints),
            "gradients": len(logged),
            "gradient_bytes": sum(m.entries[i].nbytes for i in logged),
            "own_leaves": len(m.entries) - len(logged),
        }
    if v.base is not None and m.log is None:
        try:
            base = v.base_version
            assert base is not None
            base_ids = [c.id for c in base.manifest.chunks]
            same_pos = sum(1 for a, b in zip(ids, base_ids) if a == b)
            base_set = set(base_ids)
            shared = sum(1 for c in set(ids) if c in base_set)
            base_info = {
                "id": base.id,
                "chunks_unchanged": same_pos,
                "chunks_changed": len(ids) - same_pos,
                "changed_fraction": (len(ids) - same_pos) / len(ids) if ids else 0.0,
                "unique_chunks_shared": shared,
            }
        except (TiercheckError, KeyError) as exc:
            base_info = {"id": v.base, "error": str(exc)}
    catalog = v._require_store().refresh()
    tiers: dict[str, Any] = {}
    chunk_set = set(ids)
    for name, state in v.tiers.items():
        tl = catalog.logs.get(name)
        row: dict[str, Any] = {"state": state}
        if tl is not None and v.id in tl.prepared:
            recs = tl.prepared[v.id].values()
            written = sum(r.bytes_written for r in recs)
            row.update(
                chunks_written=sum(r.chunks_written for r in recs),
                bytes_written=written,
                stored_ratio=written / v.logical_bytes if v.logical_bytes else None,
                delta_chunks=sum(1 for c in chunk_set if c in tl.deltas),
            )
        tiers[name] = row
    return {
        **v.to_json(),
        "rank": v.rank,
        "chunk_size": m.chunk_size,
        "chunks": {
            "total": len(ids),
            "unique": len(lengths),
            "unique_bytes": unique_bytes,
            "dedup_ratio": m.stream_bytes / unique_bytes if unique_bytes else None,
        },
        "base_delta": base_info,
        "replay": replay_info,
        "tier_detail": tiers,
        "entries": [e.to_json() for e in v.entries.values()],
    }


def cmd_show(args: argparse.Namespace) -> int:
    with contextlib.closing(open_store(args.root)) as ckpt:
        v = pick_version(ckpt, args.version, args.rank)
        data = _show_data(v)
        if args.json:
            emit_json(data)
            return 0
        from rich.table import Table

        console = _console()
        console.print(f"[bold]version {v.id}[/bold]  step {v.step}  {_role(v, 'version ')}")
        rp = data["replay"]
        if rp is not None:
            console.print(
                f"replay    version {rp['base']}, then {rp['steps']} optimizer step(s) "
                f"({rp['skipped']} skipped by the GradScaler) of {rp['optimizer']} "
                f"(torch {rp['torch']}, {rp['device']}); {len(rp['replayed_leaves'])} "
                f"leaves replayed, {rp['fingerprints']} fingerprints verified"
            )
            console.print(
                f"stored    {rp['gradients']} logged gradients "
                f"({human_size(rp['gradient_bytes'])}) and {rp['own_leaves']} own leaves"
            )
        console.print(f"time      {absolute_time(v.time)} ({relative_time(v.time)})")
        console.print(
            f"size      {human_size(v.logical_bytes)} logical, "
            f"{human_size(v.stored_bytes)} stored in its tiers"
        )
        console.print(f"shards    {v.world_size} (showing rank {v.rank})")
        console.print(f"restorable {'yes' if v.restorable else '[red]no[/red]'}")
        ch = data["chunks"]
        console.print(
            f"chunks    {ch['total']} of {human_size(data['chunk_size'])}, {ch['unique']} unique "
            f"({human_size(ch['unique_bytes'])}), dedup ratio {_ratio(ch['dedup_ratio'])}"
        )
        bd = data["base_delta"]
        if bd is not None and "error" not in bd:
            console.print(
                f"vs base   {bd['chunks_changed']} of {ch['total']} chunks changed "
                f"(delta ratio {_ratio(bd['changed_fraction'])})"
            )
        elif bd is not None:
            console.print(f"vs base   base {bd['id']} unreadable: {bd['error']}")
        if v.metadata:
            console.print("metadata  " + json.dumps(dict(v.metadata), default=_json_default))
        tt = Table(title="tiers", title_justify="left")
        for col in ("tier", "state", "chunks written", "bytes written", "stored/logical", "delta"):
            tt.add_column(col)
        for name, row in data["tier_detail"].items():
            tt.add_row(
                name,
                f"[{_STATE_STYLE.get(row['state'], '')}]{row['state']}[/]",
                str(row.get("chunks_written", "-")),
                human_size(row["bytes_written"]) if "bytes_written" in row else "-",
                _ratio(row.get("stored_ratio")),
                str(row.get("delta_chunks", "-")),
            )
        console.print(tt)
        title = f"entries ({len(data['entries'])})"
        if rp is not None:
            title = (
                f"entries of the state ({len(data['entries'])}; "
                f"{len(rp['replayed_leaves'])} replayed from version {rp['base']})"
            )
        et = Table(title=title, title_justify="left")
        for col in ("key", "kind", "dtype", "shape", "size", "chunks"):
            et.add_column(col, justify="right" if col in ("size", "chunks") else "left")
        for e in data["entries"]:
            et.add_row(
                e["key"],
                e["kind"],
                e["dtype"] or "-",
                "x".join(map(str, e["shape"])) if e["kind"] in ("tensor", "ndarray") else "-",
                human_size(e["size"]),
                "replayed" if e["replayed"] else str(e["chunks"]),
            )
        console.print(et)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from tiercheck.history import versions as history

    with contextlib.closing(open_store(args.root)) as ckpt:
        va = pick_version(ckpt, args.a, args.rank)
        vb = pick_version(ckpt, args.b, args.rank)
        d = history.diff(va, vb)
        if args.json:
            emit_json(d.to_json())
            return 0
        from rich.table import Table

        console = _console()
        console.print(
            f"version {d.a} ({_role(va)}) -> {d.b} ({_role(vb)}): {len(d.changed)} changed, "
            f"{len(d.added)} added, "
            f"{len(d.removed)} removed, {len(d.unchanged)} unchanged "
            f"({d.unchanged_by_id} decided by chunk id without reading data)"
        )
        if d.changed:
            t = Table(title="changed", title_justify="left")
            for col in ("key", "what", "max |b-a|", "rel L2"):
                t.add_column(col)
            for c in d.changed:
                what = (
                    c.reason
                    if c.reason == "data"
                    else f"{c.reason}: {_describe(c.a)} -> {_describe(c.b)}"
                )
                t.add_row(c.key, what, _ratio(c.max_abs_diff), _ratio(c.rel_l2))
            console.print(t)
        for title, items in (("added", d.added), ("removed", d.removed)):
            if items:
                t = Table(title=title, title_justify="left")
                for col in ("key", "kind", "dtype", "shape", "size"):
                    t.add_column(col)
                for e in items:
                    t.add_row(e.key, e.kind, e.dtype or "-", str(list(e.shape)), human_size(e.size))
                console.print(t)
        if args.unchanged and d.unchanged:
            console.print("unchanged: " + ", ".join(d.unchanged))
    return 0


def _describe(e: history.EntryInfo) -> str:
    if e.kind in ("tensor", "ndarray"):
        return f"{e.kind} {e.dtype} {list(e.shape)}"
    return e.kind


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


def _verify_one(root: str, args: argparse.Namespace) -> history.VerifyReport:
    from tiercheck.history import versions as history

    with contextlib.closing(open_store(root, write=args.repair)) as ckpt:
        tiers = _tier_names(ckpt, args.tier)
        with progress_bar(not args.json, "verifying") as progress:
            report = history.verify(ckpt, tiers=tiers, repair=args.repair, progress=progress)
        if not args.json:
            from rich.table import Table

            console = _console()
            t = Table(title=f"verify {label(ckpt)}", title_justify="left")
            for col in ("tier", "versions", "blobs", "bytes", "problems"):
                t.add_column(col)
            for tv in report.tiers:
                n = sum(1 for p in report.problems if p.tier == tv.tier and not p.repaired)
                t.add_row(
                    tv.tier,
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
                console.print(f"{p.tier} {p.id or '-'}: {status}{where}: {p.detail}")
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
            if not args.repair and len(left) > newer:
                console.print("problems found; run again with --repair to fix them")
        return report


def cmd_rm(args: argparse.Namespace) -> int:
    from tiercheck.engine.lifecycle import destroy_store

    try:
        report = destroy_store(args.root, dry_run=args.dry_run)
    except StoreLocked as exc:
        raise UsageError(str(exc)) from None
    except (ConfigError, FileNotFoundError) as exc:
        raise UsageError(f"{args.root}: {exc}") from None
    if args.json:
        emit_json(
            {
                "root": report.root,
                "dry_run": report.dry_run,
                "segments": list(report.segments),
                "freed_bytes": report.freed,
                "lmdb": list(report.lmdb),
                "kept": list(report.kept),
            }
        )
        return 0
    verb = "would delete" if report.dry_run else "deleted"
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
    return 0


def cmd_gc_orphans(args: argparse.Namespace) -> int:
    from tiercheck.backends import DEFAULT_SHM_ROOT
    from tiercheck.engine.lifecycle import find_orphans, remove_orphans

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
    from tiercheck.history import versions as history

    if args.orphans:
        if args.root is not None:
            raise UsageError("gc --orphans takes no ROOT: it scans this node's shared memory")
        return cmd_gc_orphans(args)
    if args.root is None:
        raise UsageError("gc needs a store ROOT (or --orphans)")
    if args.yes:
        raise UsageError("--yes goes with --orphans")
    with contextlib.closing(open_store(args.root, write=not args.dry_run)) as ckpt:
        with progress_bar(not args.json, "collecting") as progress:
            if progress is not None:
                progress(0, 1)
            reports = history.collect(ckpt, dry_run=args.dry_run, grace=args.grace)
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
                r["tier"], str(r["kept"]), str(r["unreferenced"]), str(gone), str(r["waiting"])
            )
        console = _console()
        console.print(t)
        for r in rows:
            if r["fenced"]:
                console.print(f"tier {r['tier']} was not swept: {r['fenced']}")
        if any(r["waiting"] for r in rows):
            console.print(
                "blobs in their grace period are kept (the clock starts when this process "
                "first sees them); pass --grace 0 to delete them now"
            )
    return 0


def _check_output(out: str, force: bool) -> Path:
    path = Path(out).expanduser()
    if path.suffix.lower() not in EXPORT_SUFFIXES:
        raise UsageError(f"{out}: the output must end in .safetensors, .pt or .pth")
    if path.is_dir():
        raise UsageError(f"{out}: is a directory")
    if not path.parent.is_dir():
        raise UsageError(f"{out}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{out}: directory {path.parent} is not writable")
    if path.exists() and not force:
        raise UsageError(f"{out}: exists (pass --force to overwrite)")
    return path


def _weights_only_safe(value: Any) -> Any:
    """Plain Python containers and scalars that ``torch.load(weights_only=True)`` accepts."""
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _weights_only_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_weights_only_safe(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_weights_only_safe(v) for v in value)
    return value


def cmd_export(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    out = _check_output(args.out, args.force)
    fmt = "safetensors" if out.suffix.lower() == ".safetensors" else "torch"
    if dcp_ranks(args.root):
        return _export_dcp(args, out, fmt)
    with contextlib.closing(open_store(args.root)) as ckpt:
        v = pick_version(ckpt, args.version, args.rank)
        if v.role == "log":
            return _export_log_version(args, out, fmt, v)
        prefix = args.only or ""
        keys = [k for k in v.entries if k.startswith(prefix)]
        if not keys:
            raise UsageError(f"version {v.id} has no entry whose key starts with {prefix!r}")
        skipped: list[str] = []
        wanted = []
        for k in keys:
            e = v.entries[k]
            if e.kind == "pickle" or (fmt == "safetensors" and e.kind not in ("tensor", "ndarray")):
                skipped.append(k)
            else:
                wanted.append(k)
        total = sum(v.entries[k].size for k in wanted)
        values: dict[str, Any] = {}
        with progress_bar(not args.json, "reading") as progress:
            done = 0
            batch: list[str] = []
            size = 0
            for i, k in enumerate(wanted):
                batch.append(k)
                size += v.entries[k].size
                if size >= (64 << 20) or i == len(wanted) - 1:
                    values.update(v.read(batch))
                    done += size
                    batch, size = [], 0
                    if progress is not None:
                        progress(done, total)

        def name(k: str) -> str:
            return k if args.keep_prefix or not prefix else k[len(prefix) :] or k

        obj: dict[str, Any] = {}
        for k in wanted:
            value = values[k]
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(np.ascontiguousarray(value))
            obj[name(k)] = value if isinstance(value, torch.Tensor) else _weights_only_safe(value)
        _write_export(obj, out, fmt, v.id, v.step, v.metadata, skipped, args.json)
    return 0


def _export_log_version(args: argparse.Namespace, out: Path, fmt: str, v: history.Version) -> int:
    """Export a log version: its base's tensors with the logged steps replayed (built from
    the log alone, without the training script; ``ReplayRequired`` where it cannot be)."""
    import numpy as np
    import torch

    from tiercheck.logversions.planner import replay_offline

    with progress_bar(not args.json, "replaying") as progress:
        if progress is not None:
            progress(0, 1)
        values = replay_offline(v)
        if progress is not None:
            progress(1, 1)
    prefix = args.only or ""
    keys = [k for k in values if k.startswith(prefix)]
    if not keys:
        raise UsageError(f"version {v.id} has no entry whose key starts with {prefix!r}")
    skipped = [
        k
        for k in keys
        if fmt == "safetensors" and not isinstance(values[k], (torch.Tensor, np.ndarray))
    ]
    obj: dict[str, Any] = {}
    for k in keys:
        if k in skipped:
            continue
        value = values[k]
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        name = k if args.keep_prefix or not prefix else k[len(prefix) :] or k
        obj[name] = value if isinstance(value, torch.Tensor) else _weights_only_safe(value)
    _write_export(obj, out, fmt, v.id, v.step, v.metadata, skipped, args.json)
    return 0


def _write_export(
    obj: dict[str, Any],
    out: Path,
    fmt: str,
    version: int,
    step: int,
    metadata: Any,
    skipped: list[str],
    as_json: bool,
) -> None:
    """Write ``obj`` to ``out`` atomically (temp file, then rename) and report it."""
    import torch

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            meta = {
                "tiercheck.version": str(version),
                "tiercheck.step": str(step),
                "tiercheck.metadata": json.dumps(dict(metadata), default=_json_default),
            }
            save_file(obj, str(tmp), metadata=meta)
        else:
            torch.save(obj, tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    result: dict[str, Any] = {
        "version": version,
        "step": step,
        "out": str(out),
        "format": fmt,
        "entries": len(obj),
        "bytes": out.stat().st_size,
        "skipped": skipped,
    }
    if as_json:
        emit_json(result)
        return
    console = _console()
    console.print(
        f"exported {len(obj)} entries of version {version} (step {step}) to {out} "
        f"({human_size(result['bytes'])})"
    )
    if skipped:
        why = "not tensors" if fmt == "safetensors" else "stored with pickle"
        console.print(f"skipped {len(skipped)} entries ({why}): " + ", ".join(skipped))


def _export_dcp(args: argparse.Namespace, out: Path, fmt: str) -> int:
    """Export a DCP root's checkpoint, assembled from every rank, with the plain keys given
    to ``dcp.save`` (nested dicts joined by ``/``: ``model/layer.weight``)."""
    import torch

    from tiercheck.history import versions as history
    from tiercheck.integrations import dcp

    try:
        kind, n = history.parse_version_spec(args.version)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cid = {"latest": None, "id": f"version:{n}", "step": f"step:{n}"}[kind]
    reader = dcp.TierReader(args.root, checkpoint_id=cid)
    try:
        sd = dcp.load_full_state_dict(reader)
    except NoRestorableVersion as exc:
        raise UsageError(f"{args.root}: {exc}") from None
    info = reader.version
    assert info is not None
    flat: dict[str, Any] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{key}/{k}" if key else str(k))
        else:
            flat[key] = node

    walk(sd, "")
    prefix = args.only or ""
    keys = [k for k in flat if k.startswith(prefix)]
    if not keys:
        raise UsageError(f"the DCP checkpoint has no entry whose key starts with {prefix!r}")
    skipped = [k for k in keys if fmt == "safetensors" and not isinstance(flat[k], torch.Tensor)]
    obj = {
        (k if args.keep_prefix or not prefix else k[len(prefix) :] or k): (
            flat[k] if isinstance(flat[k], torch.Tensor) else _weights_only_safe(flat[k])
        )
        for k in keys
        if k not in skipped
    }
    _write_export(obj, out, fmt, info.id, info.step, info.metadata, skipped, args.json)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from tiercheck.history import versions as history

    with contextlib.closing(open_store(args.root)) as probe:
        configured = any(args.to in (s.name, s.spec.url) for s in probe.tierset.slots)
    with contextlib.closing(open_store(args.root, write=configured)) as ckpt:
        v = pick_version(ckpt, args.version)
        try:
            with progress_bar(not args.json, "migrating") as progress:
                report = history.migrate(ckpt, v, args.to, progress=progress)
        except InvalidURL as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            emit_json(report.to_json())
        else:
            console = _console()
            if report.versions:
                console.print(
                    f"copied versions {', '.join(map(str, report.versions))} to {report.url}: "
                    f"{report.chunks_written} chunks, {human_size(report.bytes_written)} "
                    f"in {report.seconds:.2f}s"
                )
            if report.already:
                console.print(
                    f"{report.url} already held versions {', '.join(map(str, report.already))}"
                )
            if not report.configured:
                console.print(
                    f"{report.url} is not a tier of this store: it now holds a self-contained "
                    f"copy; browse it with `tiercheck ls {report.url}`, restore from it with "
                    "Checkpointer(root, tiers=[url], read_only=True)"
                )
    return 0


def cmd_peer_serve(args: argparse.Namespace) -> int:
    from tiercheck.backends._peer_protocol import load_token_file, token_from_env
    from tiercheck.peer import server as peer_server

    if not args.json:
        return peer_server.run_serve(args)
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr)
    try:
        token = load_token_file(args.token_file) if args.token_file else token_from_env()
        peer_server.serve(
            args.listen,
            memory_limit=args.memory_limit,
            token=None if args.insecure_no_auth and not args.token_file else token,
            max_frame=args.max_frame,
            insecure_no_auth=args.insecure_no_auth,
            max_connections=args.max_connections,
            idle_timeout=args.idle_timeout,
            keepalive=args.keepalive,
            announce=lambda address: print(json.dumps({"listening": address}), flush=True),
        )
    except (ConfigError, ValueError, OSError) as exc:
        raise UsageError(f"peer serve: {exc}") from None
    return 0


def cmd_peer_status(args: argparse.Namespace) -> int:
    from tiercheck.peer import server as peer_server

    try:
        stats = peer_server.peer_status(
            args.address, token_file=args.token_file, timeout=args.timeout
        )
    except InvalidURL as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        emit_json(stats)
        return 0
    from rich.table import Table

    t = Table(title=f"peer {args.address}", title_justify="left")
    t.add_column("field")
    t.add_column("value")
    for k, value in sorted(stats.items()):
        shown = human_size(value) if "bytes" in k and isinstance(value, int) else str(value)
        t.add_row(k, shown)
    _console().print(t)
    return 0


def cmd_peer_token(args: argparse.Namespace) -> int:
    from tiercheck.backends._peer_protocol import load_token_file, token_from_env
    from tiercheck.peer.server import namespace_token

    try:
        admin = load_token_file(args.token_file) if args.token_file else token_from_env()
    except (OSError, ValueError) as exc:
        raise UsageError(f"peer token: {exc}") from None
    if admin is None:
        raise UsageError(
            "peer token needs the daemon's token: --token-file FILE or TIERCHECK_PEER_TOKEN"
        )
    token = namespace_token(admin, args.namespace).decode()
    if args.json:
        emit_json({"namespace": args.namespace, "token": token})
    else:
        print(token)
    return 0


def _plan_inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, list[Any]]:
    """The job, failure model, hardware, measured rates and designs ``plan`` was given."""
    from dataclasses import replace

    from tiercheck.planning import failure_model, tier_costs
    from tiercheck.planning import intervals as plan

    try:
        job = plan.Job(
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
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
                _console().print(f"wrote the default {what} model to {path}")
        return 0
    job, failures, hardware, measured, designs = _plan_inputs(args)
    try:
        result = plan.plan(
            job,
            failures,
            hardware,
            measured,
            designs,
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

    console = _console()
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
            r.survives.value,
            _seconds(r.write_seconds(job.state_bytes_per_rank, job.mean_state)),
            _seconds(r.read_seconds(job.state_bytes_per_rank, job.mean_state)),
            f"{w} / {rd}",
        )
    console.print(rt)
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
            t.survives,
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
            c.name,
            c.domain,
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
                      f"{args.config_out}")  # fmt: skip
    return 0


# --- parser -----------------------------------------------------------------------------


def _nonneg_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if x < 0 or not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return x


def _nonneg_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    x = _nonneg_float(text)
    if x == 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return x


def _size(text: str) -> int:
    from tiercheck.peer.server import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The full ``tiercheck`` argument parser (docs/gen_cli.py renders it to docs/cli.md)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument(
        "-v", "--verbose", action="store_true", help="show tiercheck's log and tracebacks"
    )
    version_help = "a version id, 'latest' or 'step:N'"
    root_help = (
        "store root (the directory with tiercheck.toml), a DCP root (TierWriter's, with one "
        "store per rank), or a tier URL such as one `migrate --to` wrote (read-only)"
    )
    url_help = "store root, or a tier URL (read-only)"

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Browse and manage tiercheck checkpoint stores.",
        epilog="Exit status: 0 ok, 1 problems found, 2 usage error.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "ls",
        parents=[common],
        help="list the versions of a store",
        description="List every committed version: step, role (base; diff of N; log of N: "
        "the state of N with the optimizer steps logged since replayed), time, sizes (of the "
        "state, and stored in its tiers) and, per tier, committed / migrating / missing / "
        "dropped / unreachable. Reads the logs only.",
    )
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("--limit", type=_nonneg_int, metavar="N", help="only the newest N versions")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "show",
        parents=[common],
        help="show one version: entries, chunks, ratios, metadata",
        description="Show a version: the entries of its state (dtype, shape, size), chunks, "
        "dedup ratio, changed chunks against its base, per-tier stored bytes, and metadata. "
        "For a log version: the replay chain, what it stores (logged gradients, own leaves) "
        "and which entries its replay reproduces from the base. Reads the shard manifests "
        "only (a log version's and its base's).",
    )
    p.add_argument("root", metavar="ROOT", help=url_help)
    p.add_argument("version", metavar="VERSION", help=version_help)
    p.add_argument("--rank", type=_nonneg_int, metavar="N", help="shard of rank N (default 0)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "diff",
        parents=[common],
        help="compare two versions entry by entry",
        description="List entries added, removed, changed (max abs difference, relative L2 "
        "change) and unchanged between the states of versions A and B. Entries whose chunks "
        "are identical are decided without reading data. A log version's replayed entries "
        "are read by replaying its log as export does, so `diff BASE LOG` shows what the "
        "logged optimizer steps changed.",
    )
    p.add_argument("root", metavar="ROOT", help=url_help)
    p.add_argument("a", metavar="A", help=version_help)
    p.add_argument("b", metavar="B", help=version_help)
    p.add_argument("--rank", type=_nonneg_int, metavar="N", help="shard of rank N (default 0)")
    p.add_argument("--unchanged", action="store_true", help="also list unchanged entries")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser(
        "verify",
        parents=[common],
        help="re-hash every blob of every kept version",
        description="Read and re-hash every blob (manifests, chunks, delta bases) of every "
        "version each tier keeps. Exit status 1 if a problem remains. With --repair, bad or "
        "missing copies are rewritten from an intact copy in another tier (takes the writer "
        "lock). A blob written by a newer major format is reported as newer-format (upgrade "
        "tiercheck to check it) and left as it is.",
    )
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument(
        "--tier",
        action="append",
        metavar="NAME",
        help="check only this tier (name or URL; repeatable)",
    )
    p.add_argument("--repair", action="store_true", help="repair from another tier")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "gc",
        parents=[common],
        help="delete blobs no kept version references, or orphaned shm segments",
        description="Mark and sweep every tier: blobs referenced by no version the tier keeps "
        "are deleted once past the grace period. Takes the writer lock unless --dry-run. A "
        "tier shared with a process that is writing to it is skipped (its write lease says "
        "so). With --orphans (and no ROOT): list the shm segments of this node whose store "
        "is gone or no longer names them; --yes deletes them.",
    )
    p.add_argument("root", metavar="ROOT", nargs="?", help="store root")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--orphans",
        action="store_true",
        help="find shm segments of deleted stores on this node (a dry run unless --yes)",
    )
    p.add_argument(
        "--yes", "--delete", dest="yes", action="store_true", help="with --orphans: delete them"
    )
    p.add_argument(
        "--shm-root",
        action="append",
        metavar="DIR",
        help="with --orphans: shm root to scan (repeatable; default /dev/shm/tiercheck)",
    )
    p.add_argument(
        "--grace",
        type=_nonneg_float,
        metavar="SECONDS",
        help="grace period for this run (default: the policy's, on this process's clock, "
        "which starts now; 0 deletes at once)",
    )
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "rm",
        parents=[common],
        help="delete a store with its shm segments and LMDB",
        description="Delete the store at ROOT: the root directory, the shm segments it owns "
        "(also those a deleted root left behind) and its LMDB environments. Refused while a "
        "process holds the store open for writing. Remote tiers outside the root and peer "
        "daemons are kept and listed.",
    )
    p.add_argument("root", metavar="ROOT", help="store root")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a version to .safetensors or .pt",
        description="Export a version's entries to OUT: .safetensors (tensors only; version, "
        "step and metadata in the header) or .pt/.pth (a flat dict that loads with "
        "torch.load(weights_only=True)). Keys are the flattened paths, e.g. "
        "model/layers.0.weight; with --only PREFIX only those entries, the prefix removed. "
        "A log version is replayed first: its base's tensors, with the logged optimizer "
        "steps (a torch.optim optimizer, under the run's torch version and device type).",
    )
    p.add_argument("root", metavar="ROOT", help=root_help)
    p.add_argument("version", metavar="VERSION", help=version_help)
    p.add_argument("out", metavar="OUT", help="output file (.safetensors, .pt or .pth)")
    p.add_argument("--only", metavar="PREFIX", help="only entries under PREFIX, e.g. model/")
    p.add_argument("--keep-prefix", action="store_true", help="keep PREFIX in the keys")
    p.add_argument("--rank", type=_nonneg_int, metavar="N", help="shard of rank N (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "migrate",
        parents=[common],
        help="copy a version (and its base) to a tier",
        description="Copy a version, every rank's shard and the base it needs, to --to: one "
        "of the store's tiers (name or URL; takes the writer lock) or any tier URL, which "
        "then holds a self-contained copy (browse it with `tiercheck ls URL`).",
    )
    p.add_argument("root", metavar="ROOT", help="store root")
    p.add_argument("version", metavar="VERSION", help=version_help)
    p.add_argument("--to", required=True, metavar="URL", help="target tier name or URL")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser(
        "peer",
        help="run or query a peer-memory daemon",
        description="The peer-memory daemon that serves peer:// tiers.",
    )
    peer = p.add_subparsers(dest="peer_command", metavar="COMMAND", required=True)
    from tiercheck.peer import server as peer_server

    ps = peer.add_parser(
        "serve",
        parents=[common],
        help="run the daemon",
        description="Run the peer-memory daemon until SIGTERM/SIGINT; prints the bound "
        "address once clients can connect.",
    )
    peer_server.add_serve_arguments(ps)
    ps.set_defaults(func=cmd_peer_serve)
    pq = peer.add_parser(
        "status",
        parents=[common],
        help="show what a daemon holds",
        description="Ask the daemon at HOST:PORT for its statistics. Exit status 1 if it "
        "cannot be reached.",
    )
    peer_server.add_status_arguments(pq)
    pq.set_defaults(func=cmd_peer_status)
    pt = peer.add_parser(
        "token",
        parents=[common],
        help="print the token of one namespace",
        description="Print the token that opens NAMESPACE only, derived from the daemon's "
        "token (--token-file or TIERCHECK_PEER_TOKEN). Give each rank its own namespace's "
        "token: it cannot read, overwrite or delete another namespace. Store it in a file "
        "of mode 0600 and pass it as the tier's token_file option.",
    )
    pt.add_argument("namespace", metavar="NAMESPACE")
    pt.add_argument(
        "--token-file", metavar="FILE", help="the daemon's token file (else $TIERCHECK_PEER_TOKEN)"
    )
    pt.set_defaults(func=cmd_peer_token)

    p = sub.add_parser(
        "plan",
        parents=[common],
        help="plan checkpoint intervals and compare tier designs at scale",
        description="Simulate a job of --gpus GPUs under a failure model (default: the 419 "
        "interruptions of a 54-day run on 16,384 GPUs) with tier costs measured by "
        "tiercheck's benchmarks and scaled to the target hardware, for a single remote tier, "
        "tiercheck's default store and the full tiered store, each with and without log "
        "versions. Prints each design's best interval, goodput and gain over the single "
        "remote tier, and per tier and failure class the interval (simulated, Young, Daly), "
        "lost work and recovery time. Model and sources: docs/goodput.md.",
    )
    p.add_argument("--gpus", type=_positive_int, default=16384, metavar="N", help="GPUs (16384)")
    p.add_argument(
        "--gpus-per-node", type=_positive_int, default=8, metavar="N", help="GPUs per node (8)"
    )
    p.add_argument(
        "--state-per-rank",
        type=_size,
        default="4GB",
        metavar="SIZE",
        help="largest rank's checkpointed state, e.g. 4GB, 512MiB (4GB)",
    )
    p.add_argument(
        "--mean-state-per-rank",
        type=_size,
        metavar="SIZE",
        help="mean bytes a rank adds to the shared remote tier (396MB, 405e9 params x 16 B "
        "over 16384 GPUs, or --state-per-rank if smaller)",
    )
    p.add_argument(
        "--step-time", type=_positive_float, default=5.9, metavar="SECONDS", help="step (5.9)"
    )
    p.add_argument(
        "--days", type=_positive_float, default=54.0, metavar="DAYS", help="run length (54)"
    )
    p.add_argument("--failures", metavar="FILE", help="failure model TOML (see --write-failures)")
    p.add_argument("--hardware", metavar="FILE", help="target bandwidths TOML (--write-hardware)")
    p.add_argument(
        "--remote-gbps",
        type=_positive_float,
        metavar="GBPS",
        help="remote store aggregate GB/s, both ways (overrides the hardware's; 2000)",
    )
    p.add_argument(
        "--bench", metavar="DIR", help="read measured tier rates from a benchmarks/results DIR"
    )
    p.add_argument(
        "--design",
        action="append",
        metavar="NAME",
        help="only this design (repeatable): remote, remote+log, local+remote, "
        "local+remote+log, tiered, tiered+log",
    )
    p.add_argument(
        "--log-bytes-per-step",
        type=_positive_float,
        default=0.35,
        metavar="F",
        help="log version bytes per logged step, x the state (0.35)",
    )
    p.add_argument("--runs", type=_positive_int, default=16, metavar="N", help="seeds (16)")
    p.add_argument("--seed", type=_nonneg_int, default=0, metavar="N", help="first seed (0)")
    p.add_argument(
        "--config-out", metavar="FILE", help="write the recommended tiercheck.toml to FILE"
    )
    p.add_argument(
        "--write-failures", metavar="FILE", help="write the default failure model and exit"
    )
    p.add_argument(
        "--write-hardware", metavar="FILE", help="write the default hardware model and exit"
    )
    p.set_defaults(func=cmd_plan)
    return parser


# --- entry point ------------------------------------------------------------------------


def _fail(code: int, message: str, *, as_json: bool = False) -> int:
    """Report a failure as one line on stderr (and, with ``--json``, as one JSON document
    ``{"error": ..., "exit_status": ...}`` on stdout, so a script reading stdout sees it)."""
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"{PROG}: error: {first}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": first, "exit_status": code}))
    return code


def _library_error(exc: BaseException) -> str:
    """One line naming a library's own error: ``botocore NoCredentialsError: ...``."""
    module = type(exc).__module__.partition(".")[0]
    origin = "" if module in ("builtins", "tiercheck") else f"{module} "
    return f"{origin}{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _logging_for(verbose: bool) -> Iterator[None]:
    """Quiet tiercheck's logger for the command (it reports problems itself); restored after,
    so that calling :func:`main` in a process leaves its logging as it was."""
    logger = logging.getLogger("tiercheck")
    level = logger.level
    handler: logging.Handler | None = None
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    else:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)
        if handler is not None:
            logger.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code) if isinstance(exc.code, int) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    verbose = bool(getattr(args, "verbose", False))
    as_json = bool(getattr(args, "json", False))
    try:
        if func is cmd_peer_serve:  # configures its own logging
            return func(args)
        with _logging_for(verbose):
            return func(args)
    except UsageError as exc:
        return _fail(2, str(exc), as_json=as_json)
    except KeyboardInterrupt:
        return _fail(130, "interrupted", as_json=as_json)
    except BrokenPipeError:
        return 0
    except Exception as exc:
        # tiercheck's typed errors, and the ones a backend library raises as its own
        # (botocore's NoCredentialsError, lmdb.Error, fsspec's, ...): one line, not a
        # traceback; -v shows the traceback
        if verbose:
            raise
        return _fail(1, _library_error(exc), as_json=as_json)
