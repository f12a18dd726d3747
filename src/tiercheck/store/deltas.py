"""What a delta may be encoded against on a tier, and the element size its byte-shuffle uses.

Both the save pipeline (:mod:`tiercheck.engine.placing`) and migration
(:mod:`tiercheck.upkeep.copying`) encode deltas for a target tier; they decide alike here.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercheck.backends.base import Tier
from tiercheck.core.entries import torch_dtype
from tiercheck.formats.manifest import ChunkRef, Entry

__all__ = ["elem_size", "held_bases"]


def elem_size(entries: Sequence[Entry], offset: int) -> int:
    """Element size of the entry holding byte ``offset`` (for the delta byte-shuffle)."""
    import torch

    for e in entries:
        if e.offset <= offset < e.offset + e.nbytes:
            if e.kind == "tensor":
                return torch.empty((), dtype=torch_dtype(e.dtype)).element_size()
            if e.kind == "ndarray":
                import numpy as np

                return int(np.dtype(e.dtype).itemsize)
            return 1
    return 1


def held_bases(tier: Tier, base_chunks: Sequence[ChunkRef]) -> set[str]:
    """The base chunk ids ``tier`` holds: the only ones a delta on it may be encoded
    against (a delta is only as safe as its base, and GC keeps a base the tier holds while
    the delta lives; a copy held elsewhere only may be dropped there)."""
    return tier.has(list({c.id for c in base_chunks}))
