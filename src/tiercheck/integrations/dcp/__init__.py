"""tiercheck under ``torch.distributed.checkpoint``: :class:`TierWriter` and :class:`TierReader`.

``dcp.save(sd, storage_writer=TierWriter(root))``, ``dcp.async_save(...)`` and
``dcp.load(sd, storage_reader=TierReader(root))`` (with resharding) run on tiercheck: every
DCP checkpoint is a tiercheck version, cut into chunks, placed on the store's tiers and
recorded in their manifest logs, so it shows in :meth:`Checkpointer.history` like any other
version, diff versions and chunk dedup included.

**checkpoint_id.** DCP passes ``checkpoint_id`` to ``reset`` (only when it is not ``None``).
It names a version of the coordinator's store (see below):

- writing: ``N`` / ``"N"`` / ``"step:N"`` save the checkpoint as step ``N``; ``None`` saves
  it as the step after the newest one in the store (``0`` in an empty store). An id applies
  to the next save only. ``"version:N"`` is refused: version ids are assigned by the store.
- reading: ``N`` / ``"N"`` / ``"step:N"`` load the newest DCP version of step ``N``;
  ``"version:N"`` loads version ``N``; ``None`` loads the newest DCP checkpoint that every
  rank's store can restore, skipping newer ones with a warning that names the rank whose
  shard is lost and why. A named checkpoint that a rank cannot restore raises
  :class:`~tiercheck.errors.NoRestorableVersion` saying the same.

**Stores and ranks.** ``TierWriter(root)`` opens (creating if needed) one store per rank at
``root/rank{r}``; ``TierWriter(checkpointer)`` uses the caller's store for this rank (it must
be a one-rank store: ``coordinator=LocalCoordinator()`` under torch.distributed). Each
rank saves the items DCP assigns it as one version of its own store (a one-rank shard); the
coordinator (DCP's rank 0) saves its items *together with* the global DCP metadata, after
every rank has reported its writes (``finish``). That coordinator version is the DCP
checkpoint: it exists iff every rank's shard was committed first, and it names each rank's
version and store. A rank that dies mid-write leaves no coordinator version, so the previous
checkpoint stays the newest one. Each rank's store runs its own retention at that rank's
commit, before the coordinator records the new checkpoint: a base there would let go of
the diffs before it, the rank's shard of the newest finished checkpoint among them. So
every rank holds its shard of the newest finished checkpoint (the coordinator names it in
the plan of each save) until a newer one is finished, across a restart too
(:mod:`~tiercheck.integrations.dcp.hold`): a job killed before ``finish`` resumes from the
newest finished checkpoint. Should a rank's shard be lost all the same (a lost tier), the
reader falls back to the newest checkpoint every rank still holds. DCP's own protocol
(every rank's ``write_data``, then ``finish`` on the coordinator with all their results) is
thus the two-phase commit: the per-rank versions are the prepared shards and the
coordinator version is the decision. The engine's multi-rank coordinator
(:mod:`tiercheck.engine.coordinator`) is not used under DCP, so DCP saves get no cross-rank
dedup on a shared tier: each rank writes its own store.

``TierReader(root)`` reads the metadata from ``root/rank0`` and each rank's items from
``root/rank{r}``; ``TierReader(checkpointer)`` reads the metadata from that store and the other
ranks' items from the store roots recorded at save time. Other stores are opened read-only.
Reads fetch only the chunks holding the entries this rank needs (``Checkpointer.version``).

**Metadata without pickle.** DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata`
is encoded field by field into plain msgpack (:func:`encode_metadata`) and decoded back the
same way (:func:`decode_metadata`), which refuses anything it does not know. Loading never
unpickles anything from the store on tiercheck's side.

**Byte items without pickle.** Non-tensor values are DCP ``BytesIO`` items: ``torch.save``
payloads, which DCP's default load planner deserializes with ``torch.load(weights_only=
False)``, i.e. full pickle: whoever can write a tier could run code in the loading process.
:class:`TierReader` therefore decodes each one first with ``torch.load(weights_only=True)``
(PyTorch's restricted unpickler: tensors, numbers, strings, containers, and the globals
registered with ``torch.serialization.add_safe_globals``), refuses a payload that needs
anything else with :class:`~tiercheck.errors.UnsupportedValue`, and hands the planner a
fresh ``torch.save`` of the decoded value. ``TierReader(..., allow_pickle=True)`` passes
the stored bytes through as before: only for checkpoints you trust.

**async_save.** The thread executor works with any writer. The process executor pickles the
writer into a daemon process: give it a root path (a :class:`Checkpointer` cannot be sent),
and do not hold that store open for writing in the trainer. The copy there opens the store for
each save and closes it after, so every such version is a base (the engine keeps the diff
base in memory only).
"""

from tiercheck.integrations.dcp.ids import (
    CheckpointRef,
    Location,
    parse_checkpoint_id,
    rank_root,
)
from tiercheck.integrations.dcp.loader import load_full_state_dict, rank_stores
from tiercheck.integrations.dcp.metadata import decode_metadata, encode_metadata
from tiercheck.integrations.dcp.reader import TierReader
from tiercheck.integrations.dcp.writer import TierWriter

__all__ = [
    "CheckpointRef",
    "Location",
    "TierReader",
    "TierWriter",
    "decode_metadata",
    "encode_metadata",
    "load_full_state_dict",
    "parse_checkpoint_id",
    "rank_root",
    "rank_stores",
]
