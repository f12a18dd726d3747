"""``tiercheck export``: one version as a plain ``.safetensors`` or ``torch.save`` file."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercheck.cli.common import (
    EXPORT_SUFFIXES,
    UsageError,
    dcp_ranks,
    emit_json,
    human_size,
    json_default,
    make_console,
    open_store,
    output_path,
    plain,
    progress_bar,
    read_picked,
)
from tiercheck.errors import NoRestorableVersion

if TYPE_CHECKING:
    from tiercheck.history import versions as history


def _check_output(out: str, force: bool) -> Path:
    if Path(out).suffix.lower() not in EXPORT_SUFFIXES:
        raise UsageError(f"{out}: the output must end in .safetensors, .pt or .pth")
    path = output_path(out)
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
    out = _check_output(args.out, args.force)
    fmt = "safetensors" if out.suffix.lower() == ".safetensors" else "torch"
    if dcp_ranks(args.root):
        return _export_dcp(args, out, fmt)
    with contextlib.closing(open_store(args.root)) as ckpt:
        # next to a trainer: a version its retention drops while it is read is picked again
        return read_picked(
            ckpt, [args.version], args.rank, lambda vs: _export_version(args, out, fmt, vs[0])
        )


def _export_version(args: argparse.Namespace, out: Path, fmt: str, v: history.Version) -> int:
    """Export version ``v`` (read, then written to ``out``: a failed read writes nothing)."""
    import numpy as np
    import torch

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

    from tiercheck.logversions.replay import replay_offline

    with progress_bar(not args.json, "replaying", "steps") as progress:
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
                "tiercheck.metadata": json.dumps(dict(metadata), default=json_default),
            }
            save_file(obj, str(tmp), metadata=meta)
        else:
            torch.save(obj, tmp)
        # one mode for both formats (safetensors writes 0600): what a new file gets here
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
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
    console = make_console()
    console.print(
        f"exported {len(obj)} entries of version {version} (step {step}) to {plain(out)} "
        f"({human_size(result['bytes'])})"
    )
    if skipped:
        why = "not tensors" if fmt == "safetensors" else "stored with pickle"
        console.print(f"skipped {len(skipped)} entries ({why}): " + plain(", ".join(skipped)))


def _export_dcp(args: argparse.Namespace, out: Path, fmt: str) -> int:
    """Export a DCP root's checkpoint, assembled from every rank, with the plain keys given
    to ``dcp.save`` (nested dicts joined by ``/``: ``model/layer.weight``)."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from tiercheck.history import versions as history
    from tiercheck.integrations import dcp

    try:
        kind, n = history.parse_version_spec(args.version)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cid = {"latest": None, "id": f"version:{n}", "step": f"step:{n}"}[kind]
    reader = dcp.TierReader(args.root, checkpoint_id=cid)
    try:
        # the version is looked up first: inside a load, DCP turns the reader's error into
        # text (torch 2.13: an AssertionError naming it)
        reader.read_metadata()
        sd = dcp.load_full_state_dict(reader)
    except NoRestorableVersion as exc:
        raise UsageError(f"{args.root}: {exc}") from None
    except CheckpointException as exc:  # a BaseException, holding each rank's error
        cause = next((e for e, _ in exc.failures.values()), None)
        if isinstance(cause, NoRestorableVersion):
            raise UsageError(f"{args.root}: {cause}") from None
        if cause is None:
            raise
        raise cause from None
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
