"""Diffs between two versions, entry by entry.

:func:`diff` compares two versions entry by entry. An entry whose chunks have the same
ids in both versions (at the same position inside the chunk) is unchanged by
construction: its data is not read. Only entries whose chunks differ are read, in
bounded batches, to tell a real change (with its max abs difference and relative L2
change) from a chunk that changed because of a neighbour.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tiercheck.formats.manifest import (
    Role,
)

# torch (and tiercheck.core.entries, which imports it) is imported only where an entry's value
# is made or compared, so that browsing a store (`tiercheck ls`, `show`) need not import it.
if TYPE_CHECKING:
    import torch


from tiercheck.history.versions import EntryInfo, Version

__all__ = ["Diff", "EntryChange", "diff"]


# Entries read together while diffing are bounded by this many bytes per side.
_DIFF_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class EntryChange:
    """An entry present in both versions whose value differs.

    ``reason`` is ``data`` (same kind, dtype and shape, other values), ``dtype``,
    ``shape`` or ``kind``. For numeric data, ``max_abs_diff`` is max |b - a| and
    ``rel_l2`` is ||b - a|| / ||a|| (``inf`` when a is all zeros); otherwise None.
    """

    key: str
    reason: Literal["data", "dtype", "shape", "kind"]
    a: EntryInfo
    b: EntryInfo
    max_abs_diff: float | None = None
    rel_l2: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "reason": self.reason,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "max_abs_diff": _json_float(self.max_abs_diff),
            "rel_l2": _json_float(self.rel_l2),
        }


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)


@dataclass(frozen=True)
class Diff:
    """What changed from version ``a`` to version ``b``.

    Both sides are the states the versions stand for: a log version's replayed leaves
    are compared as replayed (so ``diff(base, log)`` lists what the logged optimizer steps
    changed). ``unchanged_by_id`` counts the unchanged entries decided from chunk ids
    alone (no data read); ``entries_read`` counts entries whose data had to be read (on
    each side). ``a_role`` and ``b_role`` are the versions' roles.
    """

    a: int
    b: int
    added: tuple[EntryInfo, ...]
    removed: tuple[EntryInfo, ...]
    changed: tuple[EntryChange, ...]
    unchanged: tuple[str, ...]
    unchanged_by_id: int
    entries_read: int
    a_role: Role = "base"
    b_role: Role = "base"

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "a_role": self.a_role,
            "b_role": self.b_role,
            "added": [e.to_json() for e in self.added],
            "removed": [e.to_json() for e in self.removed],
            "changed": [c.to_json() for c in self.changed],
            "unchanged": list(self.unchanged),
            "unchanged_by_id": self.unchanged_by_id,
            "entries_read": self.entries_read,
        }


def _same_by_id(ea: EntryInfo, eb: EntryInfo, csa: int, csb: int) -> bool:
    """True when equal chunk ids prove the two entries' bytes equal (never for a replayed
    leaf: it has no chunks, its value is the replay's)."""
    return (
        ea.replayed is None
        and eb.replayed is None
        and csa == csb
        and ea.size == eb.size
        and ea.offset % csa == eb.offset % csb
        and ea.chunks == eb.chunks
    )


def _as_float(value: Any) -> torch.Tensor:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    assert isinstance(t, torch.Tensor)
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64)


def _numeric_change(a: Any, b: Any) -> tuple[float, float]:
    import torch

    ta, tb = _as_float(a), _as_float(b)
    if ta.numel() == 0:
        return 0.0, 0.0
    d = tb - ta
    max_abs = float(d.abs().max().item())
    norm_d = float(torch.linalg.vector_norm(d).item())
    norm_a = float(torch.linalg.vector_norm(ta).item())
    if norm_a == 0.0:
        return max_abs, 0.0 if norm_d == 0.0 else math.inf
    return max_abs, norm_d / norm_a


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _compare_values(ea: EntryInfo, eb: EntryInfo, va: Any, vb: Any) -> EntryChange | None:
    import torch

    if ea.kind in ("tensor", "ndarray"):
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            same = va.numel() == 0 or bool(
                torch.equal(va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8))
            )
        else:
            same = bytes(np.ascontiguousarray(va).data) == bytes(np.ascontiguousarray(vb).data)
        if same:
            return None
        try:
            max_abs, rel = _numeric_change(va, vb)
        except (RuntimeError, TypeError):
            return EntryChange(ea.key, "data", ea, eb)
        return EntryChange(ea.key, "data", ea, eb, max_abs, rel)
    if va == vb and type(va) is type(vb):
        return None
    if _is_number(va) and _is_number(vb):
        delta = abs(float(vb) - float(va))
        rel = delta / abs(float(va)) if va else (0.0 if delta == 0 else math.inf)
        return EntryChange(ea.key, "data", ea, eb, delta, rel)
    return EntryChange(ea.key, "data", ea, eb)


def diff(va: Version, vb: Version) -> Diff:
    """Compare the states of ``va`` and ``vb`` (same rank); see :class:`Diff`. Raises
    :class:`~tiercheck.errors.ReplayRequired` where a log version's replay is needed and
    cannot be done here."""
    ea_all, eb_all = va.entries, vb.entries
    csa, csb = va.manifest.chunk_size, vb.manifest.chunk_size
    added = tuple(e for k, e in eb_all.items() if k not in ea_all)
    removed = tuple(e for k, e in ea_all.items() if k not in eb_all)
    changed: dict[str, EntryChange] = {}
    unchanged: list[str] = []
    by_id = 0
    to_read: list[str] = []
    for key, ea in ea_all.items():
        eb = eb_all.get(key)
        if eb is None:
            continue
        if ea.kind != eb.kind:
            changed[key] = EntryChange(key, "kind", ea, eb)
        elif ea.dtype != eb.dtype:
            changed[key] = EntryChange(key, "dtype", ea, eb)
        elif ea.shape != eb.shape:
            changed[key] = EntryChange(key, "shape", ea, eb)
        elif _same_by_id(ea, eb, csa, csb):
            unchanged.append(key)
            by_id += 1
        else:
            to_read.append(key)
    for batch in _batches(to_read, ea_all):
        da, db = va.read(batch), vb.read(batch)
        for key in batch:
            change = _compare_values(ea_all[key], eb_all[key], da[key], db[key])
            if change is None:
                unchanged.append(key)
            else:
                changed[key] = change
        del da, db
    order = {k: i for i, k in enumerate(ea_all)}
    unchanged.sort(key=order.__getitem__)
    return Diff(
        a=va.id,
        b=vb.id,
        added=added,
        removed=removed,
        changed=tuple(changed[k] for k in ea_all if k in changed),
        unchanged=tuple(unchanged),
        unchanged_by_id=by_id,
        entries_read=len(to_read),
        a_role=va.role,
        b_role=vb.role,
    )


def _batches(keys: Sequence[str], entries: Mapping[str, EntryInfo]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for key in keys:
        n = entries[key].size
        if batch and size + n > _DIFF_BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch
