"""``tiercheck ls``, ``show`` and ``diff``: what a store holds and what changed between versions."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercheck.cli.common import (
    STATE_STYLE,
    absolute_time,
    dcp_ranks,
    emit_json,
    format_ratio,
    human_size,
    json_default,
    label,
    make_console,
    open_store,
    plain,
    read_picked,
    relative_time,
    tiers_json,
)
from tiercheck.errors import TiercheckError

if TYPE_CHECKING:
    from tiercheck.history import versions as history


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
    from tiercheck.history.versions import dropped_summary, vanished_tiers

    versions = ckpt.history()
    catalog = ckpt.refresh()
    dropped = dropped_summary(versions, catalog)
    vanished = vanished_tiers(ckpt, catalog)
    if args.limit is not None:
        versions = versions[-args.limit :] if args.limit > 0 else []
    data = {
        "root": label(ckpt),
        "tiers": tiers_json(ckpt, vanished),
        "versions": [v.to_json() for v in versions],
        "not_listed": dropped,
    }
    if not args.json:
        _ls_table(ckpt, versions, vanished, dropped)
    return data


def _ls_table(
    ckpt: Any,
    versions: list[history.Version],
    vanished: Mapping[str, str],
    dropped: str | None = None,
) -> None:
    """``vanished``: the tiers whose content is gone, with why
    (:func:`tiercheck.history.versions.vanished_tiers`)."""
    from rich.table import Table

    names = [s.name for s in ckpt.tierset.slots]
    table = Table(title=plain(label(ckpt)), title_justify="left")
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
        table.add_column(plain(n))
    now = time.time()
    for v in versions:
        role = _role(v)
        mark = "" if v.restorable else f" [red]({plain(v.gone or 'not restorable')})[/red]"
        cells = [
            f"[{STATE_STYLE.get(v.tiers[n], '')}]{v.tiers[n]}[/]" if v.tiers[n] else ""
            for n in names
        ]
        table.add_row(
            f"{v.id}{mark}",
            str(v.step),
            role,
            f"{absolute_time(v.time)} ({relative_time(v.time, now)})",
            *(  # a lost version's row has no sizes: the ack ledger does not record them
                ("-", "-")
                if v.gone is not None and not v.holders
                else (human_size(v.logical_bytes), human_size(v.stored_bytes))
            ),
            *cells,
        )
    console = make_console()
    console.print(table)
    from tiercheck.store.config import without_userinfo
    from tiercheck.store.guarantees import describe_survival

    for s in ckpt.tierset.slots:  # what each column's copies survive
        if s.tier is None:
            console.print(
                f"[red]tier {plain(s.name)} ({plain(without_userinfo(s.spec.url))}) is "
                f"unavailable: "
                f"{plain(s.error)}[/red]"
            )
        elif s.name in vanished:
            console.print(f"[red]tier {plain(s.name)} {plain(vanished[s.name])}[/red]")
        else:
            console.print(f"{plain(s.name)}: survives {describe_survival(s.tier.capabilities)}")
    if dropped is not None:
        console.print(plain(dropped))
    lost: dict[str, list[int]] = {}
    for v in versions:
        if v.gone is not None:
            lost.setdefault(v.gone, []).append(v.step)
    for gone, steps in lost.items():
        console.print(
            f"[red]{len(steps)} acknowledged version(s) {plain(gone)} (steps "
            f"{', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''}): "
            "a restore resumes from the newest restorable version[/red]"
        )
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
        from tiercheck.logversions.replay import replayed_keys

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
        v, data = read_picked(
            ckpt, [args.version], args.rank, lambda vs: (vs[0], _show_data(vs[0]))
        )
        if args.json:
            emit_json(data)
            return 0
        from rich.table import Table

        console = make_console()
        console.print(f"[bold]version {v.id}[/bold]  step {v.step}  {_role(v, 'version ')}")
        rp = data["replay"]
        if rp is not None:
            console.print(
                f"replay    version {rp['base']}, then {rp['steps']} optimizer step(s) "
                f"({rp['skipped']} skipped by the GradScaler) of {plain(rp['optimizer'])} "
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
        why = f" ({plain(v.gone)})" if v.gone is not None else ""
        console.print(f"restorable {'yes' if v.restorable else f'[red]no{why}[/red]'}")
        ch = data["chunks"]
        console.print(
            f"chunks    {ch['total']} of {human_size(data['chunk_size'])}, {ch['unique']} unique "
            f"({human_size(ch['unique_bytes'])}), dedup ratio {format_ratio(ch['dedup_ratio'])}"
        )
        bd = data["base_delta"]
        if bd is not None and "error" not in bd:
            console.print(
                f"vs base   {bd['chunks_changed']} of {ch['total']} chunks changed "
                f"(delta ratio {format_ratio(bd['changed_fraction'])})"
            )
        elif bd is not None:
            console.print(f"vs base   base {bd['id']} unreadable: {plain(bd['error'])}")
        if v.metadata:
            console.print("metadata  " + plain(json.dumps(dict(v.metadata), default=json_default)))
        tt = Table(title="tiers", title_justify="left")
        for col in ("tier", "state", "chunks written", "bytes written", "stored/logical", "delta"):
            tt.add_column(col)
        for name, row in data["tier_detail"].items():
            tt.add_row(
                plain(name),
                f"[{STATE_STYLE.get(row['state'], '')}]{row['state']}[/]",
                str(row.get("chunks_written", "-")),
                human_size(row["bytes_written"]) if "bytes_written" in row else "-",
                format_ratio(row.get("stored_ratio")),
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
                plain(e["key"]),
                e["kind"],
                plain(e["dtype"] or "-"),
                "x".join(map(str, e["shape"])) if e["kind"] in ("tensor", "ndarray") else "-",
                human_size(e["size"]),
                "replayed" if e["replayed"] else str(e["chunks"]),
            )
        console.print(et)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from tiercheck.history.diff import diff

    with contextlib.closing(open_store(args.root)) as ckpt:
        va, vb, d = read_picked(
            ckpt, [args.a, args.b], args.rank, lambda vs: (vs[0], vs[1], diff(vs[0], vs[1]))
        )
        if args.json:
            emit_json(d.to_json())
            return 0
        from rich.table import Table

        console = make_console()
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
                t.add_row(
                    plain(c.key), plain(what), format_ratio(c.max_abs_diff), format_ratio(c.rel_l2)
                )
            console.print(t)
        for title, items in (("added", d.added), ("removed", d.removed)):
            if items:
                t = Table(title=title, title_justify="left")
                for col in ("key", "kind", "dtype", "shape", "size"):
                    t.add_column(col)
                for e in items:
                    t.add_row(
                        plain(e.key),
                        e.kind,
                        plain(e.dtype or "-"),
                        str(list(e.shape)),
                        human_size(e.size),
                    )
                console.print(t)
        if args.unchanged and d.unchanged:
            console.print("unchanged: " + plain(", ".join(d.unchanged)))
    return 0


def _describe(e: history.EntryInfo) -> str:
    if e.kind in ("tensor", "ndarray"):
        return f"{e.kind} {e.dtype} {list(e.shape)}"
    return e.kind
