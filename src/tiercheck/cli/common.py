"""Shared by the commands: usage errors, human units, JSON output, progress bars, opening
stores and versions."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tiercheck.errors import (
    ConfigError,
    FormatVersionError,
    InvalidURL,
    NoRestorableVersion,
    StoreLocked,
)

if TYPE_CHECKING:
    from tiercheck.history import versions as history


EXPORT_SUFFIXES = (".safetensors", ".pt", ".pth")

T = TypeVar("T")


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit status 2."""


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


def format_ratio(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def json_default(obj: Any) -> Any:
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
    text = json.dumps(_clean_floats(obj), indent=indent, default=json_default, allow_nan=False)
    sys.stdout.write(text + "\n")


def make_console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200, highlight=False, emoji=False)


def plain(text: object) -> str:
    """``text`` escaped for rich markup: a user's string (a root, a key, metadata, a URL)
    is printed as it is, ``[bold]`` and ``[/x]`` in it included."""
    from rich.markup import escape

    return escape(str(text))


@contextlib.contextmanager
def progress_bar(
    enabled: bool, description: str, unit: str = "bytes"
) -> Iterator[history.Progress | None]:
    """A ``progress(done, total)`` callback drawing a rich bar on stderr, or None.

    ``unit``: what ``done`` and ``total`` count; ``"bytes"`` are shown in human units
    (``1.5 GiB / 4.0 GiB``), anything else as ``N/M unit``."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[shown]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None, shown="")

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, shown=count_text(done, total, unit))

        yield update


def count_text(done: int, total: int, unit: str) -> str:
    """``done`` of ``total`` as a progress bar shows it: human sizes for bytes."""
    if unit == "bytes":
        return f"{human_size(done)} / {human_size(total)}"
    return f"{done}/{total} {unit}"


def output_path(out: str) -> Path:
    """``out`` as a file a command may write (created or replaced); UsageError, before
    anything is written, if it is a directory or its directory is missing or read-only."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise UsageError(f"{out}: is a directory")
    if not path.parent.is_dir():
        raise UsageError(f"{out}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{out}: directory {path.parent} is not writable")
    return path


def dcp_ranks(root: str) -> list[Path]:
    """The per-rank stores of a DCP root (``TierWriter(root)`` makes ``root/rank{r}``), or
    ``[]`` when ``root`` is not one."""
    from tiercheck.store.config import CONFIG_NAME

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
    from tiercheck.engine.coordinator import LocalCoordinator
    from tiercheck.store.config import CONFIG_NAME, without_userinfo

    if "://" in root:
        shown = without_userinfo(root)  # the URL as every message and label names it
        if write:
            raise UsageError(f"{shown}: a tier URL is opened read-only; this command writes")
        try:
            ckpt: Any = Checkpointer(
                Path.cwd(), tiers=[root], read_only=True, coordinator=LocalCoordinator()
            )
        except (ConfigError, InvalidURL, FormatVersionError) as exc:
            raise UsageError(f"{shown}: {exc}") from None
        down = [s for s in ckpt.tierset.slots if s.tier is None]
        if down:
            ckpt.close()
            raise UsageError(f"{shown}: cannot open the tier: {down[0].error}")
        if not _holds_anything(ckpt.tierset.slots[0].tier):
            ckpt.close()
            folders = [without_userinfo(f) for f in _store_folders(root)]
            if folders:
                raise UsageError(
                    f"{shown}: a tier shared by stores (shared_by_stores): each store keeps "
                    f"its own folder in it; give one of them: {', '.join(folders)}"
                )
            raise UsageError(
                f"{shown}: holds no tiercheck tier (no owner, log or blob): check the URL"
            )
        ckpt.cli_label = shown
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


def _store_folders(url: str) -> list[str]:
    """The URLs of the folders ``stores/<id>`` under the tier URL ``url``, where a tier
    declared ``shared_by_stores`` keeps each store's namespace (none if there are none, or
    they cannot be listed)."""
    from tiercheck.store.identity import local_path

    base = url.rstrip("/") + "/stores"
    local = local_path(url)
    try:
        if local is not None:
            names = os.listdir(os.path.join(local, "stores"))
        else:
            import fsspec

            fs, path = fsspec.core.url_to_fs(base)
            names = [p.rstrip("/").rpartition("/")[2] for p in fs.ls(path, detail=False)]
    except Exception:  # any backend's own error: the listing only helps a message
        return []
    return [f"{base}/{name}" for name in sorted(names)]


def _holds_anything(tier: Any) -> bool:
    """Whether ``tier`` holds what a store or ``migrate --to`` writes: an owner record, a
    log record or a blob. A read-only open creates nothing, so a URL with a typo in it
    opens as an empty tier."""
    return (
        tier.read_owner() is not None
        or bool(tier.read_log())
        or next(iter(tier.list()), None) is not None
    )


def pick_version(ckpt: Any, spec: str, rank: int | None = None) -> history.Version:
    """The version ``spec`` names (id, ``latest``, ``step:N``); UsageError if none."""
    return _picked(ckpt, ckpt.history(), [spec], rank)[0]


def _picked(
    ckpt: Any, rows: Sequence[history.Version], specs: Sequence[str], rank: int | None
) -> list[history.Version]:
    """The versions ``specs`` name among ``rows`` (every spec checked first); UsageError
    for a malformed one or one that names no version."""
    from tiercheck.history import versions as history

    try:
        for spec in specs:
            history.parse_version_spec(spec)
        return [history.resolve_version(rows, spec, rank=rank) for spec in specs]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except NoRestorableVersion as exc:
        raise UsageError(f"{label(ckpt)}: {exc}") from None


def read_picked(
    ckpt: Any, specs: Sequence[str], rank: int | None, read: Callable[[list[history.Version]], T]
) -> T:
    """``read`` of the versions ``specs`` name (as :func:`pick_version` picks them: UsageError
    if there is none), resolved on one view of the history; a version a writer's retention
    drops while it is read is picked again (``latest``) or named as dropped
    (:func:`tiercheck.history.reading.read_versions`)."""
    from tiercheck.history.reading import read_versions

    rows = ckpt.history()
    picked = _picked(ckpt, rows, specs, rank)
    return read_versions(ckpt, specs, read, rank=rank, opened=(rows, picked))


def tier_names(ckpt: Any, wanted: Sequence[str] | None) -> list[str] | None:
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


def tiers_json(ckpt: Any, vanished: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The store's tiers as ``ls --json`` lists them; ``error`` says why a tier is
    unavailable, or (``vanished``, by name) why its content is gone."""
    from tiercheck.store.config import without_userinfo
    from tiercheck.store.guarantees import describe_survival

    out = []
    for slot in ckpt.tierset.slots:
        pol = slot.policy
        out.append(
            {
                "name": slot.name,
                "url": without_userinfo(slot.spec.url),
                "available": slot.tier is not None,
                "error": slot.error or (vanished or {}).get(slot.name),
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
                    "every": pol.every,
                    "milestones": pol.milestones,
                    "guarantee": "required" if pol.required else "best_effort",
                },
            }
        )
    return out


STATE_STYLE = {
    "committed": "green",
    "migrating": "yellow",
    "missing": "dim",
    "dropped": "dim",
    "unreachable": "red",
}


def nonneg_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if x < 0 or not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return x


def nonneg_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    x = nonneg_float(text)
    if x == 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return x


def parse_size(text: str) -> int:
    from tiercheck.core.sizes import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return value
