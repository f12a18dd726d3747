"""Any fsspec URL as a tier: ``file:///abs/path``, ``s3://bucket/prefix``, ``gs://...``, and
``fsspec+PROTO://...`` (forces fsspec, e.g. ``fsspec+memory://root`` is fsspec's in-memory
file system, unlike the native ``memory://`` tier).

Layout under the root (the URL's path)::

    tier.json                    marker: {"tier": "tiercheck-fsspec", "layout": 1 or 2,
                                 "owner": the store owning the prefix, {"store_id", "root",
                                 "host"} (formats/SPEC.md "Store identity"), once recorded};
                                 replaced whole, one object per tier
    owner/<seq:016d>.json        owner claims, {"owner": {"store_id", "root", "host"}}, seq =
                                 0, 1, ...: each created if absent (as log records are), so
                                 two stores claiming the prefix at once get one winner; the
                                 newest is the owner record (the marker's "owner" repeats it)
    blobs/<id[:2]>/<id>          one object per blob, written once (repairs overwrite)
    packs/<name>.pack            layout 2: many blobs in one object, its index at its end
    packs/<name>.drop            ids deleted from that pack while its bytes stay
    log/<seq:016d>.rec           one object per log record, seq = 0, 1, 2, ... in append order
    log/<seq:016d>.ckpt          a checkpoint record standing for every record up to seq

Each log object holds one record framed with :mod:`tiercheck.formats.framing`, so a damaged
or torn object is detected (and skipped with a warning) rather than parsed. The marker is
created by the first writable open; an open refuses a root whose marker is not
tiercheck's or names a newer layout. Local temporary files (``.*.tmp``) are never listed.

**Log commit.** ``append`` claims the next sequence number by *create-if-absent*, so two
writers can never both own one number: the loser sees the object exist, re-lists the log
and retries with the next free number (so ``append`` never raises ``AlreadyExists`` in
practice; it does after 1000 lost races in a row). How each store creates if absent:

- local file system (``file://``): the record is written to a temporary file and fsynced,
  then ``os.link``-ed to its final name (``link`` fails if the name exists) and the
  directory fsynced. Where hard links are not supported the record is written with
  ``O_CREAT | O_EXCL``; a crash may then leave a torn object, which framing detects.
- S3 (``s3://``): ``PutObject`` with ``If-None-Match: *`` (AWS since 2024, moto >= 5).
  An endpoint that answers "not implemented" falls back to check-then-put, with a warning.
- fsspec's memory file system: check-then-put under a process-wide lock (the store lives in
  this process, so that is atomic).
- any other protocol: ``pipe_file(mode="create")`` of the fsspec implementation. fsspec's
  default is check-then-put: two writers racing for one number can both succeed, and the
  later object replaces the earlier record. Use such a store from one writer at a time
  (the engine's store lock gives that).

**Log compaction.** ``replace_log_prefix`` writes the checkpoint as ``log/<S>.ckpt``, S
being the sequence number of the last record it replaces, then deletes the ``.rec``
objects up to S and older checkpoints. A reader takes the newest checkpoint and only the
records after it, so between the two steps (or after a crash between them) it reads the
same log, and reading costs one GET per record kept, not per record ever appended. New
sequence numbers continue after checkpoints too.

**Blob puts.** Local: temporary file (header and payload in one vectored write), fsync,
``rename``; the directories new blobs were named in are fsynced once each before the next
log record is written (and at close), so a record never names a blob whose name a power
loss could undo, and a version of many blobs pays one directory fsync per directory, not
per blob. A blob or directory found already there (``has``, a put of an id present, a
blob directory made earlier) may have been named by a writer that crashed before its
directory fsync: its directories, up to the root, are fsynced too before the next record,
once per directory per process. Reads go straight into the caller's buffer. Object
stores: one ``PutObject`` (atomic by the store's semantics; ``If-None-Match: *`` on S3 for
a put without ``overwrite``, which saves the existence check). Other fsspec file systems
write in place: a crash may leave a partial blob, which the codec layer detects by hash.

**Packs** (``pack_size``, SPEC section 16, :mod:`tiercheck.backends._packs`): an object
store gets its blobs in pack objects of about ``pack_size`` bytes (128 MiB by default;
``0``: one object per blob, the only layout of local and memory stores unless asked; the
default store's ``remote`` directory asks for 16 MiB).
Blobs put are gathered in memory and written as packs before the next log record, at
``flush()`` and at ``close()``; reads are ranged reads. A root with packs says layout 2.

**Capabilities** (each overridable by the options of the same name):

=====================  ===========  ======  ==========  ==========  ========
store                  survives     shared  persistent  speed_rank  compress
=====================  ===========  ======  ==========  ==========  ========
local ``file://``      process      no      yes         40          no
local, ``shared=True`` node         yes     yes         40          no
``fsspec+memory://``   none         no      no          5           no
anything else          cluster      yes     yes         50          yes
=====================  ===========  ======  ==========  ==========  ========

``compress`` decides the default codec of a shared or cluster-surviving tier: a file system
mounted here (``file://``, even one declared ``survives="cluster"``) gets raw blobs, an
object store zstd (see :mod:`tiercheck.store.policy`).

A local path on a shared mount (NFS, Lustre) should be opened with ``shared=True`` (and
``survives="cluster"`` if the file system outlives the cluster).

**Options:** ``storage_options`` (dict passed to fsspec, e.g. ``endpoint_url``, ``key``,
``secret``, ``client_kwargs`` for s3fs), ``read_only``, ``survives``, ``shared``,
``persistent``, ``speed_rank``, ``compress``, ``pack_size``.

**Errors:** a missing bucket raises ``InvalidURL`` at open; connection failures and
timeouts ``TierUnavailable``; no space ``TierFull``; a missing blob ``NotFound``.

**Modules:** :mod:`.tier` (``FsspecTier``: paths, marker, owner, blobs, log),
:mod:`.opening` (URL to store, default capabilities), :mod:`.store` (the primitives a
store gives), :mod:`.local` (the POSIX store, fsync and the ``_os`` hook of
tests/test_power_loss.py), :mod:`.remote` (any fsspec file system, the async driver),
:mod:`.s3_multipart` (a pack streamed to S3), :mod:`.errors` (store exceptions as typed
errors). Packs themselves are :mod:`tiercheck.backends._packs`.
"""

from tiercheck.backends._fsspec.tier import DEFAULT_PACK_SIZE, FsspecTier

__all__ = ["DEFAULT_PACK_SIZE", "FsspecTier"]
