"""Failure models for goodput planning: which failures a job sees, how often, what each destroys.

A :class:`FailureModel` is a list of failure classes, each observed ``count`` times in a
reference window (``window_days`` on ``reference_gpus`` GPUs) and mapped to the widest
:class:`~tiercheck.FailureDomain` it destroys, plus the seconds a restart takes after a
failure of each domain (before any checkpoint is read). Rates scale linearly with the
number of GPUs: each class is a per-component failure.

The default is the published record of a 54-day run on 16,384 H100 GPUs (Llama 3 405B;
"The Llama 3 Herd of Models", 2024, table 5): 419 unexpected interruptions. The domain of
each class is this project's reading of what the failure takes away from a synchronous job
(every note says why); restart seconds are assumptions, the same for every design, so they
move every goodput but not the differences between designs. The record has no
cluster-wide failure; add one (``domain = "cluster"``) to see what a remote tier is insurance
against.

The model reads from and writes to TOML (``tiercheck plan --failures`` /
``--write-failures``)::

    source = "..."
    window_days = 54.0
    reference_gpus = 16384

    [restart_seconds]
    process = 300.0
    node = 600.0
    cluster = 1800.0

    [[failure]]
    name = "faulty GPU"
    count = 148
    domain = "node"
    note = "the node is drained and replaced by a spare; its host memory goes with it"
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercheck.backends.base import FailureDomain
from tiercheck.errors import ConfigError
from tiercheck.planning.tier_costs import write_text_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DEFAULT_FAILURE_MODEL",
    "FailureClass",
    "FailureModel",
    "load_failure_model",
    "save_failure_model",
]

_DOMAINS = ("process", "node", "cluster")


@dataclass(frozen=True)
class FailureClass:
    """Failures of one kind: ``count`` in the model's window, destroying ``domain``."""

    name: str
    count: float
    domain: FailureDomain
    note: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a failure class needs a name")
        if not isinstance(self.domain, FailureDomain):
            try:  # accept the domain's name, as a TOML file gives it
                object.__setattr__(self, "domain", FailureDomain(self.domain))
            except ValueError:
                raise ConfigError(
                    f"failure {self.name!r}: domain must be one of {', '.join(_DOMAINS)}, "
                    f"got {self.domain!r}"
                ) from None
        if not isinstance(self.count, (int, float)) or not math.isfinite(self.count):
            raise ConfigError(f"failure {self.name!r}: count must be a number")
        if self.count < 0:
            raise ConfigError(f"failure {self.name!r}: count must be >= 0, got {self.count}")
        if self.domain.value not in _DOMAINS:
            raise ConfigError(
                f"failure {self.name!r}: domain must be one of {', '.join(_DOMAINS)}, "
                f"got {self.domain.value!r}"
            )


@dataclass(frozen=True)
class FailureModel:
    """Failure classes observed over ``window_days`` on ``reference_gpus`` GPUs, and the
    restart seconds after a failure of each domain."""

    classes: tuple[FailureClass, ...]
    window_days: float = 54.0
    reference_gpus: int = 16384
    restart_seconds: Mapping[str, float] = field(
        default_factory=lambda: {"process": 300.0, "node": 600.0, "cluster": 1800.0}
    )
    source: str = ""

    def __post_init__(self) -> None:
        if not self.classes:
            raise ConfigError("a failure model needs at least one failure class")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ConfigError(f"failure class names must be unique, got {names}")
        if not self.window_days > 0 or not math.isfinite(self.window_days):
            raise ConfigError(f"window_days must be > 0, got {self.window_days!r}")
        if not isinstance(self.reference_gpus, int) or self.reference_gpus < 1:
            raise ConfigError(f"reference_gpus must be an int >= 1, got {self.reference_gpus!r}")
        unknown = set(self.restart_seconds) - set(_DOMAINS)
        if unknown:
            raise ConfigError(f"restart_seconds: unknown domains {sorted(unknown)}")
        for c in self.classes:
            value = self.restart_seconds.get(c.domain.value)
            if value is None:
                raise ConfigError(f"restart_seconds has no entry for domain {c.domain.value!r}")
        for name, value in self.restart_seconds.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"restart_seconds.{name} must be >= 0, got {value!r}")

    def rates_per_second(self, gpus: int) -> tuple[float, ...]:
        """Failure rate of each class for a job of ``gpus`` GPUs (linear in the GPU count)."""
        scale = gpus / self.reference_gpus / (self.window_days * 86400.0)
        return tuple(c.count * scale for c in self.classes)

    def mtbf_seconds(self, gpus: int) -> float:
        """Mean time between failures of any class for ``gpus`` GPUs (inf if none)."""
        total = sum(self.rates_per_second(gpus))
        return math.inf if total == 0 else 1.0 / total

    def restart_for(self, domain: FailureDomain) -> float:
        return float(self.restart_seconds.get(domain.value, 0.0))

    def to_toml_data(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "window_days": self.window_days,
            "reference_gpus": self.reference_gpus,
            "restart_seconds": {k: float(v) for k, v in self.restart_seconds.items()},
            "failure": [
                {"name": c.name, "count": c.count, "domain": c.domain.value, "note": c.note}
                for c in self.classes
            ],
        }

    def to_json(self) -> dict[str, Any]:
        return self.to_toml_data()


def _classes(*rows: tuple[str, int, str, str]) -> tuple[FailureClass, ...]:
    return tuple(FailureClass(n, c, FailureDomain(d), note) for n, c, d, note in rows)


_NODE_LOST = "the node is drained and replaced by a spare; its host memory goes with it"

DEFAULT_FAILURE_MODEL = FailureModel(
    classes=_classes(
        ("faulty GPU", 148, "node", _NODE_LOST),
        ("GPU HBM3 memory", 72, "node", _NODE_LOST),
        ("software bug", 54, "process", "processes crash; every node and its memory stay"),
        (
            "network switch or cable",
            35,
            "node",
            "the nodes behind it leave the job; assumes peer partners sit under another switch",
        ),
        ("host maintenance", 32, "node", "unplanned: the host goes down; a spare takes over"),
        ("GPU SRAM memory", 19, "node", _NODE_LOST),
        ("GPU system processor", 17, "node", _NODE_LOST),
        ("NIC", 7, "node", _NODE_LOST),
        ("NCCL watchdog timeout", 7, "process", "a hung collective: processes restart in place"),
        (
            "silent data corruption",
            6,
            "node",
            "the GPU that computed wrongly is excluded with its node",
        ),
        ("GPU thermal interface or sensor", 6, "node", _NODE_LOST),
        ("SSD", 3, "node", "the host SSD is gone; the node is replaced"),
        ("power supply", 3, "node", _NODE_LOST),
        (
            "other",
            10,
            "node",
            "chassis, IO board, CPU, system memory, dependency (2 each): taken as node losses",
        ),
    ),
    window_days=54.0,
    reference_gpus=16384,
    restart_seconds={"process": 300.0, "node": 600.0, "cluster": 1800.0},
    source=(
        "Llama 3 405B pretraining, 54 days on 16,384 H100 GPUs, 419 unexpected interruptions "
        "(The Llama 3 Herd of Models, 2024, table 5); domains and restart seconds are "
        "tiercheck's assumptions (docs/goodput.md)"
    ),
)


def _from_data(data: Mapping[str, Any], where: str) -> FailureModel:
    known = {"source", "window_days", "reference_gpus", "restart_seconds", "failure"}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    rows = data.get("failure")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where}: needs at least one [[failure]] table")
    classes = []
    for row in rows:
        if not isinstance(row, dict) or not {"name", "count", "domain"} <= set(row):
            raise ConfigError(f"{where}: every [[failure]] needs name, count and domain")
        extra = set(row) - {"name", "count", "domain", "note"}
        if extra:
            raise ConfigError(f"{where}: failure {row['name']!r} has unknown keys {sorted(extra)}")
        try:
            classes.append(
                FailureClass(
                    str(row["name"]), row["count"], row["domain"], str(row.get("note", ""))
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    restart = data.get("restart_seconds", DEFAULT_FAILURE_MODEL.restart_seconds)
    if not isinstance(restart, dict):
        raise ConfigError(f"{where}: restart_seconds must be a table")
    try:
        return FailureModel(
            classes=tuple(classes),
            window_days=data.get("window_days", 54.0),
            reference_gpus=data.get("reference_gpus", 16384),
            restart_seconds=dict(restart),
            source=str(data.get("source", "")),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_failure_model(path: str | os.PathLike[str]) -> FailureModel:
    """Read a failure model from a TOML file; ``ConfigError`` naming the file on any problem."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no failure model at {p}") from None
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read failure model {p}: {exc}") from None
    return _from_data(data, str(p))


def save_failure_model(path: str | os.PathLike[str], model: FailureModel) -> None:
    """Write ``model`` to ``path`` as TOML (readable by :func:`load_failure_model`)."""
    import tomli_w

    header = (
        "# tiercheck failure model (tiercheck plan --failures FILE)\n"
        "# count: failures in window_days on reference_gpus GPUs (rates scale with GPUs)\n"
        "# domain: what a failure destroys: process, node or cluster\n"
        "# restart_seconds: time to restart the job after a failure of each domain,\n"
        "#   before any checkpoint is read\n\n"
    )
    write_text_atomic(Path(path), header + tomli_w.dumps(model.to_toml_data()))
