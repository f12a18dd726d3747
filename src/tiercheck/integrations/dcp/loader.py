"""A DCP root as a whole: its rank stores, and its checkpoint as one state dict."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tiercheck.errors import NoRestorableVersion
from tiercheck.integrations.dcp.reader import TierReader

# --- a DCP root as a whole ----------------------------------------------------------------


def rank_stores(root: str | os.PathLike[str]) -> list[Path]:
    """The per-rank stores ``root/rank{r}`` of a DCP root, in rank order (empty if ``root``
    is not one). Raises NoRestorableVersion if the ranks are not ``0..n-1``."""
    base = Path(root).expanduser()
    found: dict[int, Path] = {}
    if base.is_dir():
        for child in base.iterdir():
            m = re.fullmatch(r"rank(\d+)", child.name)
            if m and (child / "tiercheck.toml").is_file():
                found[int(m.group(1))] = child
    if found and sorted(found) != list(range(len(found))):
        raise NoRestorableVersion(
            f"{base} holds stores for ranks {sorted(found)}; a DCP root has rank0..rank(n-1)"
        )
    return [found[r] for r in sorted(found)]


def load_full_state_dict(
    source: str | os.PathLike[str] | TierReader, *, checkpoint_id: str | int | None = None
) -> dict[str, Any]:
    """The whole DCP checkpoint under ``source`` (a root, or a :class:`TierReader`, whose
    ``version`` then tells which one was read) as one plain state dict, in this process.

    Every tensor is assembled from the shards of every rank (as ``dcp.load`` with an empty
    state would build it); keys are the ones given to ``dcp.save``, nested as they were, so
    ``model.load_state_dict(sd["model"])`` works. Non-tensor values come back as DCP saved
    them. Needs the memory of the whole state.
    """
    # what torch's own dcp_to_torch_save does: the public load() only fills keys the
    # caller's dict already has, and an empty dict has none
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load

    reader = (
        source
        if isinstance(source, TierReader)
        else TierReader(source, checkpoint_id=checkpoint_id)
    )
    sd: dict[str, Any] = {}
    dcp_load(
        sd,
        storage_reader=reader,
        planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
        no_dist=True,
    )
    return sd
