"""Writer assignment by hash partition: which rank writes each chunk to a shared tier.

The 256-bit chunk ids are spread uniformly, so the top bits of an id name the rank that
*owns* it: rank ``floor(h * N / 2**32)`` for ``h`` the id's first four bytes read
big-endian, ``N`` the world size. Each rank sends every one of its chunk ids to the id's
owner (one ``all_to_all``); an owner sees every holder of each id it owns, picks one writer
among them and answers each holder yes or no (a second ``all_to_all``, the reverse of the
first). Every id has one owner, so every chunk gets exactly one writer, and a rank receives
about as many ids as it sent: the cost per rank follows its own chunks, not the world.

The writer of an id is one of its holders chosen by the id's next eight bytes (uniform
among the holders, so a data-parallel replica's chunks are spread over its replicas).

Everything here is arrays in, arrays out (numpy, no Python loop over the ids), so that
an owner's work is a few vector operations however many ids it receives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["RECORD", "assign_writers", "owners", "pack_chunks", "unpack_ids"]

# what a rank sends an owner per chunk: the raw id and the holder's byte length of it
RECORD = np.dtype([("id", "S32"), ("size", "<u8")])

U8 = npt.NDArray[np.uint8]


def pack_chunks(chunks: Sequence[tuple[str, int]]) -> npt.NDArray[np.void]:
    """``(hex id, size)`` pairs as :data:`RECORD` rows, in the given order."""
    out = np.empty(len(chunks), dtype=RECORD)
    if chunks:
        out["id"] = [bytes.fromhex(c) for c, _ in chunks]
        out["size"] = [n for _, n in chunks]
    return out


def unpack_ids(records: npt.NDArray[np.void]) -> list[str]:
    """The hex ids of ``records``."""
    return [bytes(i).hex() for i in records["id"]]


def _word(records: npt.NDArray[np.void], start: int, width: int) -> npt.NDArray[np.uint64]:
    """Bytes ``start:start+width`` of each id, read big-endian, as unsigned integers."""
    raw = np.frombuffer(records["id"].tobytes(), dtype=np.uint8).reshape(-1, 32)
    out = np.zeros(len(records), dtype=np.uint64)
    for k in range(width):
        out = (out << np.uint64(8)) | raw[:, start + k].astype(np.uint64)
    return out


def owners(records: npt.NDArray[np.void], world_size: int) -> npt.NDArray[np.int64]:
    """The owning rank of each id: its hash range (first four bytes) scaled to the world."""
    top = _word(records, 0, 4)  # < 2**32; times a world < 2**31 stays inside 64 bits
    return ((top * np.uint64(world_size)) >> np.uint64(32)).astype(np.int64)


def assign_writers(records: npt.NDArray[np.void], holders: npt.NDArray[np.int64]) -> U8:
    """At an owner: for each received row (``records[i]`` sent by rank ``holders[i]``), 1
    if that holder writes the chunk, else 0. Exactly one row per distinct id gets 1; a
    holder that sent an id twice counts once."""
    n = len(records)
    out = np.zeros(n, dtype=np.uint8)
    if n == 0:
        return out
    ids = records["id"]
    # rows grouped by id, each group's holders in rank order, one row per (id, holder)
    order = np.lexsort((holders, ids))
    sid, sholder = ids[order], holders[order]
    first = np.ones(n, dtype=bool)
    first[1:] = (sid[1:] != sid[:-1]) | (sholder[1:] != sholder[:-1])
    rows, gid = order[first], sid[first]
    starts = np.flatnonzero(np.concatenate(([True], gid[1:] != gid[:-1])))
    counts = np.diff(np.append(starts, len(rows)))
    pick = _word(records[rows[starts]], 4, 8) % counts.astype(np.uint64)
    out[rows[starts + pick.astype(np.int64)]] = 1
    return out
