"""The byte-level collectives of the commit protocol, on a gloo process group.

Each one is a single ``torch.distributed`` call (or two, where the sizes must travel
first) over CPU tensors of plain integers or bytes: nothing is pickled. :attr:`Collectives.received`
counts the bytes the collectives delivered to this rank (the size of every output
tensor), so a benchmark can show what the protocol costs a rank per save.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["TEXT_LIMIT", "Collectives"]

TEXT_LIMIT = 4096  # bytes of a failure's text that reach the other ranks


class Collectives:
    """The collectives of one process group (every rank of the job, in rank order)."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.received = 0  # bytes delivered to this rank so far
        self.calls = 0  # torch.distributed calls made so far (rounds of messages)

    def max(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over every rank (one all-reduce)."""
        return self._reduce(values, "max")

    def sum(self, values: Sequence[int]) -> list[int]:
        """The element-wise sum of ``values`` over every rank (one all-reduce)."""
        return self._reduce(values, "sum")

    def _reduce(self, values: Sequence[int], op: str) -> list[int]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.int64)
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(t, op=reduce_op, group=self.group)
        self.received += t.numel() * t.element_size()
        self.calls += 1
        return [int(v) for v in t.tolist()]

    def broadcast_text(self, text: str, src: int) -> str:
        """``text`` of rank ``src``, cut to :data:`TEXT_LIMIT` bytes, on every rank."""
        import torch
        import torch.distributed as dist

        buf = torch.zeros(TEXT_LIMIT, dtype=torch.uint8)
        if self.rank == src:
            raw = text.encode("utf-8", "replace")[: TEXT_LIMIT - 1]
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self.group)
        self.received += TEXT_LIMIT
        self.calls += 1
        raw = bytes(buf.numpy()).split(b"\0", 1)[0]
        return raw.decode("utf-8", "replace")

    def all_gather_fixed(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload`` in rank order; every rank's has the same length."""
        import torch
        import torch.distributed as dist

        size = max(len(payload), 1)
        mine = torch.zeros(size, dtype=torch.uint8)
        if payload:
            mine[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        self.received += size * self.world_size
        self.calls += 1
        return [bytes(t.numpy()[: len(payload)]) for t in out]

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, of any length, in rank order (sizes first, then the
        data padded to the longest). Its cost grows with the world: start-up and restore
        only, never a save."""
        sizes = [
            int.from_bytes(s, "little")
            for s in self.all_gather_fixed(len(payload).to_bytes(8, "little"))
        ]
        longest = max(sizes)
        padded = self.all_gather_fixed(payload.ljust(longest, b"\0"))
        return [p[:n] for p, n in zip(padded, sizes)]

    def all_to_all(
        self, data: npt.NDArray[Any], counts: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
        """Send ``data`` (rows of one dtype, grouped by destination rank: ``counts[r]`` rows
        for rank ``r``) and receive the rows every rank sent this one, grouped by sender,
        with their counts. Two all-to-alls: the counts (four bytes per rank), the rows."""
        import torch
        import torch.distributed as dist

        sent = torch.from_numpy(counts.astype(np.int32))
        got = torch.empty(self.world_size, dtype=torch.int32)
        dist.all_to_all_single(got, sent, group=self.group)
        self.received += got.numel() * got.element_size()
        self.calls += 1
        recv_counts = got.numpy().astype(np.int64)
        return self.all_to_all_known(data, counts, recv_counts), recv_counts

    def all_to_all_known(
        self,
        data: npt.NDArray[Any],
        counts: npt.NDArray[np.int64],
        recv_counts: npt.NDArray[np.int64],
    ) -> npt.NDArray[Any]:
        """:meth:`all_to_all` when this rank already knows how many rows each sends it
        (a reply to an earlier all-to-all: the same counts, reversed). One all-to-all."""
        import torch
        import torch.distributed as dist

        width = data.dtype.itemsize
        flat = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        out = torch.empty(int(recv_counts.sum()) * width, dtype=torch.uint8)
        dist.all_to_all_single(
            out,
            torch.from_numpy(flat if flat.flags.writeable else flat.copy()),
            output_split_sizes=(recv_counts * width).tolist(),
            input_split_sizes=(counts * width).tolist(),
            group=self.group,
        )
        self.received += out.numel()
        self.calls += 1
        return out.numpy().view(data.dtype)
