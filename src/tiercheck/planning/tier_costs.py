"""What a save and a restore cost in each tier on the target hardware.

The model, for one rank (every rank of a node works in parallel, so a node's save takes as
long as one rank's):

- **Measured here.** tiercheck's own end-to-end save ("save() to committed") and restore
  throughput per tier, from ``benchmarks/results/*.json`` (:class:`Measured`; the built-in
  values are those files' numbers as committed, :meth:`Measured.from_benchmarks` re-reads
  them). The benchmark machine runs one rank on ``cores`` CPU cores, and at those rates
  tiercheck is CPU-bound (hashing, copying, the protocol), so each rate is scaled by
  ``Hardware.cores_per_rank / cores``.
- **Documented for the target.** The medium each tier shares with the other ranks
  (:class:`Hardware`): host memory bandwidth for ``shm``, the network port for ``peer``,
  the NVMe drives for ``lmdb``, the remote store's aggregate bandwidth for ``remote``. A
  rank gets at most its share of it: per node divided by the GPUs per node; the remote
  aggregate divided by every GPU of the job.
- A tier's rate is the smaller of the two. Staging (GPU to pinned host memory over PCIe) is
  the only part that blocks the trainer, and is costed separately from ``pcie_gbps``; the
  measured end-to-end rates include a host-side staging copy, so tier times are slightly
  pessimistic on a GPU host.
- Codecs are modelled as raw: on dense fp32 state zstd and delta store 0.84-0.92x of the
  bytes (benchmarks/results/codecs.json) at 0.4-0.7 GB/s per core, which about cancels the
  saving at these rates.

Every constant, its value and its source, is listed in docs/goodput.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tiercheck.backends.base import Capabilities, FailureDomain
from tiercheck.errors import ConfigError
from tiercheck.store.guarantees import describe_survival

__all__ = [
    "TIER_PERSISTENT",
    "TIER_SURVIVES",
    "Hardware",
    "Measured",
    "TierRates",
    "load_hardware",
    "save_hardware",
    "survival_text",
    "tier_rates",
    "write_text_atomic",
]

GB = 1e9

#: the failure domain each modelled tier survives (the tier table of docs/concepts.md)
TIER_SURVIVES: Mapping[str, FailureDomain] = {
    "shm": FailureDomain.PROCESS,
    "peer": FailureDomain.NODE,
    "lmdb": FailureDomain.PROCESS,
    "remote": FailureDomain.CLUSTER,
}

#: whether each modelled tier's content survives a reboot of its host (LMDB on local disk
#: does, memory does not), as :attr:`Capabilities.persistent` says of a real tier
TIER_PERSISTENT: Mapping[str, bool] = {"shm": False, "peer": False, "lmdb": True, "remote": True}


def survival_text(name: str) -> str:
    """What the modelled tier ``name`` survives, in the words ``tiercheck ls`` and the
    errors use for a real tier (:func:`tiercheck.store.guarantees.describe_survival`)."""
    caps = Capabilities(
        survives=TIER_SURVIVES[name],
        shared=name == "remote",
        persistent=TIER_PERSISTENT[name],
        speed_rank=0,
    )
    return describe_survival(caps)


@dataclass(frozen=True)
class Hardware:
    """Bandwidths of the target machines in GB/s (1e9 bytes per second).

    Defaults describe the H100 nodes of the reference run (8 GPUs per node, 400 Gb/s
    ports, Meta's Tectonic file system) and are sourced in docs/goodput.md:

    - ``pcie_gbps``: GPU to/from pinned host memory, per GPU. H100 SXM: PCIe Gen5 x16,
      64 GB/s per direction; pinned copies reach about 80% of it.
    - ``host_memory_gbps``: memory-to-memory copy per node (2 sockets of 8 DDR5-4800
      channels: 614 GB/s peak; a copy reads and writes, and reaches about half of that).
    - ``nic_gbps``: per node, what peer traffic may use: one 400 Gb/s port.
    - ``nvme_write_gbps`` / ``nvme_read_gbps``: per node, two Gen4 data-centre NVMe drives
      (about 4 / 7 GB/s each). An assumption: the reference run does not publish it.
    - ``remote_write_gbps`` / ``remote_read_gbps``: aggregate for the whole job: Tectonic's
      2 TB/s sustained (7 TB/s peak, not assumed).
    - ``hbm_gbps``: GPU memory bandwidth (H100 SXM: 3.35 TB/s), for replaying logs.
    - ``cores_per_rank``: CPU cores the checkpoint pipeline of one rank may use.
    """

    pcie_gbps: float = 50.0
    host_memory_gbps: float = 150.0
    nic_gbps: float = 50.0
    nvme_write_gbps: float = 8.0
    nvme_read_gbps: float = 14.0
    remote_write_gbps: float = 2000.0
    remote_read_gbps: float = 2000.0
    hbm_gbps: float = 3350.0
    cores_per_rank: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"hardware.{f.name} must be a positive number, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Measured:
    """tiercheck's own throughput per tier on the benchmark machine, GB/s for one rank
    running on ``*_cores`` cores.

    - ``shm_*``, ``lmdb_*``: ``tc_committed_{shm,lmdb}_s`` / ``tc_restore_{shm,lmdb}_s`` of
      ``benchmarks/results/latest.json`` (``state_bytes`` per run, one rank on ``cpus``).
    - ``remote_*``: the same for the ``file://`` tier (``tc_committed_file_s``,
      ``tc_restore_file_s``): the fsspec code path of a remote tier without a slow server
      in the way (the moto S3 server on loopback measures moto).
    - ``peer_write``: ``benchmarks/results/cluster.json``, 2 ranks on 2 cores through
      ``peer://`` daemons, ``bytes_per_rank / committed_s`` (one core per rank).
    - ``peer_read``: ``benchmarks/results/peer_tcp.json`` ``peer_get_gbps`` (client and
      daemon sharing 2 cores: one core for the reading rank).
    """

    shm_write: float = 2.193
    shm_read: float = 2.700
    lmdb_write: float = 0.687
    lmdb_read: float = 2.485
    remote_write: float = 0.499
    remote_read: float = 1.388
    peer_write: float = 0.542
    peer_read: float = 1.222
    cores: float = 2.0
    peer_write_cores: float = 1.0
    peer_read_cores: float = 1.0
    source: str = "built-in: benchmarks/results/{latest,cluster,peer_tcp}.json of 2026-11-22"

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"measured.{f.name} must be a positive number, got {value!r}")

    @classmethod
    def from_benchmarks(cls, directory: str | os.PathLike[str]) -> Measured:
        """Read the rates from a ``benchmarks/results`` directory; ``ConfigError`` naming the
        file and key when one is missing."""
        root = Path(directory)

        def load(name: str) -> dict[str, Any]:
            path = root / name
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise ConfigError(f"no benchmark results at {path}") from None
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read {path}: {exc}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: expected a JSON object")
            return data

        latest = load("latest.json")
        cluster = load("cluster.json")
        peer = load("peer_tcp.json")
        try:
            metrics = latest["metrics"]
            size = float(latest["state"]["bytes"]) / GB
            cpus = float(latest["machine"]["cpus"])

            def rate(key: str) -> float:
                return size / float(metrics[key]["median"])

            two = [c for c in cluster["configs"] if c["ranks"] == 2]
            if not two:
                raise KeyError("configs[ranks == 2]")
            tcp = two[0]["tcp"]
            peer_cpus = float(cluster["machine"]["cpus"])
            return cls(
                shm_write=rate("tc_committed_shm_s"),
                shm_read=rate("tc_restore_shm_s"),
                lmdb_write=rate("tc_committed_lmdb_s"),
                lmdb_read=rate("tc_restore_lmdb_s"),
                remote_write=rate("tc_committed_file_s"),
                remote_read=rate("tc_restore_file_s"),
                peer_write=float(tcp["bytes_per_rank"]) / float(tcp["committed_s"]) / GB,
                peer_read=float(peer["peer_get_gbps"]),
                cores=cpus,
                peer_write_cores=peer_cpus / 2,
                peer_read_cores=float(peer["machine"]["cpus"]) / 2,
                source=f"{root}: latest.json ({latest.get('created', '?')}), cluster.json, "
                "peer_tcp.json",
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"{root}: benchmark results lack {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TierRates:
    """One tier on the target, for one rank: GB/s tiercheck itself reaches (``*_cpu``) and
    the rank's share of the medium (``*_medium``). ``shared``: the medium is shared by every
    rank of the job (the remote store), so the job's mean shard sets the pace there."""

    name: str
    survives: FailureDomain
    write_cpu_gbps: float
    write_medium_gbps: float
    read_cpu_gbps: float
    read_medium_gbps: float
    medium: str
    shared: bool

    def write_seconds(self, largest: float, mean: float) -> float:
        """Seconds for every rank to write its shard: ``largest`` / ``mean`` bytes per rank."""
        return _seconds(largest, mean, self.write_cpu_gbps, self.write_medium_gbps, self.shared)

    def read_seconds(self, largest: float, mean: float) -> float:
        """Seconds for every rank to read its shard back."""
        return _seconds(largest, mean, self.read_cpu_gbps, self.read_medium_gbps, self.shared)

    def limits(self) -> tuple[str, str]:
        """What bounds the write and the read: ``"tiercheck (CPU)"`` or the medium."""
        w = "tiercheck (CPU)" if self.write_cpu_gbps <= self.write_medium_gbps else self.medium
        r = "tiercheck (CPU)" if self.read_cpu_gbps <= self.read_medium_gbps else self.medium
        return w, r

    def to_json(self) -> dict[str, Any]:
        w, r = self.limits()
        return {
            **asdict(self),
            "survives": self.survives.value,
            "survives_text": survival_text(self.name),
            "write_limit": w,
            "read_limit": r,
        }


def _seconds(largest: float, mean: float, cpu: float, medium: float, shared: bool) -> float:
    # each rank runs at most at tiercheck's own rate; the medium carries the node's (or, when
    # shared by the job, every rank's) bytes at its rate
    return max(largest / (cpu * GB), (mean if shared else largest) / (medium * GB))


def tier_rates(
    hardware: Hardware, measured: Measured, *, gpus: int, gpus_per_node: int
) -> dict[str, TierRates]:
    """Per-rank rates of the modelled tiers ``shm``, ``peer``, ``lmdb`` and ``remote``."""
    scale = hardware.cores_per_rank / measured.cores
    node = float(gpus_per_node)
    m, hw = measured, hardware
    peer_w = hw.cores_per_rank / m.peer_write_cores
    peer_r = hw.cores_per_rank / m.peer_read_cores
    rows: dict[str, tuple[float, float, float, float, str, bool]] = {
        "shm": (
            m.shm_write * scale,
            hw.host_memory_gbps / node,
            m.shm_read * scale,
            hw.host_memory_gbps / node,
            "host memory",
            False,
        ),
        "peer": (
            m.peer_write * peer_w,
            hw.nic_gbps / node,
            m.peer_read * peer_r,
            hw.nic_gbps / node,
            "network port",
            False,
        ),
        "lmdb": (
            m.lmdb_write * scale,
            hw.nvme_write_gbps / node,
            m.lmdb_read * scale,
            hw.nvme_read_gbps / node,
            "NVMe",
            False,
        ),
        "remote": (
            m.remote_write * scale,
            hw.remote_write_gbps / gpus,
            m.remote_read * scale,
            hw.remote_read_gbps / gpus,
            "remote store",
            True,
        ),
    }
    return {name: TierRates(name, TIER_SURVIVES[name], *row) for name, row in rows.items()}


def load_hardware(path: str | os.PathLike[str]) -> Hardware:
    """Read :class:`Hardware` from a TOML file of its fields (any subset; the rest default)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no hardware file at {p}") from None
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read hardware file {p}: {exc}") from None
    known = {f.name for f in fields(Hardware)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{p}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    try:
        return Hardware(**data)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{p}: {exc}") from None


def save_hardware(path: str | os.PathLike[str], hardware: Hardware) -> None:
    """Write ``hardware`` to ``path`` as TOML (readable by :func:`load_hardware`)."""
    import tomli_w

    header = (
        "# tiercheck target hardware (tiercheck plan --hardware FILE)\n"
        "# GB/s = 1e9 bytes/s; per GPU: pcie, hbm; per node: host_memory, nic, nvme;\n"
        "# aggregate over the job: remote; sources in docs/goodput.md\n\n"
    )
    write_text_atomic(Path(path), header + tomli_w.dumps(hardware.to_json()))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
