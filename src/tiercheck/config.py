"""Store configuration: ``tiercheck.toml`` at a store root names the tiers and the policy.

A new root with no configuration gets the embedded default: host shared memory named after
the root, an LMDB tier under the root and a ``file://`` "remote" tier under the root. The
"remote" tier is a directory on this node's disk: it survives a crash and a reboot, not
losing the node, and is labelled so (``survives = "process"``); it is shared by the ranks
of a job, so it receives migrated base versions asynchronously. Point it at real remote
storage (and drop the label) for a checkpoint that survives losing the node. The file is
plain TOML so people can read and edit it::

    format = 1

    [policy]
    base_every = 10
    chunk_size = 4194304

    [[tier]]
    name = "shm"
    url = "shm://tiercheck-3f2a9c1e0b7d"
    versions = "all"        # optional placement overrides (see tiercheck.TierPolicy)

    [[tier]]
    name = "remote"
    url = "file:///data/ckpt/remote"
    options = { survives = "process", shared = true }
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import blake3
import tomllib

from tiercheck.errors import ConfigError
from tiercheck.placement import Policy, TierPolicy

__all__ = [
    "CONFIG_NAME",
    "StoreConfig",
    "TierSpec",
    "default_config",
    "load_config",
    "save_config",
]

CONFIG_NAME = "tiercheck.toml"
CONFIG_FORMAT = 1

_POLICY_KEYS = {f.name for f in fields(Policy)} - {"tiers"}
_TIER_POLICY_KEYS = {f.name for f in fields(TierPolicy)}


@dataclass(frozen=True)
class TierSpec:
    """A tier of a store: a short ``name`` (used in policies and history), its URL, and the
    options passed to the tier class."""

    name: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"tier name {self.name!r} must be letters, digits, '-' or '_'")


@dataclass(frozen=True)
class StoreConfig:
    tiers: tuple[TierSpec, ...]
    policy: Policy


def default_config(root: Path, *, multi_rank: bool = False) -> StoreConfig:
    """The embedded default tiers for a new store at ``root``.

    The shm segment is named after the root *and* a random id drawn now, so a store created
    again at the same path never picks up a segment a deleted store left in /dev/shm. With
    ``multi_rank``, the shm and LMDB tiers get a ``{rank}`` each, so ranks sharing the root
    (and a node) do not share them.
    """
    root = root.resolve()
    tag = blake3.blake3(f"{root}\0{uuid.uuid4()}".encode()).hexdigest()[:12]
    per_rank = "-{rank}" if multi_rank else ""
    return StoreConfig(
        tiers=(
            TierSpec("shm", f"shm://tiercheck-{tag}{per_rank}"),
            TierSpec("lmdb", f"lmdb://{root / 'lmdb'}{per_rank}"),
            # a directory on this node's disk: it survives a crash and a reboot, not the
            # node; shared by the ranks, so it takes migrated bases (placement defaults)
            TierSpec(
                "remote",
                f"file://{root / 'remote'}",
                {"survives": "process", "shared": True},
            ),
        ),
        policy=Policy(),
    )


def coerce_tiers(tiers: Sequence[str | TierSpec | tuple[str, str]]) -> tuple[TierSpec, ...]:
    """Accept URLs, ``(name, url)`` pairs or specs; name bare URLs after their scheme."""
    specs: list[TierSpec] = []
    for item in tiers:
        if isinstance(item, TierSpec):
            specs.append(item)
        elif isinstance(item, tuple):
            specs.append(TierSpec(item[0], item[1]))
        elif isinstance(item, str):
            scheme = item.split("://", 1)[0].replace("+", "-") if "://" in item else "tier"
            name = scheme
            n = 2
            while any(s.name == name for s in specs):
                name = f"{scheme}{n}"
                n += 1
            specs.append(TierSpec(name, item))
        else:
            raise ConfigError(f"a tier must be a URL, (name, url) or TierSpec, got {item!r}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"tier names must be unique, got {names}")
    if not specs:
        raise ConfigError("a store needs at least one tier")
    return tuple(specs)


def load_config(path: Path) -> StoreConfig:
    """Read a ``tiercheck.toml``; raise ``ConfigError`` naming the file on any problem."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no store configuration at {path}") from None
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    fmt = data.get("format", CONFIG_FORMAT)
    if fmt != CONFIG_FORMAT:
        raise ConfigError(f"{path}: configuration format {fmt!r} is not supported (expected 1)")
    policy_data = data.get("policy", {})
    unknown = set(policy_data) - _POLICY_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown policy keys {sorted(unknown)}")
    specs: list[TierSpec] = []
    tier_policies: dict[str, TierPolicy] = {}
    for raw in data.get("tier", []):
        if not isinstance(raw, dict) or "name" not in raw or "url" not in raw:
            raise ConfigError(f"{path}: every [[tier]] needs a name and a url")
        extra = set(raw) - {"name", "url", "options"} - _TIER_POLICY_KEYS
        if extra:
            raise ConfigError(f"{path}: tier {raw['name']!r} has unknown keys {sorted(extra)}")
        specs.append(TierSpec(raw["name"], raw["url"], dict(raw.get("options", {}))))
        # TOML has no null: keep_* = "all" stands for None (keep everything)
        overrides: dict[str, Any] = {
            k: (None if k.startswith("keep_") and raw[k] == "all" else raw[k])
            for k in _TIER_POLICY_KEYS
            if k in raw
        }
        if overrides:
            tier_policies[raw["name"]] = TierPolicy(**overrides)
    return StoreConfig(coerce_tiers(specs), Policy(**policy_data, tiers=tier_policies))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + inner + " }" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")


def _write_synced(fd: int, text: str) -> None:
    """Write ``text`` to the file open as ``fd``, fsync it and close it."""
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_config(path: Path, config: StoreConfig, *, exclusive: bool = False) -> bool:
    """Write ``config`` to ``path`` atomically (temp file + fsync + rename).

    ``exclusive``: only if ``path`` does not exist yet (a hard link, which fails on an
    existing name, instead of the rename); returns False, writing nothing, if it does.
    """
    lines = ["# tiercheck store configuration", f"format = {CONFIG_FORMAT}", "", "[policy]"]
    for name in sorted(_POLICY_KEYS):
        value = getattr(config.policy, name)
        if value is not None:  # TOML has no null: an absent key reads back as None
            lines.append(f"{name} = {_toml_value(value)}")
    for spec in config.tiers:
        lines += [
            "",
            "[[tier]]",
            f"name = {_toml_value(spec.name)}",
            f"url = {_toml_value(spec.url)}",
        ]
        tp = config.policy.tiers.get(spec.name)
        if tp is not None:
            for name in sorted(_TIER_POLICY_KEYS):
                value = getattr(tp, name)
                if name.startswith("keep_"):
                    lines.append(f"{name} = {_toml_value('all' if value is None else value)}")
                elif value is not None:  # guarantee None: by mode, as when absent
                    lines.append(f"{name} = {_toml_value(value)}")
        if spec.options:
            lines.append(f"options = {_toml_value(spec.options)}")
    text = "\n".join(lines) + "\n"
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _write_synced(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), text)
    if not exclusive:
        os.replace(tmp, path)
        return True
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: create-if-absent, then write
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        _write_synced(fd, text)
    finally:
        tmp.unlink()
    return True
