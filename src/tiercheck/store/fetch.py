"""Reading chunks back: from the fastest tier with an intact copy, verified, repairing bad ones.

Every read decodes the blob and checks that BLAKE3 of the result equals the chunk id.
A missing copy, a damaged copy (:class:`~tiercheck.errors.BlobCorrupt`) or an unreachable
tier sends the read on to the next tier in order. When a later tier succeeds, the copies
found damaged (and, where the caller says a tier should hold the chunk, the missing ones)
are rewritten from the good bytes.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import blake3

from tiercheck.backends.base import Pins, Tier, fresh_buffer
from tiercheck.errors import (
    BlobCorrupt,
    FormatVersionError,
    NotFound,
    TiercheckError,
    TierError,
    TierUnavailable,
)
from tiercheck.formats.codecs import (
    BLOB_HEADER_SIZE,
    Codec,
    decode_blob,
    encode_blob,
    raw_payload,
)
from tiercheck.formats.ids import as_byte_view, chunk_check
from tiercheck.formats.manifest import ShardManifest, unpack_manifest
from tiercheck.store.tierset import TierSlot

__all__ = ["ChunkFetcher", "FetchStats", "repair_codec"]

log = logging.getLogger(__name__)

_SCRATCH = 4 * 1024 * 1024 + 4096  # a default-size chunk and its blob header


def _verify(raw: memoryview, chunk_id: str) -> None:
    """Raise :class:`BlobCorrupt` unless BLAKE3 of ``raw`` is ``chunk_id``. One thread per
    chunk: a restore reads chunks on every thread of its pool already, and BLAKE3's own
    worker pool on top of that (``max_threads``) costs more than it gains (1 GiB from shm
    on 2 cores: 0.35-0.42 s with one thread per chunk, 0.45-0.55 s with the pool)."""
    got = blake3.blake3(raw).hexdigest()
    if got != chunk_id:
        raise BlobCorrupt(
            f"decoded chunk hashes to {got}, not its id (damaged blob or wrong base)",
            key=chunk_id,
        )


def _passes(raw: memoryview, check: bytes | None, tier: Tier) -> bool:
    """Whether ``raw``, read from ``tier``, matches the chunk's ``check`` where that is
    all it needs: a copy from this host's memory. False: verify it by BLAKE3 (which also
    decides a copy that fails its check: damaged, or the check is wrong)."""
    return check is not None and tier.capabilities.host_memory and chunk_check(raw) == check


def repair_codec(slot: TierSlot) -> Codec:
    """The codec a rewritten copy gets in ``slot``: raw stays raw, otherwise zstd."""
    return Codec.RAW if slot.policy is None or slot.policy.codec == "raw" else Codec.ZSTD


@dataclass
class FetchStats:
    """What a set of reads did: per-tier reads and bytes, damage found, repairs made."""

    reads: Counter[str] = field(default_factory=Counter)
    bytes_read: Counter[str] = field(default_factory=Counter)
    chunks_from: Counter[str] = field(default_factory=Counter)
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)
    repaired: list[tuple[str, str]] = field(default_factory=list)


class ChunkFetcher:
    """Fetches chunks by id from ``slots`` (in the given order). Thread-safe."""

    def __init__(self, slots: Sequence[TierSlot], *, repair: bool = True, zstd_level: int = 1):
        self.slots = [s for s in slots if s.tier is not None]
        self.repair = repair
        self.level = zstd_level
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._bases: dict[str, bytes] = {}
        self._local = threading.local()
        self._manifests: dict[str, ShardManifest] = {}

    def manifest(
        self, manifest_id: str, *, order: Sequence[TierSlot] | None = None
    ) -> ShardManifest:
        """Read (and cache: manifests are immutable) the shard manifest ``manifest_id``."""
        with self._lock:
            cached = self._manifests.get(manifest_id)
        if cached is not None:
            return cached
        raw, _ = self.fetch(manifest_id, order=order)
        m = unpack_manifest(raw)
        with self._lock:
            self._manifests[manifest_id] = m
        return m

    def _read(self, tier: Tier, chunk_id: str) -> memoryview:
        """Read a blob into this thread's reusable buffer (no fresh pages per chunk)."""
        if getattr(self._local, "in_base", 0):
            # a delta's base: the delta blob being decoded still occupies the scratch buffer
            return tier.get(chunk_id)
        try:
            return tier.get(chunk_id, self._scratch(_SCRATCH))
        except ValueError:  # larger than the scratch buffer
            return tier.get(chunk_id)

    def _scratch(self, n: int) -> memoryview:
        """This thread's reusable buffer, at least ``n`` bytes."""
        scratch: memoryview | None = getattr(self._local, "buf", None)
        if scratch is None or len(scratch) < n:
            scratch = self._local.buf = fresh_buffer(max(n, _SCRATCH))
        return scratch

    def _read_decode(
        self, slot: TierSlot, chunk_id: str, out: memoryview | None, check: bytes | None = None
    ) -> tuple[memoryview, int]:
        """The verified raw bytes of ``chunk_id`` from ``slot`` (in ``out`` if given) and
        the blob's stored size.

        Where ``slot`` stores raw blobs, the blob is read as its header into a small buffer
        and its payload straight into ``out`` (no intermediate copy) and verified there;
        a blob that turns out to be encoded otherwise is decoded from what was read.
        """
        tier = slot.tier
        assert tier is not None
        if out is not None and (slot.policy is None or slot.policy.codec == "raw"):
            dst = as_byte_view(out)
            head: bytearray | None = getattr(self._local, "head", None)
            if head is None:
                head = self._local.head = bytearray(BLOB_HEADER_SIZE)
            size = tier.get_parts(chunk_id, [memoryview(head), dst])
            raw = raw_payload(head, dst, size, chunk_id, verify=False)
            if raw is not None:
                if not _passes(raw, check, tier):
                    _verify(raw, chunk_id)
                return raw, size
            if size <= BLOB_HEADER_SIZE + len(dst):  # all of it was read: reassemble
                blob = self._scratch(size)[:size]
                blob[:BLOB_HEADER_SIZE] = head
                blob[BLOB_HEADER_SIZE:] = dst[: size - BLOB_HEADER_SIZE]
            else:
                blob = self._read(tier, chunk_id)
        else:
            blob = self._read(tier, chunk_id)
        try:
            raw = decode_blob(blob, chunk_id, base_lookup=self._base, out=out)
        except ValueError as exc:  # a copy of another length than the chunk its id names
            raise BlobCorrupt(f"not this chunk: {exc}", key=chunk_id) from None
        buf = getattr(self._local, "buf", None)
        if buf is not None and raw.obj is buf.obj:
            raw = memoryview(bytes(raw))  # the scratch buffer is reused by the next read
        return raw, len(blob)

    def _base(self, base_id: str) -> bytes:
        with self._lock:
            cached = self._bases.get(base_id)
        if cached is not None:
            return cached
        resolving: set[str] = getattr(self._local, "resolving", set())
        if base_id in resolving:  # a delta whose bases lead back to a chunk being decoded
            raise BlobCorrupt("its chain of delta bases loops back to itself", key=base_id)
        self._local.resolving = resolving | {base_id}
        self._local.in_base = getattr(self._local, "in_base", 0) + 1
        try:
            data = bytes(self.fetch(base_id)[0])
        finally:
            self._local.in_base -= 1
            self._local.resolving = resolving
        with self._lock:
            if len(self._bases) > 64:
                self._bases.clear()
            self._bases[base_id] = data
        return data

    def fetch(
        self,
        chunk_id: str,
        out: memoryview | None = None,
        *,
        order: Sequence[TierSlot] | None = None,
        expect: Sequence[str] = (),
        check: bytes | None = None,
    ) -> tuple[memoryview, str]:
        """Return ``(raw bytes, tier name)`` for ``chunk_id``, written into ``out`` if given.

        ``order`` overrides the tier order; ``expect`` names tiers that should hold the
        chunk, so a missing copy there is repaired too. ``check``: the chunk's check from
        its manifest, against which a raw copy from a tier of this host's memory is
        verified (:attr:`~tiercheck.backends.base.Capabilities.host_memory`; every other
        copy, and one that fails it, by BLAKE3). Raises :class:`NotFound` if no tier has
        the chunk, :class:`BlobCorrupt` if every copy found is damaged.
        """
        slots = list(order) if order is not None else self.slots
        bad: list[TierSlot] = []
        errors: list[str] = []
        any_corrupt = False
        newer: FormatVersionError | None = None
        for slot in slots:
            tier = slot.tier
            if tier is None:
                continue
            try:
                raw, stored = self._read_decode(slot, chunk_id, out, check)
            except FormatVersionError as exc:
                # a newer writer's copy, or a damaged version byte: another tier may still
                # hold a copy this reader can use; refuse only if none does
                newer = exc
                errors.append(f"{slot.name}: {exc}")
                continue
            except BlobCorrupt as exc:
                any_corrupt = True
                bad.append(slot)
                errors.append(f"{slot.name}: corrupt ({exc})")
                with self._lock:
                    self.stats.corrupt.append((slot.name, chunk_id))
                log.warning("corrupt copy of chunk %s in tier %s: %s", chunk_id, slot.name, exc)
                continue
            except NotFound:
                if slot.name in expect:
                    bad.append(slot)
                errors.append(f"{slot.name}: missing")
                with self._lock:
                    self.stats.missing.append((slot.name, chunk_id))
                continue
            except (TierUnavailable, TierError, OSError) as exc:
                errors.append(f"{slot.name}: {exc}")
                continue
            self._count_read(slot.name, stored)
            if bad and self.repair:
                self._repair(chunk_id, raw, bad)
            return raw, slot.name
        detail = "; ".join(errors) or "no tier to read from"
        if newer is not None:
            raise newer
        if any_corrupt:
            raise BlobCorrupt(f"no intact copy of chunk ({detail})", key=chunk_id)
        raise NotFound(f"chunk is in no reachable tier ({detail})", key=chunk_id)

    def fetch_in_place(
        self, chunk_id: str, slot: TierSlot, pins: Pins, length: int, check: bytes | None = None
    ) -> memoryview | None:
        """The raw bytes of ``chunk_id`` where ``slot``'s tier holds them (``pins`` are that
        tier's: its blobs lie in this host's memory), verified there: no copy. None where
        they cannot be used in place: no copy there, a damaged one, a blob encoded
        otherwise than raw, or not ``length`` bytes; the caller then reads it with
        :meth:`fetch`, which reports the damage, falls back to the next tier and repairs.

        Verified against ``check`` where the manifest records one (the chunk's XXH3-128,
        taken by the save from the same bytes before their id: SPEC.md section 7.2), else
        by BLAKE3 against the id."""
        if slot.policy is not None and slot.policy.codec != "raw":
            return None
        try:
            front, rest, size = pins.parts(chunk_id, BLOB_HEADER_SIZE)
            raw = raw_payload(front, rest, size, chunk_id, verify=False)
            if raw is None or len(raw) != length:
                return None
            if check is None or slot.tier is None or not slot.tier.capabilities.host_memory:
                _verify(raw, chunk_id)
            elif chunk_check(raw) != check:
                return None
        except (TiercheckError, OSError, ValueError):
            return None
        self._count_read(slot.name, size)
        return raw

    def _count_read(self, tier: str, stored: int) -> None:
        """Count a chunk served by ``tier`` (``stored`` bytes of blob read)."""
        with self._lock:
            self.stats.reads[tier] += 1
            self.stats.bytes_read[tier] += stored
            self.stats.chunks_from[tier] += 1

    def _repair(self, chunk_id: str, raw: memoryview, bad: Sequence[TierSlot]) -> None:
        for slot in bad:
            assert slot.tier is not None
            if slot.tier.read_only:
                continue
            try:
                blob = encode_blob(raw, repair_codec(slot), level=self.level)
                slot.tier.put(chunk_id, blob, overwrite=True)
            except (TierError, OSError) as exc:
                log.warning("could not repair chunk %s in tier %s: %s", chunk_id, slot.name, exc)
                continue
            with self._lock:
                self.stats.repaired.append((slot.name, chunk_id))
            log.info("repaired chunk %s in tier %s", chunk_id, slot.name)
