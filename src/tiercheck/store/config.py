"""Store configuration: ``tiercheck.toml`` at a store root names the tiers and the policy.

A new root with no configuration gets the embedded default: host shared memory named after
the root, an LMDB tier under the root and a ``file://`` "remote" tier under the root, both
written relative to the root (``{root}`` in a URL or a string option stands for the store's
root wherever it is now, so a moved root still finds them). The
"remote" tier is a directory on this node's disk: it survives a crash and a reboot, not
losing the node, and is labelled so (``survives = "process"``); it is shared by the ranks
of a job, so it receives migrated base versions asynchronously. Point it at real remote
storage (and drop the label) for a checkpoint that survives losing the node. The file is
plain TOML so people can read and edit it::

    format = 1
    store_id = "5f0c3b9ad2e14e7f8a6b1c2d3e4f5a6b"   # made when the store is created

    [policy]
    base_every = 10
    chunk_size = 4194304

    [[tier]]
    name = "shm"
    url = "shm://tiercheck-3f2a9c1e0b7d"
    versions = "all"        # optional placement overrides (see tiercheck.TierPolicy)

    [[tier]]
    name = "remote"
    url = "file://{root}/remote"
    options = { survives = "process", shared = true }

``store_id`` names the store (formats/SPEC.md, "Store identity"): every tier the store
owns records it, and a tier recording another store's id is refused
(:mod:`tiercheck.store.identity`). It belongs to the file at the root: :func:`save_config`
keeps the id of the file it replaces, or draws a new one for a new file, so a
configuration used as a template (``config=``) never gives a new store another's id. A
file without one (written before stores had ids) gets one at the first writable open.

Secrets (peer tokens, object-store keys) are never written to the file: an option whose
name says it is one (``token``, ``secret``, ``password``, ``key``, ``*_token``, ``*_key``,
``*_id``, ...), everything under ``headers`` (``Authorization``, ``Cookie``, ...) and the
user and password of a URL (``s3://KEY:SECRET@bucket/...``, in the tier's URL or an
option's) are left out with a warning, and the next open needs them from elsewhere: the
environment (``AWS_ACCESS_KEY_ID``, ``$TIERCHECK_PEER_TOKEN``), the options passed to that
open (``Checkpointer(root, tiers=[TierSpec(name, url, {"storage_options": ...})])``), or a
reference. The file is created mode 0600 all the same. Write a
*reference* instead, resolved each time the store is opened: ``{ env = "NAME" }`` (an
environment variable) or ``{ file = "/path" }`` (a file's content, without surrounding
whitespace; it should be mode 0600)::

    [[tier]]
    name = "remote"
    url = "s3://bucket/ckpt"
    [tier.options.storage_options]
    key = { env = "AWS_ACCESS_KEY_ID" }
    secret = { file = "/run/secrets/s3" }

The file is TOML written by ``tomli-w`` and read by ``tomllib`` (``tomli`` on Python 3.10).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import blake3
import tomli_w

from tiercheck.core.urls import without_userinfo
from tiercheck.errors import ConfigError
from tiercheck.store.policy import Policy, TierPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_REMOTE_PACK",
    "StoreConfig",
    "TierSpec",
    "default_config",
    "expand_root",
    "is_secret_option",
    "load_config",
    "new_store_id",
    "read_store_id",
    "relative_defaults",
    "resolve_references",
    "rewrite_store_file",
    "save_config",
    "without_userinfo",
]

log = logging.getLogger(__name__)

CONFIG_NAME = "tiercheck.toml"
CONFIG_FORMAT = 1
ROOT_PLACEHOLDER = "{root}"
#: the pack size of the default store's ``remote`` directory (see :func:`default_config`)
DEFAULT_REMOTE_PACK = "16MiB"
_STORE_ID_RE = re.compile(r"^[0-9a-f]{32}$")

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
    """Tiers and policy of a store; ``store_id`` as read from its file (None: not read
    from a file, or a file written before stores had ids)."""

    tiers: tuple[TierSpec, ...]
    policy: Policy
    store_id: str | None = None
    #: the root the store's file was last written or opened at (``root`` in the file):
    #: another path means the root was moved, or copied (:mod:`tiercheck.store.identity`)
    recorded_root: str | None = None


def new_store_id() -> str:
    """A fresh store id: 128 random bits as 32 lowercase hex digits."""
    return uuid.uuid4().hex


def expand_root(spec: TierSpec, root: str | os.PathLike[str]) -> TierSpec:
    """``spec`` with ``{root}`` in its URL and string options replaced by ``root``."""
    if ROOT_PLACEHOLDER not in spec.url and not any(
        isinstance(v, str) and ROOT_PLACEHOLDER in v for v in spec.options.values()
    ):
        return spec
    where = os.fspath(root)
    options = {
        k: v.replace(ROOT_PLACEHOLDER, where) if isinstance(v, str) else v
        for k, v in spec.options.items()
    }
    return TierSpec(spec.name, spec.url.replace(ROOT_PLACEHOLDER, where), options)


def default_config(root: Path, *, multi_rank: bool = False) -> StoreConfig:
    """The embedded default tiers for a new store at ``root``.

    The shm segment is named after the root *and* a random id drawn now, so a store created
    again at the same path never picks up a segment a deleted store left in /dev/shm. With
    ``multi_rank``, the shm and LMDB tiers get a ``{rank}`` each, so ranks sharing the root
    (and a node) do not share them.
    """
    per_rank = "-{rank}" if multi_rank else ""
    return StoreConfig(
        tiers=(
            TierSpec("shm", f"shm://{shm_default_name(root)}{per_rank}"),
            # relative to the root: a moved root still opens its tiers
            TierSpec("lmdb", f"lmdb://{ROOT_PLACEHOLDER}/lmdb{per_rank}"),
            # a directory on this node's disk: it survives a crash and a reboot, not the
            # node; shared by the ranks, so it takes migrated bases (placement defaults),
            # in packs: 64 files per GiB, not 256 chunk files. A pack waits in memory
            # until it is written (up to three at once), and a disk needs no object store's
            # large requests: 16 MiB packs held 30 MiB during a 1 GiB base's migration
            # where 128 MiB packs held 142 MiB, and migrated it as fast (1.20 s, 1.27 s)
            TierSpec(
                "remote",
                f"file://{ROOT_PLACEHOLDER}/remote",
                {"survives": "process", "shared": True, "pack_size": DEFAULT_REMOTE_PACK},
            ),
        ),
        policy=Policy(),
    )


def shm_default_name(root: Path) -> str:
    """A new default shm segment name for a store at ``root`` (``tiercheck-`` and 12 hex
    digits of a hash of the root and a random id)."""
    tag = blake3.blake3(f"{root.resolve()}\0{uuid.uuid4()}".encode()).hexdigest()[:12]
    return f"tiercheck-{tag}"


def relative_defaults(tiers: tuple[TierSpec, ...], root: Path) -> dict[str, str]:
    """The URLs of an older store's default tiers (``lmdb:///ROOT/lmdb``,
    ``file:///ROOT/remote``) rewritten relative to the root (``{root}``), for the root
    the store is at now, or a root it was moved from (one without a store any more, when
    this root holds the directory)."""
    urls: dict[str, str] = {}
    for spec in tiers:
        for scheme in ("lmdb://", "file://"):
            if not spec.url.startswith(scheme) or ROOT_PLACEHOLDER in spec.url:
                continue
            where = spec.url[len(scheme) :]
            parent, tail = os.path.split(where.rstrip("/"))
            if not parent.startswith("/") or not tail:
                continue
            here = root / tail.replace("{rank}", "0")
            moved = not (Path(parent) / CONFIG_NAME).exists() and here.exists()
            if os.path.realpath(parent) == os.path.realpath(root) or moved:
                urls[spec.url] = f"{scheme}{ROOT_PLACEHOLDER}/{tail}"
    return urls


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
    store_id = data.get("store_id")
    if store_id is not None and not (isinstance(store_id, str) and _STORE_ID_RE.match(store_id)):
        raise ConfigError(f"{path}: store_id must be 32 lowercase hex digits, got {store_id!r}")
    recorded_root = data.get("root")
    if recorded_root is not None and not isinstance(recorded_root, str):
        raise ConfigError(f"{path}: root must be a string, got {recorded_root!r}")
    policy_data = data.get("policy", {})
    unknown = set(policy_data) - _POLICY_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown policy keys {sorted(unknown)}")
    specs: list[TierSpec] = []
    tier_policies: dict[str, TierPolicy] = {}
    for raw in data.get("tier", []):
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("name"), str)
            or not isinstance(raw.get("url"), str)
            or not isinstance(raw.get("options", {}), dict)
        ):
            raise ConfigError(
                f"{path}: every [[tier]] needs a name and a url (strings), and its options "
                "are a table"
            )
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
            try:
                tier_policies[raw["name"]] = TierPolicy(**overrides)
            except ConfigError as exc:
                raise ConfigError(f"{path}: tier {raw['name']!r}: {exc}") from None
    try:
        policy = Policy(**policy_data, tiers=tier_policies)
    except ConfigError as exc:
        raise ConfigError(f"{path}: [policy]: {exc}") from None
    return StoreConfig(coerce_tiers(specs), policy, store_id=store_id, recorded_root=recorded_root)


_SECRET_NAMES = frozenset(
    {
        "token",
        "secret",
        "password",
        "passwd",
        "key",
        "credentials",
        "connection_string",
        "sas_token",
        "account_key",
        "client_secret",
        "private_key",
        "api_key",
        "auth",
        "authorization",
        "proxy_authorization",
        "cookie",
        "set_cookie",
        "headers",
    }
)
_SECRET_SUFFIXES = ("_token", "_secret", "_password", "_key", "_credentials", "_id", "_headers")
_SECRET_HINT = (
    "the next open needs them from the environment (AWS_ACCESS_KEY_ID, "
    "TIERCHECK_PEER_TOKEN, ...), from the options passed to that open "
    "(Checkpointer(root, tiers=[TierSpec(name, url, options)])), or from a reference "
    'written in their place, e.g. options = {{ {name} = {{ env = "NAME" }} }}'
)


def is_secret_option(name: str) -> bool:
    """Whether an option called ``name`` holds a secret (and so is never written).

    Case and ``-``/``_`` do not matter: ``X-Api-Key`` and ``x_api_key`` are both secrets.
    Everything under an option that is a secret (``headers``) is one too.
    """
    lower = name.lower().replace("-", "_")
    return lower in _SECRET_NAMES or lower.endswith(_SECRET_SUFFIXES)


def _reference(value: Any) -> tuple[str, str] | None:
    """``("env", NAME)`` or ``("file", PATH)`` for a reference value, else None."""
    if isinstance(value, Mapping) and len(value) == 1:
        ((kind, target),) = value.items()
        if kind in ("env", "file") and isinstance(target, str):
            return kind, target
    return None


def _without_secrets(value: Any, where: str, dropped: list[str], secret: bool = False) -> Any:
    """``value`` with every secret removed (references kept), recursively.

    ``secret``: ``value`` lies under a secret option, so every plain value in it is one.
    Removed values are named in ``dropped``; a string that is a URL loses its userinfo.
    """
    if _reference(value) is not None:
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            name = f"{where}.{k}" if where else str(k)
            if v is None:
                continue  # TOML has no null: an absent option means the default
            inner = secret or is_secret_option(str(k))
            if inner and _reference(v) is None and not isinstance(v, Mapping):
                dropped.append(name)
                continue
            kept = _without_secrets(v, name, dropped, inner)
            if isinstance(v, Mapping) and v and not kept:
                continue  # a secret map of nothing but secrets: leave the key out too
            out[str(k)] = kept
        return out
    if isinstance(value, (list, tuple)):
        if secret:
            dropped.append(where)
            return []
        return [_without_secrets(v, where, dropped) for v in value]
    if isinstance(value, str):
        stripped = without_userinfo(value)
        if stripped != value:
            dropped.append(f"{where} (the user and password in the URL)")
        return stripped
    return value


def resolve_references(options: Mapping[str, Any], *, tier: str = "") -> dict[str, Any]:
    """``options`` with every ``{env = NAME}`` / ``{file = PATH}`` replaced by its value.

    ``ConfigError`` names the tier and the variable or file when one cannot be read.
    """

    def resolve(value: Any, where: str) -> Any:
        ref = _reference(value)
        if ref is not None:
            kind, target = ref
            if kind == "env":
                found = os.environ.get(target)
                if found is None:
                    raise ConfigError(
                        f"tier {tier!r} option {where}: environment variable {target} is not set"
                    )
                return found
            try:
                with open(target, "rb") as f:
                    if os.fstat(f.fileno()).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                        log.warning(
                            "secret file %s is readable by other users; chmod 600 it", target
                        )
                    return f.read().decode().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    f"tier {tier!r} option {where}: cannot read {target}: {exc}"
                ) from None
        if isinstance(value, Mapping):
            return {k: resolve(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, where) for v in value]
        return value

    return {k: resolve(v, str(k)) for k, v in options.items()}


def _document(config: StoreConfig, store_id: str, root: str) -> dict[str, Any]:
    """The TOML document of ``config``, secrets left out (with a warning naming them)."""
    policy = {
        name: getattr(config.policy, name)
        for name in sorted(_POLICY_KEYS)
        if getattr(config.policy, name) is not None
    }
    tiers: list[dict[str, Any]] = []
    for spec in config.tiers:
        dropped: list[str] = []
        url = without_userinfo(spec.url)
        if url != spec.url:
            dropped.append("url (the user and password in the URL)")
        entry: dict[str, Any] = {"name": spec.name, "url": url}
        tp = config.policy.tiers.get(spec.name)
        if tp is not None:
            for name in sorted(_TIER_POLICY_KEYS):
                value = getattr(tp, name)
                if name.startswith("keep_"):
                    entry[name] = "all" if value is None else value
                elif value is not None:  # guarantee None: by mode, as when absent
                    entry[name] = value
        options = _without_secrets(dict(spec.options), "", dropped)
        if dropped:
            log.warning(
                "tier %s: not writing the secret option(s) %s to %s; %s",
                spec.name,
                ", ".join(dropped),
                CONFIG_NAME,
                _SECRET_HINT.format(name=min(dropped, key=lambda d: " (" in d).split(" ")[0]),
            )
        if options:
            entry["options"] = options
        tiers.append(entry)
    return {
        "format": CONFIG_FORMAT,
        "store_id": store_id,
        "root": root,
        "policy": policy,
        "tier": tiers,
    }


def _write_synced(fd: int, text: str) -> None:
    """Write ``text`` to the file open as ``fd``, fsync it and close it."""
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _holds(path: Path, text: str) -> bool:
    """Whether the file at ``path`` holds exactly ``text``, readable by its owner only."""
    try:
        with open(path, "rb") as f:
            private = not os.fstat(f.fileno()).st_mode & (stat.S_IRWXG | stat.S_IRWXO)
            return private and f.read() == text.encode()
    except OSError:
        return False


@contextlib.contextmanager
def _store_file_lock(path: Path) -> Iterator[None]:
    """Serialise the writers of the store file ``path`` (an flock on its directory), so
    that the id one of them read is the id the file keeps."""
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_store_id(path: Path) -> str | None:
    """The store id in the file at ``path`` (None: no file, one without an id, or one that
    does not read as a configuration: a new id is drawn when it is written again)."""
    try:
        return load_config(path).store_id
    except ConfigError:
        return None


def save_config(path: Path, config: StoreConfig, *, exclusive: bool = False) -> bool:
    """Write ``config`` to ``path`` atomically (temp file + fsync + rename); a file that
    holds it already is left as it is (a writable open of a store on a full disk works).

    The store id and root written are those of the file it replaces (the root a store was
    moved or copied from is :mod:`tiercheck.store.identity`'s to judge), or a new id and
    the file's directory (never ``config.store_id``: a configuration read elsewhere does
    not carry its store's id to another root). ``exclusive``: only if ``path`` does not
    exist yet (a hard link, which fails on an existing name, instead of the rename);
    returns False, writing nothing, if it does.
    """
    with _store_file_lock(path):
        store_id, root, older = None, None, False
        if not exclusive:
            with contextlib.suppress(ConfigError):
                before = load_config(path)
                store_id, root = before.store_id, before.recorded_root
                older = store_id is None
        if older:
            # a file written before stores had ids: its default tiers become relative
            urls = relative_defaults(config.tiers, path.parent)
            tiers = tuple(TierSpec(t.name, urls.get(t.url, t.url), t.options) for t in config.tiers)
            config = StoreConfig(tiers, config.policy)
        if store_id is None:
            store_id, root = new_store_id(), None
        return _save_config(path, config, store_id, root or str(path.parent.resolve()), exclusive)


def _save_config(
    path: Path, config: StoreConfig, store_id: str, root: str, exclusive: bool
) -> bool:
    try:
        body = tomli_w.dumps(_document(config, store_id, root))
    except TypeError as exc:  # a value TOML cannot hold
        raise ConfigError(f"cannot write the store configuration to TOML: {exc}") from None
    text = "# tiercheck store configuration (secrets are never written here)\n" + body
    if not exclusive and _holds(path, text):
        # every writable open saves its configuration: one that did not change is not
        # written again, so a store on a full disk still opens (for `tiercheck gc`)
        return True
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        # 0600: the file holds no secret, but names where they live (and options people
        # put there by hand); the store's owner reads it, nobody else needs to
        _write_synced(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), text)
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: create-if-absent, then write
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return False
            _write_synced(fd, text)
        return True
    finally:
        # gone once renamed; else removed, whatever failed (a full disk leaves no temp file)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def rewrite_store_file(
    path: Path,
    *,
    store_id: str | None = None,
    root: str | None = None,
    urls: Mapping[str, str] | None = None,
    only_without_id: bool = False,
) -> str | None:
    """Change the store file at ``path`` in place, as text, so that nothing else in it
    changes (comments, inline secrets a user wrote there): set its ``store_id`` and
    ``root`` and replace each quoted URL ``old`` by ``urls[old]``. The result is parsed
    before it replaces the file (atomically); ``ConfigError`` if it would not read back as
    intended. ``only_without_id``: change nothing if the file has a store id by now (another
    process adopted it first). Returns the file's store id afterwards."""
    with _store_file_lock(path):
        if only_without_id:
            found = read_store_id(path)
            if found is not None:
                return found
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        before = load_config(path)
        for old, new in (urls or {}).items():
            text = text.replace(tomli_w.dumps({"u": old})[4:-1], tomli_w.dumps({"u": new})[4:-1])
        for key, value in (("root", root), ("store_id", store_id)):
            if value is None:
                continue
            line = f"{key} = {tomli_w.dumps({'u': value})[4:-1]}"
            pattern = rf"(?m)^{key}\s*=\s*(\"[^\"\n]*\"|'[^'\n]*')[ \t]*$"
            text, n = re.subn(pattern, line.replace("\\", "\\\\"), text, count=1)
            if not n:
                # a top-level key goes before the first table: after the leading comments
                head = re.match(r"(?:[ \t]*(?:#[^\n]*)?\n)*", text)
                cut = head.end() if head else 0
                text = f"{text[:cut]}{line}\n{text[cut:]}"
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            _write_synced(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), text)
            after = load_config(tmp)
            wanted = {without_userinfo(u): v for u, v in (urls or {}).items()}
            same = [(t.name, wanted.get(t.url, t.url)) for t in before.tiers] == [
                (t.name, t.url) for t in after.tiers
            ]
            if (
                not same
                or (store_id is not None and after.store_id != store_id)
                or (root is not None and after.recorded_root != root)
            ):
                raise ConfigError(f"{path}: could not rewrite it as text; edit it by hand")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return after.store_id
