"""Cadences: "every N steps" or "every so long", as the placement policy states them.

Two settings are cadences (docs/configuration.md): ``remote_every`` (``Policy``; through
``TierPolicy.every``, how often an asynchronous tier receives a base) and
``TierPolicy.milestones`` (the versions retention keeps besides the newest few, one per
window). A cadence is written as a number of steps (an ``int``, or ``"500 steps"``) or as
a duration (``"90s"``, ``"30min"``, ``"2h"``, ``"7d"``); ``0`` means no cadence (every
version; no milestones). Anything else is a :class:`~tiercheck.errors.ConfigError` that
says what is accepted.

A duration is measured on the versions' own clock (``VersionInfo.time``, the wall clock of
the save), and a number of steps on their steps, so every rank of a job, and every
process of a run that restarts, decides alike from what the tier's log records.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tiercheck.errors import ConfigError

__all__ = ["Cadence", "CadenceValue", "parse_cadence"]

CadenceValue = str | int | None

_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}
_FORM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")


@dataclass(frozen=True)
class Cadence:
    """Every ``steps`` steps, or every ``seconds`` seconds (exactly one is set)."""

    steps: int | None = None
    seconds: float | None = None

    def due(self, step: int, time: float, last_step: int, last_time: float) -> bool:
        """Whether a version at ``(step, time)`` is due after one at ``(last_step,
        last_time)``. A step or a clock that went backwards (a run restarted from an older
        version, a clock reset) makes it due: the cadence restarts from there."""
        if self.steps is not None:
            return step - last_step >= self.steps or step < last_step
        assert self.seconds is not None
        return time - last_time >= self.seconds or time < last_time

    def window(self, step: int, time: float) -> int:
        """The index of the window ``(step, time)`` falls in (milestones keep one per
        window): ``step // steps``, or whole ``seconds`` since the epoch."""
        if self.steps is not None:
            return step // self.steps
        assert self.seconds is not None
        return math.floor(time / self.seconds)

    def describe(self) -> str:
        if self.steps is not None:
            return f"{self.steps} steps"
        assert self.seconds is not None
        return f"{self.seconds:g} s"


def parse_cadence(value: object, name: str) -> Cadence | None:
    """The cadence ``value`` states (None for ``0`` or ``None``: no cadence), or
    ``ConfigError`` naming the setting ``name``."""
    hint = (
        f"{name} must be a number of steps (an int such as 500, or '500 steps'), a duration "
        "('90s', '30min', '2h', '7d') or 0 for none"
    )
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{hint}; got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{hint}; got {value!r}")
        return Cadence(steps=value) if value else None
    if value.strip() == "0":
        return None
    m = _FORM.match(value.lower())
    if m is None:
        raise ConfigError(f"{hint}; got {value!r}")
    number, unit = m.groups()
    if unit in ("step", "steps"):
        if "." in number:
            raise ConfigError(f"{hint}; got {value!r} (a number of steps is whole)")
        steps = int(number)
        return Cadence(steps=steps) if steps else None
    if unit not in _UNITS:
        raise ConfigError(f"{hint}; got {value!r} (unknown unit {unit!r})")
    seconds = float(number) * _UNITS[unit]
    return Cadence(seconds=seconds) if seconds > 0 else None
