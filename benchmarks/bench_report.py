"""Tables and plots of a ``benchmarks/run.py`` result: stdout, docs/benchmarks.md and
docs/benchmarks/*.png (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "bytes":
        return f"{value / MIB:,.1f} MiB" if value < 10 * GIB else f"{value / GIB:.2f} GiB"
    if unit == "s":
        return f"{value * 1e3:,.1f} ms" if value < 10 else f"{value:.1f} s"
    return f"{value:.3f} {unit}"


def _ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def comparison_rows(res: dict[str, Any]) -> list[list[str]]:
    units = {k: v["unit"] for k, v in res["metrics"].items()}
    rows = []
    for c in res["comparisons"]:
        target = "-" if c["target"] is None else f"<= {c['target']:g}x"
        met = {True: "yes", False: "**no**", None: "-"}[c["met"]]
        rows.append(
            [
                c["name"],
                _fmt(c["tiercheck_value"], units.get(c["tiercheck"], "s")),
                _fmt(c["peer_value"], units.get(c["peer"], "s")),
                _ratio(c["ratio"]),
                target,
                met,
            ]
        )
    return rows


# Why a goal can be missed, by the tiercheck metric it compares: what the time is spent
# on, and what the peer does not do. Printed under the table for each goal not met.
WHY_MISSED = {
    "tc_blocked_first_s": "the first `save()` walks the whole state and builds its layout "
    "(every later call reuses it); DCP's first `async_save` defers its planning to the "
    "background.",
    "tc_staged_s": "staging is one copy of every tensor into the reused staging buffer, as "
    "the peer's copy is; the difference is the hand-off to the pipeline thread and the "
    "zeroing of the padding between tensors, a few tens of ms that the load of this shared "
    "machine moves the ratio around by.",
    "tc_migrate_file_s": "the disk: both write and fsync the same bytes, so both sit on "
    "the disk's floor (table below), and this virtual disk's speed moves by 20-50% from one "
    "second to the next. A migration fsyncs every 4 MiB blob before naming it "
    "(content-addressed blobs: presence must imply completeness), the directories it named "
    "them in, and the log record, where DCP fsyncs two data files and its metadata; reading, "
    "verifying and writing into the page cache overlap the fsyncs (see the profile).",
    "tc_committed_default_s": "the LMDB sync: see the profile below, where committed:lmdb "
    "is the save's end; the writes and syncs of its transactions follow the hashing of the "
    "windows.",
    "tc_restore_file_s": "restore verifies the BLAKE3 of every chunk and reads into the "
    "staging buffer before it copies into the tensors (the caller's state is untouched "
    "until the whole version is verified); `dcp.load` reads straight into the tensors and "
    "verifies nothing.",
}


def unmet_section(res: dict[str, Any]) -> str:
    missed = [c for c in res["comparisons"] if c["met"] is False]
    if not missed:
        return "Every goal was met in this run.\n"
    lines = ["Goals not met in this run, and why:", ""]
    for c in missed:
        why = WHY_MISSED.get(c["tiercheck"], "no explanation recorded.")
        lines.append(f"- **{c['name']}** ({_ratio(c['ratio'])}): {why}")
    return "\n".join(lines) + "\n"


# The durable paths shown against the disk's floor (write + fsync of the raw bytes).
FLOOR_ROWS = [
    ("`dcp.save` (FileSystemWriter, 2 threads)", "dcp_save_disk_s"),
    ("`torch.save` + fsync", "torch_save_disk_fsync_s"),
    ("tiercheck, LMDB alone, committed", "tc_committed_lmdb_s"),
    ("tiercheck, default store (shm + LMDB), committed", "tc_committed_default_s"),
    ("tiercheck, migration to the `file://` tier", "tc_migrate_file_s"),
]


def floor_section(res: dict[str, Any]) -> str:
    metrics = res["metrics"]
    floor = metrics.get("disk_write_fsync_s", {}).get("median")
    if not floor:
        return ""
    rows = [
        [what, _fmt(metrics[k]["median"], "s"), _ratio(metrics[k]["median"] / floor)]
        for what, k in FLOOR_ROWS
        if metrics.get(k, {}).get("median") is not None
    ]
    return (
        "\nThe disk's floor in this run: the state's bytes, as they lie in memory, written "
        f"by two threads to one new file each and fsynced took {_fmt(floor, 's')} "
        "(`disk_write_fsync_s`): what making the state durable in new files costs on this "
        "disk. `dcp.save`, `torch.save` and the `file://` tier write new files; LMDB rewrites "
        "pages of its file that it already owns (no blocks to allocate, no extents to "
        "journal) while the state is still being hashed, which is how it can come in under "
        "the floor. Each durable path "
        f"against it:\n\n{_md(['durable path', 'seconds', 'x the floor'], rows)}\n"
    )


def _phase_meaning(phase: str) -> str:
    kind, _, tier = phase.partition(":")
    return {
        "staged": "save() call to the state copied into staging",
        "hashed": "save() call to every chunk hashed (the tiers were written meanwhile)",
        "prepared": f"placing the version on {tier}, from its writer's start to its prepare "
        "record (a duration)",
        "committed": f"save() call to the commit record at {tier}"
        if tier
        else "save() call to committed at every synchronous tier",
        "migrated": "save() call to the commit record at the remote tier",
    }.get(kind, "")


def profile_section(res: dict[str, Any]) -> str:
    phases = res.get("profile", {}).get("default_store")
    if not phases:
        return ""
    rows = [
        [f"`{k}`", _fmt(v, "s"), _phase_meaning(k)]
        for k, v in sorted(phases.items(), key=lambda kv: kv[1])
    ]
    return (
        "\nWhere the time of a default-store save goes (medians of its steady-state saves):"
        f"\n\n{_md(['phase', 'seconds', 'from, to'], rows)}\n"
    )


def metric_rows(res: dict[str, Any], docs: dict[str, str]) -> list[list[str]]:
    rows = []
    for k, m in res["metrics"].items():
        runs = m["runs"]
        spread = (
            f"{_fmt(min(runs), m['unit'])} .. {_fmt(max(runs), m['unit'])}"
            if len(runs) > 1 and None not in runs
            else ""
        )
        rows.append([f"`{k}`", _fmt(m["median"], m["unit"]), spread, docs.get(k, "")])
    return rows


def bpv_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for scen, b in res["bytes_per_version"].items():
        if "status" in b:
            rows.append([scen, b["status"], "", "", "", "", "", b["reason"]])
            continue
        if b.get("kind") == "data_parallel":
            full = b["all_shards_bytes"]
            shared = b["shared_bytes"]
            rows.append(
                [
                    scen,
                    f"{b['ranks']} ranks: {b['replica_bytes'] / MIB:.0f} MiB replica + "
                    f"{b['own_bytes'] / MIB:.0f} MiB own each",
                    f"{full / MIB:.2f} MiB ({b['ranks']} files)",
                    "",
                    "",
                    "",
                    f"{shared / MIB:.2f} MiB ({shared / full:.3f}x)",
                    f"shared tier, every version; without cross-rank dedup "
                    f"{b['per_rank_bytes'] / MIB:.2f} MiB ({b['ratio_vs_no_dedup']:.2f}x more). "
                    + b["note"],
                ]
            )
            continue
        full = b["torch_save_bytes"]

        def cell(x: float | None, full: float = full) -> str:
            return "n/a" if x is None else f"{x / MIB:.2f} MiB ({x / full:.3f}x)"

        rows.append(
            [
                scen,
                f"{b['trainable_params'] / 1e6:.2f} M of {b['params'] / 1e6:.2f} M",
                f"{full / MIB:.2f} MiB",
                cell(b["base_shm_bytes"]),
                cell(b["diff_shm_bytes"]),
                cell(b["diff_delta_bytes"]),
                cell(b["base_remote_bytes"]),
                "",
            ]
        )
    return rows


def sweep_rows(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    keys = [k for k in res["sweep"][0] if k != "state_bytes"] if res["sweep"] else []
    head = ["state", *[f"`{k}`" for k in keys]]
    rows = []
    for row in res["sweep"]:
        rows.append(
            [
                _fmt(row["state_bytes"], "bytes"),
                *[_fmt(row[k], "bytes" if k.endswith("bytes") else "s") for k in keys],
            ]
        )
    return head, rows


def _md(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_table(res: dict[str, Any]) -> None:
    head = ["comparison", "tiercheck", "peer", "ratio", "target", "met"]
    rows = comparison_rows(res)
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    t = res["training"]
    print(
        f"training {t['steps']} steps: none {t['none_s']:.2f} s, "
        f"tiercheck {t['tiercheck_s']:.2f} s "
        f"({t['tiercheck_slowdown']:.2f}x), dcp async {t['dcp_async_s']:.2f} s "
        f"({t['dcp_async_slowdown']:.2f}x)"
    )


# --- plots ----------------------------------------------------------------------------------


def _bars(
    ax: Any,
    labels: list[str],
    values: list[float],
    colors: list[str],
    unit: str,
    log: bool = False,
) -> None:
    ys = list(range(len(labels)))
    ax.barh(ys, values, color=colors)
    ax.set_yticks(ys, labels)
    ax.invert_yaxis()
    finite = [v for v in values if v == v and v > 0] or [1.0]
    top = max(finite)
    for y, v in zip(ys, values):
        if v == v:
            ax.text(v * 1.1 if log else v + top * 0.01, y, _fmt(v, unit), va="center", fontsize=8)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(finite) / 2, top * 6)
    else:
        ax.set_xlim(0, top * 1.25)


TC = "#1b7837"
PEER = "#762a83"
REF = "#999999"


def _m(res: dict[str, Any], k: str) -> float:
    v = res["metrics"].get(k, {}).get("median")
    return float("nan") if v is None else float(v)


def plot_save(res: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    gib = res["state"]["bytes"] / GIB
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    items = [
        ("tiercheck save() blocked (first)", "tc_blocked_first_s", TC),
        ("tiercheck save() blocked", "tc_blocked_s", TC),
        ("DCP async_save blocked (first)", "dcp_async_blocked_first_s", PEER),
        ("DCP async_save blocked", "dcp_async_blocked_s", PEER),
        ("tiercheck staged", "tc_staged_s", TC),
        ("DCP async staged", "dcp_async_staged_s", PEER),
        ("plain copy, warm buffer", "copy_warm_s", REF),
        ("plain copy, fresh memory", "copy_fresh_s", REF),
    ]
    _bars(
        axes[0],
        [i[0] for i in items],
        [_m(res, i[1]) for i in items],
        [i[2] for i in items],
        "s",
        log=True,
    )
    axes[0].set_xlabel("seconds (log scale)")
    axes[0].set_title(f"Time the trainer waits ({gib:.2f} GiB state)")
    items = [
        ("tiercheck committed: shm", "tc_committed_shm_s", TC),
        ("tiercheck committed: LMDB", "tc_committed_lmdb_s", TC),
        ("tiercheck committed: file (raw)", "tc_committed_file_s", TC),
        ("tiercheck default store: shm+LMDB", "tc_committed_default_s", TC),
        ("tiercheck default: migrated to remote", "tc_migrated_remote_s", TC),
        ("torch.save -> /dev/shm", "torch_save_shm_s", PEER),
        ("torch.save -> disk + fsync", "torch_save_disk_fsync_s", PEER),
        ("safetensors -> /dev/shm", "safetensors_save_shm_s", PEER),
        ("dcp.save -> disk", "dcp_save_disk_s", PEER),
        ("DCP async -> disk committed", "dcp_async_committed_disk_s", PEER),
    ]
    _bars(
        axes[1], [i[0] for i in items], [_m(res, i[1]) for i in items], [i[2] for i in items], "s"
    )
    axes[1].set_xlabel("seconds")
    axes[1].set_title("Time until the checkpoint is committed / written")
    fig.tight_layout()
    fig.savefig(out / "save.png", dpi=110)
    plt.close(fig)


def plot_restore(res: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    s3 = res["metrics"].get("s3_state_bytes", {}).get("median")
    s3_note = f" ({s3 / MIB:.0f} MiB state)" if s3 else ""
    items = [
        ("tiercheck restore: shm", "tc_restore_shm_s", TC),
        ("tiercheck restore: LMDB", "tc_restore_lmdb_s", TC),
        ("tiercheck restore: file", "tc_restore_file_s", TC),
        ("torch.load <- /dev/shm", "torch_load_shm_s", PEER),
        ("dcp.load <- /dev/shm", "dcp_load_shm_s", PEER),
        ("safetensors load <- /dev/shm", "safetensors_load_shm_s", PEER),
    ]
    _bars(ax, [i[0] for i in items], [_m(res, i[1]) for i in items], [i[2] for i in items], "s")
    ax.set_xlabel("seconds")
    ax.set_title(
        f"Restore ({res['state']['bytes'] / GIB:.2f} GiB; s3 via moto{s3_note}: "
        f"{_fmt(_m(res, 'tc_restore_s3_s'), 's')})"
    )
    fig.tight_layout()
    fig.savefig(out / "restore.png", dpi=110)
    plt.close(fig)


def plot_ratios(res: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    comps = [c for c in res["comparisons"] if c["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(comps) + 1.2))
    ys = list(range(len(comps)))
    colors = [TC if c["met"] is True else ("#d73027" if c["met"] is False else REF) for c in comps]
    ax.barh(ys, [c["ratio"] for c in comps], color=colors)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=0.8)
    for y, c in zip(ys, comps):
        if c["target"] is not None:
            ax.plot([c["target"]] * 2, [y - 0.4, y + 0.4], color="black", lw=2)
        ax.text(c["ratio"] * 1.05, y, f"{c['ratio']:.2f}x", va="center", fontsize=8)
    ax.set_yticks(ys, [c["name"] for c in comps], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tiercheck / peer (log scale; < 1: tiercheck better)")
    ax.set_title(
        "Ratios tiercheck / peer, same run (black tick: target; green met, red missed)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "ratios.png", dpi=110)
    plt.close(fig)


def plot_sweep(res: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    sw = res["sweep"]
    if not sw:
        return
    x = [r["state_bytes"] / GIB for r in sw]
    panels = [
        (
            "Blocked in save",
            [("tiercheck", "tc_blocked_s", TC), ("DCP async", "dcp_async_blocked_s", PEER)],
        ),
        (
            "Until staged (state may change)",
            [
                ("tiercheck", "tc_staged_s", TC),
                ("DCP async", "dcp_async_staged_s", PEER),
                ("plain copy (warm)", "copy_warm_s", REF),
            ],
        ),
        (
            "Until committed",
            [
                ("tiercheck at shm", "tc_committed_shm_s", TC),
                ("torch.save /dev/shm", "torch_save_shm_s", PEER),
                ("DCP async (disk)", "dcp_async_committed_disk_s", "#c2a5cf"),
            ],
        ),
        (
            "Restore",
            [
                ("tiercheck from shm", "tc_restore_shm_s", TC),
                ("torch.load /dev/shm", "torch_load_shm_s", PEER),
            ],
        ),
        (
            "Peak extra RSS / state",
            [
                ("tiercheck", "tc_peak_extra_rss_bytes", TC),
                ("DCP async", "dcp_async_peak_extra_rss_bytes", PEER),
            ],
        ),
    ]
    fig, grid = plt.subplots(2, 3, figsize=(13, 7.5))
    axes = list(grid.flat)
    axes[-1].axis("off")
    for ax, (title, lines) in zip(axes, panels):
        for label, key, color in lines:
            ys = [r[key] for r in sw]
            if key.endswith("bytes"):
                ys = [None if y is None else y / r["state_bytes"] for y, r in zip(ys, sw)]
            ax.plot(
                x, [float("nan") if y is None else y for y in ys], "o-", label=label, color=color
            )
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v * 1024:.0f}" for v in x])
        ax.minorticks_off()
        if not lines[0][1].endswith("bytes"):
            ax.set_yscale("log")
            ax.set_ylabel("seconds")
        else:
            ax.set_ylabel("x state size")
            ax.axhline(1.5, color="black", lw=0.8, ls="--")
        ax.set_xlabel("state MiB")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)


def plot_bytes(res: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    scen = [
        (k, v)
        for k, v in res["bytes_per_version"].items()
        if "status" not in v and v.get("kind") != "data_parallel"
    ]
    if not scen:
        return
    series = [
        ("torch.save / DCP (every version)", "torch_save_bytes", PEER),
        ("tiercheck base, shm (raw)", "base_shm_bytes", "#a6dba0"),
        ("tiercheck diff, shm (raw, dedup)", "diff_shm_bytes", TC),
        ("tiercheck diff, delta tier", "diff_delta_bytes", "#00441b"),
        ("tiercheck base, remote (raw)", "base_remote_bytes", REF),
    ]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.16
    for i, (label, key, color) in enumerate(series):
        xs = [j + (i - 2) * width for j in range(len(scen))]
        ys = [(v[key] or 0) / MIB for _, v in scen]
        ax.bar(xs, ys, width, label=label, color=color)
        for x, y, (_, v) in zip(xs, ys, scen):
            ax.text(
                x,
                y,
                f"{y / (v['torch_save_bytes'] / MIB):.2f}x",
                ha="center",
                va="bottom",
                fontsize=6,
                rotation=90,
            )
    ax.set_xticks(
        range(len(scen)), [f"{k}\n({v['trainable_params'] / 1e6:.2f} M trainable)" for k, v in scen]
    )
    ax.set_ylabel("MiB written per version")
    ax.set_title("Bytes written per version (labels: ratio to a torch.save file)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bytes_per_version.png", dpi=110)
    plt.close(fig)


def plot_training(res: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    t = res["training"]
    fig, ax = plt.subplots(figsize=(7, 3))
    labels = ["no checkpoints", "tiercheck every step", "DCP async_save every step"]
    vals = [t["none_s"], t["tiercheck_s"], t["dcp_async_s"]]
    _bars(ax, labels, vals, [REF, TC, PEER], "s")
    for y, v in enumerate(vals):
        ax.text(
            v * 0.5,
            y,
            f"{v / t['none_s']:.2f}x",
            va="center",
            color="white",
            fontsize=9,
            weight="bold",
        )
    ax.set_xlabel(f"seconds for {t['steps']} steps")
    ax.set_title("Training overhead (demo model)")
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=110)
    plt.close(fig)


def gpu_section(path: Path = Path(__file__).parent / "results" / "gpu.json") -> str:
    """The "On a GPU" section: ``benchmarks/gpu.py``'s JSON where it has been run on a GPU
    (``--out benchmarks/results/gpu.json``), else how to produce it."""
    head = (
        "## On a GPU\n\n`python benchmarks/gpu.py --out benchmarks/results/gpu.json` saves the "
        "same model + AdamW state held on a GPU (each `step` on the CPU, as AdamW keeps it) "
        "and compares tiercheck's staging (device-to-host copies on a side stream of the "
        "tensor's own device into a pinned buffer) and commit with `dcp.async_save` "
        "(`DefaultStager`, pinned memory, non-blocking copies) on the same GPU.\n\n"
    )
    if not path.exists():
        return head + (
            "Not measured yet: no GPU machine has been available to the sessions that ran "
            "this benchmark. The script's whole path runs on the CPU in the test suite "
            "(`--device cpu`), and `tests/test_gpu.py` runs it on CUDA.\n\n"
        )
    doc = json.loads(path.read_text())
    rows = [[f"`{k}`", _fmt(v["median"], "s")] for k, v in sorted(doc["metrics"].items())]
    ratios = [[k, _ratio(v)] for k, v in doc["ratios"].items()]
    return head + (
        f"Run on {doc['created']}: {doc['device_name']} ({doc['device']}), torch "
        f"{doc['torch']}, {doc['state_bytes'] / GIB:.2f} GiB, median of {doc['repeats']}.\n\n"
        f"{_md(['metric', 'median'], rows)}\n\n{_md(['comparison', 'ratio'], ratios)}\n\n"
    )


def peer_abuse_section(
    path: Path = Path(__file__).parent / "results" / "peer_abuse.json",
) -> str:
    """The "Peer daemon under abuse" section, from ``benchmarks/peer_abuse.py``'s JSON
    (empty if it has not been run)."""
    if not path.exists():
        return ""
    doc = json.loads(path.read_text())
    mib = 1 << 20
    rows = []
    for name, ph in doc["phases"].items():
        good, daemon = ph["good_client"], ph["daemon"]
        rows.append(
            [
                name,
                str(ph["refused_at_once"] + daemon["refused_unauthenticated"]),
                str(daemon["deadline_closed"]),
                f"{ph['rss_peak'] / mib:.1f} MiB",
                str(good["rounds"]),
                str(good["errors"]),
                "-" if good["p50_ms"] is None else f"{good['p50_ms']:.2f} ms",
                "-" if good["p99_ms"] is None else f"{good['p99_ms']:.2f} ms",
            ]
        )
    head = [
        "hostile kind",
        "refused",
        "cut at a deadline",
        "daemon peak RSS",
        "good rounds",
        "good errors",
        "good p50",
        "good p99",
    ]
    return f"""## Peer daemon under abuse

`python benchmarks/peer_abuse.py --connections {doc["connections"]}`: a
`tiercheck.peer.daemon` process on 127.0.0.1, `--memory-limit
{doc["memory_limit"] // mib}MiB`, {doc["deadline_s"]:g} s handshake and frame deadlines, a
namespace quota of a quarter of the limit; {doc["connections"]} hostile connections of each
kind from 127.0.0.2 (the authenticated ones one tenant's, with its namespace token) while a
good client on 127.0.0.1 puts, gets and deletes a 256 KiB blob in a loop (a round is the
three). Baseline RSS {doc["rss_baseline"] / mib:.1f} MiB; the documented bound (limit x 9/8,
the interpreter, 128 KiB per connection) is {doc["rss_bound"] / mib:.1f} MiB, and every
phase stayed within it: {doc["rss_within_bound"]}. Refused: at the connection caps
(unauthenticated per address, or authenticated); cut: past the handshake or frame
deadline. Raw data: `benchmarks/results/peer_abuse.json`.

{_md(head, rows)}

Before these limits (issue 23, measured on main): a hello trickled at 1 byte/s was never
cut and 256 of them made an authenticated client `Busy`; a trickled frame was never cut;
1,000,000 zero-byte blobs and 200,000 empty records took the RSS from 35 to 617 MiB under
an 8 MiB limit; 8 connections each sending 59 MiB of a 60 MiB frame took it to 1,097 MiB.

"""


def _packs_table(doc: dict[str, Any]) -> str:
    rows = []
    for mib, row in doc["sizes"].items():
        for layout in ("loose", "packs"):
            r = row[layout]
            rows.append(
                [
                    f"{mib} MiB",
                    layout,
                    str(r["objects_per_base"]),
                    str(r["migrate_puts"]),
                    f"{r['migrate_s']:.2f} s",
                    f"{r['restore_s']:.2f} s",
                    _seconds(r.get("migrate_cpu_s")),
                    _seconds(r.get("restore_cpu_s")),
                    _seconds(r.get("migrate_server_cpu_s")),
                    _seconds(r.get("restore_server_cpu_s")),
                ]
            )
        q = row["ratios"]
        rows.append(
            [
                f"{mib} MiB",
                "packs / loose",
                f"{q['objects']:.2f}x",
                f"{q['puts']:.2f}x",
                f"**{q['migrate_time']:.2f}x**",
                f"**{q['restore_time']:.2f}x**",
                _ratio(q.get("migrate_cpu")),
                _ratio(q.get("restore_cpu")),
                _ratio(q.get("migrate_server_cpu")),
                _ratio(q.get("restore_server_cpu")),
            ]
        )
    head = [
        "state",
        "layout",
        "objects per base",
        "PUTs",
        "migration",
        "restore",
        "client CPU, migration",
        "client CPU, restore",
        "moto CPU, migration",
        "moto CPU, restore",
    ]
    m = doc["machine"]
    where = (
        "moto keeping every object in memory (`--moto-in-memory`)"
        if doc.get("moto_in_memory")
        else "moto's defaults (an object over 5 MiB is a temporary file)"
    )
    return (
        f"With {where}; {m['cpus']} CPUs, load average {m['loadavg_start'][0]:.1f} at the "
        f"start and {m['loadavg_end'][0]:.1f} at the end:\n\n{_md(head, rows)}\n"
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def packs_section(results: Path = Path(__file__).parent / "results") -> str:
    """The "Packs on an object store" section, from ``benchmarks/packs.py``'s JSON files
    (empty if it has not been run)."""
    docs = [
        json.loads((results / name).read_text())
        for name in ("packs.json", "packs_moto_in_memory.json")
        if (results / name).exists()
    ]
    if not docs:
        return ""
    doc = docs[0]
    tables = "\n".join(_packs_table(d) for d in docs)
    return f"""## Packs on an object store

`python benchmarks/packs.py --sizes {",".join(doc["sizes"])} --runs {doc["runs"]}
[--moto-in-memory]`: a base of random fp32 (zstd cannot shrink it) migrated from a
`memory://` tier to S3 (a moto server process on loopback) and restored from S3 alone, with
one object per blob (`loose`, `pack_size=0`, the layout before packs) and with the default
128 MiB packs (streamed as 8 MiB multipart parts). Objects per base exclude the tier's
marker (one per tier, holding its owner record); PUTs are the requests moto logged during the
migration (parts included); times are medians; client CPU is the CPU time of the process
running tiercheck (every thread, the S3 client included), moto CPU the server process's,
over the same windows. Moto is an emulator with costs S3 does not have, and both fall on
packs: it answers a ranged GET by reading and copying the whole object before slicing it
(32 ranged GETs of 8 MiB from a 256 MiB object took 6.3 s, 32 GETs of 8 MiB objects
0.85 s), so packed reads fetch runs of up to 32 MiB of neighbouring blobs at once; and it
completes a multipart upload by concatenating the parts in its own process (1.0 s per
256 MiB). By default it also keeps an object over 5 MiB (every pack and every part) in a
temporary file. A wall-time ratio above 1.00x misses the goal of issue 25 (packs no slower
than one object per blob) on the emulator; the CPU columns say where the time goes. The
machine is shared: timings vary from run to run. Raw data:
`benchmarks/results/packs.json`, `benchmarks/results/packs_moto_in_memory.json`.

{tables}
"""


def _apparent(doc: dict[str, Any]) -> str:
    x = doc.get("apparent_x")
    return "" if x is None else f"({x:.1f}x by the files' apparent sizes)"


def retention_section(
    path: Path = Path(__file__).parent / "results" / "retention.json",
) -> str:
    """The "Footprint of a store left running" section, from ``benchmarks/retention.py``'s
    JSON (empty if it has not been run)."""
    if not path.exists():
        return ""
    doc = json.loads(path.read_text())
    mib = 1 << 20
    state = doc["state_bytes"]
    rows = []
    for name, e in doc["after_gc"].items():
        versions = ", ".join(f"{n} {k}" for k, n in sorted(e["versions"].items())) or "-"
        rows.append(
            [
                name,
                versions,
                "-" if e["disk_bytes"] is None else f"{e['disk_bytes'] / mib:.0f} MiB",
                "-" if e["disk_x"] is None else f"{e['disk_x']:.1f}x",
                "-" if e["held_x"] is None else f"{e['held_x']:.1f}x",
                "-"
                if e.get("objects") is None
                else f"{e['objects']} ({e['objects_per_base']:g} per base)",
            ]
        )
    head = ["tier", "versions kept", "disk", "disk / state", "blobs / state", "objects"]
    return f"""## Footprint of a store left running

`python benchmarks/retention.py`: {doc["saves"]} saves, one per step with
`ckpt.guard(optimizer)`, of a {doc["model_mib"]:g} MiB model + AdamW state
({state / mib:.1f} MiB), in {doc["processes"]} processes of {doc["steps_per_process"]} steps
on the default store (each restores where the previous one stopped), then `{doc["gc"]}`
(grace 0 so that what is measured is what the store keeps). Disk is the allocated blocks of
each tier's files (shm is memory, not counted in the total); blobs are what
`Tier.usage()` counts. LMDB's `data.mdb` is as large as its map
({doc["after_gc"]["lmdb"]["apparent_bytes"] / mib:.0f} MiB), a sparse file; the map starts at
64 MiB and grows with what the tier holds. On disk: **{doc["on_disk_x"]:.1f}x the state**
{_apparent(doc)}. Objects per base exclude the remote's marker (one per tier, holding its owner
record). Raw data:
`benchmarks/results/retention.json`; the formula is in
[configuration](configuration.md#footprint-cadence-and-retention).

{_md(head, rows)}

Before the cadence and the bounded defaults (issue 25, the same run on main):
105.5x the state on disk: LMDB 53.3x (two bases kept, but every dropped base stayed in
its 300 s grace, so the file grew by a state per base), remote 52.3x (all 52 bases,
2,341 objects, 45 per base).

"""


def log_versions_section(
    path: Path = Path(__file__).parent / "results" / "log_versions.json",
) -> str:
    """The "Log versions through the store" section, from ``benchmarks/log_versions.py``'s
    JSON (empty if it has not been run)."""
    if not path.exists():
        return ""
    doc = json.loads(path.read_text())
    m, setup = doc["machine"], doc["setup"]
    runs = {
        (r["mode"], r["tiers"] if isinstance(r["tiers"], str) else "+".join(r["tiers"])): r
        for r in doc["results"]
    }
    rows = []
    for (mode, tiers), r in runs.items():
        roles = "".join(x[0] for x in r["roles"])
        for name, t in r["per_tier"].items():
            nonbase = t["mean_per_non_base_version_x"]
            rows.append(
                [
                    "before (`log=False`)" if mode == "diffs" else "after (default)",
                    tiers,
                    roles,
                    name,
                    f"{t['mean_per_version_x']:.3f}x",
                    "-" if nonbase is None else f"{nonbase:.3f}x",
                ]
            )
    restore = [
        [
            "before" if mode == "diffs" else "after",
            tiers,
            r["restore_newest_from_shm"]["version_role"],
            str(r["restore_newest_from_shm"]["replayed_steps"]),
            f"{r['restore_newest_from_shm']['seconds']:.3f} s",
        ]
        for (mode, tiers), r in runs.items()
    ]
    state = next(iter(runs.values()))["state_bytes"]
    head = ["store", "tiers", "roles", "tier", "stored per version", "per non-base version"]
    return f"""## Log versions through the store

`python benchmarks/{setup["command"]}` ({m["cpus"]} CPUs, torch {m["torch"]}, load
average {m["load_avg_1m"]:.1f} at the end: times are noisy, bytes are exact). Dense fp32
AdamW training of a GPT-like model ({state / 2**20:.1f} MiB of state; LambdaLR, gradient
clipping, random tokens), saved after each of {setup["saves"]} steps, side by side: the
optimizer guarded with `log=False` (before log versions: bases and chunk-dedup diffs) and
guarded by default (log versions). Stores: the default store (`Checkpointer(root)`, no
configuration: shm and LMDB synchronous, bases migrated to a `file://` remote) and shm +
a peer tier (a real `tiercheck.peer.daemon` daemon on loopback; default placement: every
version, delta codec). Bytes are what each synchronous tier's write stored
(`SaveResult.bytes_written`), as a multiple of the state; roles `b`ase, `d`iff, `l`og.
Raw data: `benchmarks/results/log_versions.json`.

{_md(head, rows)}

Restoring the newest version from shm (a log version: read its base and log, replay the
steps, verify every parameter and optimizer tensor's fingerprint):

{_md(["store", "tiers", "version", "steps replayed", "seconds"], restore)}

{_fsdp2_rows(doc.get("fsdp2"))}"""


def _fsdp2_rows(fsdp2: dict[str, Any] | None) -> str:
    """The FSDP2 part of the log versions section (empty if it has not been run)."""
    if not fsdp2:
        return ""
    rows = []
    for r in fsdp2["results"]:
        x = r["ranks"]
        nonbase = [y["mean_per_non_base_version_x"] for y in x]
        rows.append(
            [
                "fp32" if r["precision"] == "fp32" else "mixed (bf16 params, fp32 masters)",
                "before (`log=False`)" if r["mode"] == "diffs" else "after (default)",
                f"{x[0]['state_bytes'] / 2**20:.1f} MiB",
                "".join(c[0] for c in x[0]["roles"]),
                " / ".join(f"{y['mean_per_version_x']:.3f}x" for y in x),
                " / ".join("-" if n is None else f"{n:.3f}x" for n in nonbase),
            ]
        )
    head = ["precision", "store", "state per rank", "roles", "per version", "per non-base"]
    return f"""The same model sharded by FSDP2 over 2 ranks (torchrun, gloo, CPU; `fully_shard` of
the embedding, each encoder layer and the head; each rank its own batches), saved after
each of {fsdp2["saves"]} steps into one shm tier per rank: fp32 (fp32 parameters and AdamW
state), and mixed precision (bf16 parameters, sharded, reduced and clipped in bf16; fp32
master copies of the shards stepped by AdamW with fp32 state, the bf16 parameters guarded as
`mirrors`). Each rank logs its shards' gradients; a bf16 gradient cast up for the fp32
masters is logged as bf16. Bytes each rank's shm tier stored, as a multiple of that rank's
state (rank 0 / rank 1). `python benchmarks/log_versions.py --only fsdp2 --scale
{fsdp2["scale"]} --saves {fsdp2["saves"]}`.

{_md(head, rows)}

"""


def write_docs(
    res: dict[str, Any], docs: Path, fields: dict[str, str], metric_docs: dict[str, str]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    img = docs / "benchmarks"
    img.mkdir(parents=True, exist_ok=True)
    for fn in (plot_save, plot_restore, plot_ratios, plot_sweep, plot_bytes, plot_training):
        fn(res, img)
    m = res["machine"]
    st = res["state"]
    t = res["training"]
    sweep_head, sweep_body = sweep_rows(res)
    versions = res["bytes_per_version"]["dense"].get("versions", "")
    bpv_head = ["scenario", "trainable", "torch.save", "base, shm", "diff, shm"]
    bpv_head += ["diff, delta tier", "base, remote", "note"]
    sections = "".join(
        (
            log_versions_section(),
            peer_abuse_section(),
            packs_section(),
            retention_section(),
            __import__("trainer_overhead").section(),  # issue 31
            __import__("restore").section(),  # issue 32
            gpu_section(),
        )
    )
    text = f"""# Benchmarks

Generated by `python benchmarks/run.py` on {res["created"]} ({m["cpus"]} CPUs,
{m["memory_gib"]} GiB, Python {m["python"]}, torch {m["torch"]}, tiercheck
{m["tiercheck"]}; load average {m["loadavg_start"][0]:.1f} at the start,
{m["loadavg_end"][0]:.1f} at the end). Every number is the median of {res["repeats"]}
runs in the same process, one system after the other, on the same state:
{st["params"] / 1e6:.1f} M parameters + AdamW moments, {st["bytes"] / GIB:.2f} GiB
({st["tensors"]} tensors). Raw data: `benchmarks/results/latest.json`.

tiercheck rows use one store per tier (that tier alone, every save a base written
synchronously, its default codec: raw for shm, LMDB and file, zstd for s3), the state
changed densely between saves (so every chunk is new), and `prepare(state)` called once
before the first save. The default store row is `Checkpointer(root)`: shm and LMDB
synchronous, bases migrated to the `file://` remote tier (raw) in the background. A new
store's first saves also create the shm segments and grow the LMDB file: until LMDB
holds its retained bases (two) every save takes new disk blocks and faults in fresh pages
of the map, and from then on each save reuses the pages of the base it dropped, as every
save of a training run (and of a restarted job on the same store) does. So the
default-store medians are of the saves in that steady state, and the first saves are
reported apart: the first alone (`tc_committed_default_first_s`) and all those before the
steady state (`tc_committed_default_growing_s`).

## Targets (issues 3 and 16) and ratios

The durable-path goals of issue 16 compare like with like, on the same disk, in this run:

- **migration to remote file** (`tc_migrate_file_s`): a committed version copied from
  shm to the `file://` tier, from the commit to the commit record there, against
  `dcp.save` of the same state (FileSystemWriter, 2 threads). Both end with every byte
  fsynced: DCP fsyncs each data file and `.metadata` (no directory fsync); tiercheck
  fsyncs each blob before naming it, the directory it named it in, and the log record;
  the fsyncs run on write threads (up to 16 blobs in flight) while the next chunks are
  read and verified.
  The end-to-end row (save call to migrated) is shown too.
- **committed, default store**: shm and LMDB (LMDB writes through its writable map into
  disk blocks reserved ahead; one sync per transaction and one per record) against the
  same `dcp.save`. Each 64 MiB of the staged state goes to both tiers as soon as it is
  hashed, so copying, hashing and flushing overlap; the windows hashed while LMDB syncs
  the last transaction go in its next one (up to 256 MiB: group commit). The manifest and
  the prepare record still come after every chunk.
- **restore from file**: the `file://` tier alone, read, verified (BLAKE3 of every chunk)
  and written into the state's tensors, against `dcp.load` from the disk directory
  written moments before (both from the page cache).
- **staged**: `save()` call to staged against a copy of every tensor into warm buffers.

![ratios](benchmarks/ratios.png)

{_md(["comparison", "tiercheck", "peer", "ratio", "target", "met"], comparison_rows(res))}

{unmet_section(res)}
{floor_section(res)}
{profile_section(res)}
![save](benchmarks/save.png)

![restore](benchmarks/restore.png)

## Bytes written per version

Real training of the demo model (`tiercheck.cli.demo`), {versions} versions, base every 10,
chunk-dedup diffs (the optimizer guarded with `log=False`; log versions, the default for
a guarded optimizer, are measured in "Log versions through the store" below).
The `delta` tier is a memory tier with the delta codec (XOR
against the base's chunk, byte-shuffle, zstd), as the peer tier uses; the remote tier gets
bases only (raw: a `file://` tier stores raw blobs). Each memory tier gets a budget
that holds every version here, so the table shows what a version costs, not what a
default budget keeps. Ratios are to the size of a `torch.save` file of the same state
(DCP writes the same amount every version).

{_md(bpv_head, bpv_rows(res))}

![bytes](benchmarks/bytes_per_version.png)

## State-size sweep

{_md(sweep_head, sweep_body)}

![sweep](benchmarks/sweep.png)

## Training overhead

The demo model trained {t["steps"]} steps with no checkpoints ({t["none_s"]:.2f} s), with
tiercheck saving every step to the default tiers ({t["tiercheck_s"]:.2f} s,
**{t["tiercheck_slowdown"]:.2f}x**), and with `dcp.async_save` + `DefaultStager` every
step to /dev/shm ({t["dcp_async_s"]:.2f} s, **{t["dcp_async_slowdown"]:.2f}x**).

![training](benchmarks/training.png)

{sections}## Every metric

{_md(["metric", "median", "min .. max", "what"], metric_rows(res, metric_docs))}

## JSON fields (`benchmarks/results/latest.json`, schema {res["schema"]})

{_md(["field", "meaning"], [[f"`{k}`", v] for k, v in fields.items()])}

Metric names (under `metrics`) end in `_s` (seconds), `_bytes` or `_s_per_gib`; names
starting `tc_` are tiercheck's. `sweep` rows carry a subset of the same names. Names are
kept across versions; new ones are only added.
"""
    (docs / "benchmarks.md").write_text(text)
