"""What the commit protocol costs a rank per save at a job's rank count.

The model of ``benchmarks/protocol.py`` (docs/multi-rank.md, "What the protocol costs"),
with its parameters measured there: a save is a fixed number of collective calls of
``ceil(log2 N)`` hops each, the bytes a rank receives (its own chunk ids, about one
record per chunk, plus 36 bytes per rank: a manifest id and an all-to-all count), and the
rank's own work on its ids::

    seconds(N, C) = cpu_s_per_chunk * C + calls * alpha_s * ceil(log2 N) + bytes(N, C) / beta
    bytes(N, C)   = fixed_bytes + bytes_per_chunk * C + bytes_per_rank * N

``C`` is the rank's chunk count (its state over the chunk size). ``tiercheck plan`` adds
it to the time each synchronous tier takes to commit a version.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tiercheck.errors import ConfigError

__all__ = ["ProtocolModel"]


@dataclass(frozen=True)
class ProtocolModel:
    """The parameters (defaults: ``benchmarks/results/protocol.json``, sharded layout)."""

    calls: float = 9.0
    alpha_s: float = 5.38e-4
    beta_bytes_per_s: float = 3.34e8
    cpu_s_per_chunk: float = 5.6e-7
    fixed_bytes: float = 264.0
    bytes_per_chunk: float = 41.0
    bytes_per_rank: float = 36.0
    chunk_bytes: float = 4 * 1024 * 1024
    source: str = "built-in: benchmarks/results/protocol.json of 2026-11-24 (sharded, 300 chunks)"

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"protocol.{f.name} must be a number >= 0, got {value!r}")
        if self.beta_bytes_per_s <= 0 or self.chunk_bytes <= 0:
            raise ConfigError("protocol.beta_bytes_per_s and chunk_bytes must be positive")

    def chunks(self, state_bytes: float) -> int:
        """A rank's chunk count for ``state_bytes`` of state."""
        return max(1, math.ceil(state_bytes / self.chunk_bytes))

    def bytes(self, ranks: int, chunks: int) -> float:
        """Bytes a rank receives per save (none with one rank: no protocol)."""
        if ranks <= 1:
            return 0.0
        return self.fixed_bytes + self.bytes_per_chunk * chunks + self.bytes_per_rank * ranks

    def seconds(self, ranks: int, chunks: int) -> float:
        """Seconds of protocol per save, per rank (none with one rank)."""
        if ranks <= 1:
            return 0.0
        hops = max(1, math.ceil(math.log2(ranks)))
        latency = self.calls * self.alpha_s * hops
        return (
            self.cpu_s_per_chunk * chunks
            + latency
            + self.bytes(ranks, chunks) / self.beta_bytes_per_s
        )

    @classmethod
    def from_benchmarks(cls, directory: str | os.PathLike[str]) -> ProtocolModel:
        """The parameters in ``directory/protocol.json`` (``benchmarks/protocol.py``'s
        output); ``ConfigError`` naming the file and key when one is missing."""
        path = Path(directory) / "protocol.json"
        try:
            data: Any = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no benchmark results at {path}") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        try:
            m = data["layouts"]["sharded"]["model"]
            chunks = float(data["chunks"])
            per_chunk = float(m["bytes_per_chunk"])
            return cls(
                calls=float(m["calls"]),
                alpha_s=float(m["alpha_s"]),
                beta_bytes_per_s=float(m["beta_bytes_per_s"]),
                cpu_s_per_chunk=float(m["t_cpu_s"]) / chunks,
                fixed_bytes=max(0.0, float(m["bytes_intercept"]) - per_chunk * chunks),
                bytes_per_chunk=per_chunk,
                bytes_per_rank=float(m["bytes_per_rank"]),
                source=f"{path}",
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"{path}: benchmark results lack {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
