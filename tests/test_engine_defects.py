"""Engine defects reproduced and fixed (issue 21, item 5): the write lease's put and delete
in order across threads, close() bounded by its timeout, a failed open releasing what it
took, a changed tier list refused, and every background thread's failure reported.

Races are forced with :class:`~tiercheck.faults.FaultyTier` hooks that block a real tier's
call on an Event, never with sleeps.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from tiercheck import TierPolicy, TierSpec
from tiercheck.backends.registry import open_tier
from tiercheck.faults import FaultEvent, FaultPlan, FaultyTier
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.formats.ids import chunk_id
from tiercheck.leases import TierLeases
from tiercheck.manifest_log import TierLog
from tiercheck.retention import GCState, collect_garbage
from tiercheck.tierset import TierSlot

CHUNK = 4096


def state_of(seed: int, n: int = 4 * CHUNK) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


def mem() -> str:
    return f"memory://{uuid.uuid4().hex}"


# --- 1. the write lease follows its holds in order ------------------------------------------


def test_a_writer_starting_while_the_last_one_deletes_the_lease_keeps_it(tmp_path: Path) -> None:
    """The save thread ends its hold (its delete of the lease is slow) while the migration
    thread starts one: the lease must be in the tier while the migration writes, or another
    process's sweep deletes the blobs it writes before they are committed."""
    plan = FaultPlan()
    tier = FaultyTier(open_tier(f"file://{tmp_path / 'shared'}", shared=True), plan)
    leases, other_process = TierLeases(), TierLeases()
    deleting, put_again = threading.Event(), threading.Event()

    def slow_delete(_: FaultEvent) -> None:
        deleting.set()
        # the old code's second writer puts its lease here, inside the window; the fixed
        # code makes it wait for this delete, so the wait ends by its bound instead
        put_again.wait(timeout=2)

    plan.hook(slow_delete, "delete", count=1)
    plan.hook(lambda _: put_again.set(), "put", nth=2, after=True)
    leases.acquire_write(tier)
    saving = threading.Thread(target=leases.release_write, args=(tier,))
    saving.start()
    assert deleting.wait(timeout=60)
    migrating = threading.Thread(target=leases.acquire_write, args=(tier,), kwargs={"wait": False})
    migrating.start()
    saving.join()
    migrating.join()
    try:
        assert leases.write_id in tier.has([leases.write_id])  # held, so it is in the tier
        raw = b"a blob the migration wrote and has not committed yet"
        tier.put(chunk_id(raw), encode_blob(raw, Codec.RAW))
        slot = TierSlot(TierSpec("shared", tier.url), tier, TierPolicy())
        report = collect_garbage(
            slot,
            TierLog("shared"),
            lambda mid: None,  # type: ignore[arg-type,return-value]
            state=GCState(),
            grace=0,
            leases=other_process,
        )
        assert report.fenced is not None and leases.holder in report.fenced
        assert tier.has([chunk_id(raw)])
    finally:
        leases.release_write(tier)
        tier.close()
