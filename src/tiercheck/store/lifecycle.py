"""Store lifecycle: deleting a store with the node memory it holds, finding orphans, and
adopting a copied root as a store of its own.

A store's shm tier lives in /dev/shm, outside the store root, so deleting the root alone
would leave the segment behind for good. Every shm segment, LMDB environment and fsspec
prefix records its owner (the store id and root: :mod:`tiercheck.store.identity`; a
segment also the node, the creating process and time in ``owner.json``), which lets this
module:

- :func:`destroy_store` (``tiercheck rm ROOT``, ``Checkpointer.destroy()``): delete a
  store, its shm segments and its LMDB environments, refusing while a writer holds the
  store's lock. Only what the store owns: a segment or an LMDB environment outside the root
  whose owner record names another store (or none, or the original of a copied root) is
  kept; a ``{rank}`` in a name matches ranks (digits) only, never another segment; and one
  another live process holds open stops the deletion (``StoreLocked``), nothing deleted;
- :func:`find_orphans` (``tiercheck gc --orphans``): find this user's segments on this node
  whose store is gone (no ``tiercheck.toml`` at the root any more), was replaced (another
  store id there) or no longer names them; none that a live process holds open;
- :func:`warn_orphans`: log one warning per process when a store is opened next to orphans
  (a listing of small files; the segments are not measured);
- :func:`adopt_store` (``tiercheck adopt ROOT``): make a copied root a store of its own.

Segments without an owner store (opened as a bare ``shm://`` tier, or written before
owner records existed) are never judged orphans: shm is meant to outlive its process.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tiercheck.backends import DEFAULT_SHM_ROOT, Segment, list_segments, remove_segment
from tiercheck.backends.base import StoreOwner
from tiercheck.backends.registry import open_tier
from tiercheck.errors import ConfigError, StoreLocked, TierError
from tiercheck.store import identity
from tiercheck.store.config import (
    CONFIG_NAME,
    StoreConfig,
    TierSpec,
    load_config,
    new_store_id,
    resolve_references,
    rewrite_store_file,
    without_userinfo,
)

__all__ = [
    "AdoptReport",
    "DestroyReport",
    "Orphan",
    "adopt_store",
    "destroy_segment",
    "destroy_store",
    "find_orphans",
    "remove_orphans",
    "shm_root_left_as_found",
    "store_shm_roots",
    "warn_orphans",
]

log = logging.getLogger(__name__)

# what each placeholder of a segment name stands for: ranks are numbers, a node a name
_PLACEHOLDERS = {
    "rank": "[0-9]+",
    "local_rank": "[0-9]+",
    "src": "[0-9]+",
    "node": "[A-Za-z0-9._-]+",
}
_PLACEHOLDER = re.compile(r"\\\{(" + "|".join(_PLACEHOLDERS) + r")\\\}")


@dataclass(frozen=True)
class Orphan:
    """A segment whose store is gone: ``reason`` says how that was decided."""

    segment: Segment
    reason: str


@dataclass(frozen=True)
class DestroyReport:
    """What :func:`destroy_store` removed (or, with ``dry_run``, would remove).

    ``segments``: paths of the shm segments; ``freed``: their bytes; ``lmdb``: LMDB
    environments outside the root; ``kept``: tiers it does not delete (remote stores,
    peer daemons, and segments or environments another store owns), each with its URL or
    path and why, so the user can decide; ``failed_open``: the root was no store but what
    an open that failed left (its writer lock alone, see :func:`destroy_store`).
    """

    root: str
    segments: tuple[str, ...]
    freed: int
    lmdb: tuple[str, ...]
    kept: tuple[str, ...]
    dry_run: bool
    failed_open: bool = False


def _this_host() -> str:
    return socket.gethostname()


def _name_pattern(template: str) -> re.Pattern[str]:
    """A regex for the segment names ``template`` makes: a ``{rank}`` is a rank (digits),
    a ``{node}`` a host name; everything else exactly as written."""
    return re.compile(
        "^" + _PLACEHOLDER.sub(lambda m: _PLACEHOLDERS[m.group(1)], re.escape(template)) + "$"
    )


def _shm_names(spec: TierSpec) -> tuple[str, re.Pattern[str]] | None:
    """The shm root and the segment-name pattern of a tier spec, if it keeps shm."""
    options = spec.options
    if spec.url.startswith("shm://"):
        root = str(options.get("root", DEFAULT_SHM_ROOT))
        return root, _name_pattern(spec.url[len("shm://") :].rstrip("/"))
    if spec.url.startswith("collective://"):
        name = spec.url[len("collective://") :].strip("/")
        template = str(options.get("store", f"shm://{name}-from-{{src}}"))
        if not template.startswith("shm://"):
            return None
        root = str(options.get("shm_root", DEFAULT_SHM_ROOT))
        return root, _name_pattern(template[len("shm://") :].replace("{name}", name))
    return None


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _resolved(config: StoreConfig, root: str | os.PathLike[str]) -> list[TierSpec]:
    """The store's specs as an open of the store at ``root`` resolves them (``{root}``
    filled, a tier shared by stores narrowed to the store's namespace)."""
    specs = []
    for spec in config.tiers:
        try:
            specs.append(identity.resolve_spec(spec, Path(root), config.store_id))
        except ConfigError:
            continue  # shared by stores, in a store without an id: it has no namespace yet
    return specs


def _names_segment(specs: Iterable[TierSpec], seg: Segment) -> bool:
    for spec in specs:
        found = _shm_names(spec)
        if found is not None and _same_path(found[0], seg.root) and found[1].match(seg.name):
            return True
    return False


def store_shm_roots(config: StoreConfig | None) -> list[str]:
    """The shm roots a store's tiers use, and the default one."""
    roots = [DEFAULT_SHM_ROOT]
    for spec in config.tiers if config is not None else ():
        found = _shm_names(spec)
        if found is not None and found[0] not in roots:
            roots.append(found[0])
    return roots


def _still_held(paths: Sequence[str], looks: int = 5, pause: float = 0.1) -> dict[str, int]:
    """:func:`_holders`, asked again a few times while it finds any: a child between fork
    and exec holds copies of its parent's descriptors for a moment (any process of this
    user that starts a subprocess while a store is open), while a process that really holds
    the store open still does ``looks x pause`` seconds later."""
    held = _holders(paths)
    for _ in range(looks - 1):
        if not held:
            break
        time.sleep(pause)
        held = _holders(paths)
    return held


def _holders(paths: Iterable[str]) -> dict[str, int]:
    """For each of ``paths`` (directories) that another live process holds a file of open
    (a writable shm tier keeps its log open, LMDB its data and lock files): a pid of one.
    Reads ``/proc/PID/fd`` of the processes this user may inspect, which are all that can
    hold this user's segments (mode 0700)."""
    prefixes = {os.path.realpath(p): os.path.realpath(p) + os.sep for p in paths}
    found: dict[str, int] = {}
    if not prefixes:
        return found
    try:
        pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return found  # no /proc: cannot tell, as before
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            for path, prefix in prefixes.items():
                if target.startswith(prefix):
                    found.setdefault(path, pid)
    return found


def _mine(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid()
    except OSError:
        return False


def _orphan_reason(seg: Segment) -> str | None:
    """Why ``seg`` is an orphan, or None if its store still uses it (or cannot tell)."""
    if seg.store is None or not _mine(seg.path):
        return None
    if (seg.store_host or seg.host or _this_host()) != _this_host():
        return None  # its store is on another node: only that node can tell
    config_path = Path(seg.store) / CONFIG_NAME
    if not config_path.exists():
        return f"its store {seg.store} is gone (no {CONFIG_NAME})"
    try:
        config = load_config(config_path)
    except Exception as exc:  # another store's file must never fail this scan
        # unreadable or invalid (a hand edit): never guess toward deleting
        log.debug("orphan scan: cannot judge %s by %s: %s", seg.path, config_path, exc)
        return None
    if seg.store_id is not None and config.store_id not in (None, seg.store_id):
        return f"its store {seg.store_id} is gone (another store is at {seg.store} now)"
    if not _names_segment(_resolved(config, seg.store), seg):
        return f"its store {seg.store} no longer names it"
    return None


def find_orphans(
    shm_roots: Iterable[str | os.PathLike[str]] = (DEFAULT_SHM_ROOT,), *, sizes: bool = True
) -> list[Orphan]:
    """This user's segments under ``shm_roots``, created on this node, whose store is gone
    and which no other live process holds open."""
    candidates = []
    for root in dict.fromkeys(os.fspath(r) for r in shm_roots):
        for seg in list_segments(root, sizes=sizes):
            reason = _orphan_reason(seg)
            if reason is not None:
                candidates.append(Orphan(seg, reason))
    held = _holders(o.segment.path for o in candidates)
    return [o for o in candidates if os.path.realpath(o.segment.path) not in held]


def remove_orphans(orphans: Iterable[Orphan]) -> int:
    """Delete the orphans' segments (each judged again first); returns the bytes freed."""
    freed = 0
    for orphan in orphans:
        seg = orphan.segment
        fresh = [s for s in list_segments(seg.root, sizes=False) if s.path == seg.path]
        if not fresh or _orphan_reason(fresh[0]) is None:
            continue
        pid = _holders([seg.path]).get(os.path.realpath(seg.path))
        if pid is not None:
            log.warning("kept shm segment %s: process %d holds it open", seg.path, pid)
            continue
        freed += remove_segment(seg.path)
        log.info("removed orphaned shm segment %s (%s)", seg.path, orphan.reason)
    return freed


_warned = False
_warned_lock = threading.Lock()


def warn_orphans(shm_roots: Iterable[str | os.PathLike[str]] = (DEFAULT_SHM_ROOT,)) -> None:
    """Log a warning about this user's orphaned segments under ``shm_roots``, once per
    process (the first store opened for writing scans; later ones do not)."""
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    try:
        orphans = find_orphans(shm_roots, sizes=False)
    except OSError as exc:  # a scan must never stop a store from opening
        log.debug("orphan scan failed: %s", exc)
        return
    if orphans:
        log.warning(
            "%d shm segment(s) of your deleted stores hold memory on this node (%s); "
            "`tiercheck gc --orphans` lists them, `tiercheck gc --orphans --yes` frees them",
            len(orphans),
            ", ".join(o.segment.path for o in orphans[:3]) + (", ..." if len(orphans) > 3 else ""),
        )


# --- destroying a store -------------------------------------------------------------


@contextlib.contextmanager
def _writer_locks(root: Path, then: str = "delete the store") -> Iterator[None]:
    """Hold every writer lock of the store at ``root`` (``.lock``, ``.lock.rankN``);
    ``StoreLocked`` if a process holds one (its message ends with what to ``then`` do)."""
    fds: list[int] = []
    try:
        for path in sorted(glob.glob(str(root / ".lock")) + glob.glob(str(root / ".lock.rank*"))):
            fd = os.open(path, os.O_RDWR)
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise StoreLocked(
                    f"{root} is open for writing (pid {pid}, lock {os.path.basename(path)}); "
                    f"close that Checkpointer or stop the process, then {then}"
                ) from None
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _lmdb_paths(spec: TierSpec) -> list[str]:
    parts = urlsplit(spec.url)
    path = unquote(parts.path)
    if not path.startswith("/"):
        return []
    pattern = re.sub(r"\{(rank|local_rank|node)\}", "*", path)
    return [p for p in glob.glob(pattern) if os.path.isfile(os.path.join(p, "data.mdb"))]


def _inside(path: str, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(root)


@contextlib.contextmanager
def shm_root_left_as_found(root: str | os.PathLike[str] = DEFAULT_SHM_ROOT) -> Iterator[None]:
    """For a program that opens and destroys stores on this host (a demo, a benchmark run):
    the shm root it made is removed again when it is empty at the end.

    Destroying a store removes its segments but not the root directory, which every store
    on the host shares: another process may be creating a segment in it at any moment, so
    only a program that made the root, and finds it empty when it is done, removes it.
    """
    existed = os.path.exists(root)
    try:
        yield
    finally:
        if not existed:
            try:
                os.rmdir(root)
            except OSError:  # not empty (another store of this host), or already gone
                pass


def _owner_of_lmdb(url: str) -> StoreOwner | None:
    """The owner record of the LMDB environment at ``url`` (read-only open)."""
    tier = open_tier(url, read_only=True)
    try:
        return tier.read_owner()
    finally:
        tier.close()


def _owns(owner: StoreOwner | None, config: StoreConfig, root: Path) -> bool:
    """Whether the tier whose record is ``owner`` belongs to the store at ``root``: its
    own, or recorded at a root it was moved from. A store without an id (an older store)
    owns what records its root."""
    if owner is None:
        return False
    if config.store_id is None:
        recorded = owner.root
        return owner.store_id is None and recorded is not None and _same_path(recorded, str(root))
    return identity.relation(owner, config.store_id, root) in ("own", "moved")


def destroy_segment(url: str, *, dry_run: bool = False) -> DestroyReport:
    """Delete the shm segment ``url`` (``shm://NAME`` under the default shm root) that is
    not a tier of a store: one ``tiercheck migrate --to`` wrote, or one whose store is gone.
    Refused (``ConfigError``) for a segment a store still names (delete that store), and
    while a live process holds it open (``StoreLocked``); ``FileNotFoundError`` if there
    is none."""
    name = url.removeprefix("shm://").rstrip("/")
    found = [s for s in list_segments(DEFAULT_SHM_ROOT, sizes=True) if s.name == name]
    if not url.startswith("shm://") or not found:
        raise FileNotFoundError(f"no shm segment {url} in {DEFAULT_SHM_ROOT}")
    seg = found[0]
    if seg.store is not None and _orphan_reason(seg) is None:
        raise ConfigError(
            f"{url} is a tier of the store at {seg.store}: delete that store "
            f"(tiercheck rm {seg.store}), not its tier"
        )
    held = _still_held([seg.path])
    if held:
        raise StoreLocked(
            f"{url} is held open by process {held[os.path.realpath(seg.path)]}; nothing was deleted"
        )
    freed = seg.nbytes or 0 if dry_run else remove_segment(seg.path)
    return DestroyReport(url, (seg.path,), freed, (), (), dry_run)


_LOCK_FILE_RE = re.compile(r"^\.lock(\.rank[0-9]+)?$")


def _left_by_a_failed_open(path: Path) -> bool:
    """Whether the directory ``path`` holds the writer lock files an open takes before it
    writes ``tiercheck.toml`` (``.lock``, and ``.lock.rankN`` for the ranks of a job) and
    nothing else: what an open that failed before it made the store leaves behind."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError:
        return False
    return any(e.name == ".lock" for e in entries) and all(
        _LOCK_FILE_RE.match(e.name) and e.is_file(follow_symlinks=False) for e in entries
    )


def destroy_store(root: str | os.PathLike[str], *, dry_run: bool = False) -> DestroyReport:
    """Delete the store at ``root``: its shm segments, its LMDB environments and the root.

    Refuses with ``StoreLocked`` while a process holds the store open for writing, and
    holds the writer locks while it deletes, so no writer opens it meanwhile. Segments are
    found through the store's configuration (a ``{rank}`` matching ranks only) and through
    their owner records (which also finds the segments of a root that is already gone);
    a segment or an LMDB environment outside the root is deleted only if its owner record
    names this store (not another store, not the original of a copied root, not none),
    and ``StoreLocked`` is raised, nothing deleted, if another live process holds one
    open. Remote tiers (``file://`` outside the root, object stores) and peer daemons are
    left as they are and listed in ``kept``, as are segments and environments of other
    stores. ``dry_run`` reports and deletes nothing. ``FileNotFoundError`` if there is
    neither a store at ``root`` nor a segment it owns.

    A directory without ``tiercheck.toml`` is refused (``ConfigError``), unless it holds
    nothing but tiercheck's writer lock files (``.lock``, ``.lock.rankN``): that is what an
    open that failed (a bad tier URL, say) left, and it is deleted as a store with no
    tiers (with any segment recorded at the root), ``failed_open`` in the report.
    """
    path = Path(root).expanduser().resolve()
    config: StoreConfig | None = None
    config_path = path / CONFIG_NAME
    failed_open = False
    if path.exists() and not config_path.is_file():
        if not _left_by_a_failed_open(path):
            raise ConfigError(
                f"{path} is not a tiercheck store (no {CONFIG_NAME}); not deleting it"
            )
        failed_open = True
    lock = _writer_locks(path) if path.exists() else contextlib.nullcontext()
    with lock:
        if failed_open and not _left_by_a_failed_open(path):
            # an open made the store (or someone put a file there) before the lock was ours
            raise ConfigError(
                f"{path} changed while rm looked at it: no longer only the lock of an open "
                "that failed; nothing was deleted, look at it and run rm again"
            )
        if config_path.is_file():
            try:
                config = load_config(config_path)
            except ConfigError as exc:
                # its tiers (segments, LMDB environments outside the root) are named there
                raise ConfigError(f"{exc}; fix it, then delete the store again") from None
        specs = _resolved(config, path) if config is not None else []
        segments: dict[str, Segment] = {}
        kept: list[str] = []
        for shm_root in store_shm_roots(config):
            for seg in list_segments(shm_root):
                owner = StoreOwner.from_json(
                    {"store_id": seg.store_id, "root": seg.store, "host": seg.store_host}
                )
                if config is not None and _names_segment(specs, seg):
                    if _owns(owner, config, path):
                        segments[seg.path] = seg
                    else:
                        kept.append(f"shm segment {seg.path} (owned by {_describe(owner)})")
                elif (
                    seg.store is not None
                    and _same_path(seg.store, str(path))
                    and (config is None or config.store_id in (None, seg.store_id))
                ):
                    segments[seg.path] = seg  # recorded at this root (even a root now gone)
        lmdb: list[str] = []
        inner: list[str] = []  # LMDB environments inside the root: deleted with it
        for spec in specs:
            if spec.url.startswith("lmdb://"):
                for env in _lmdb_paths(spec):
                    if _inside(env, path):
                        inner.append(env)
                        continue
                    assert config is not None
                    owner = _owner_of_lmdb(f"lmdb://{env}")
                    if _owns(owner, config, path):
                        lmdb.append(env)
                    else:
                        kept.append(f"LMDB environment {env} (owned by {_describe(owner)})")
            elif spec.url.startswith(("shm://", "collective://", "memory://")) or (
                spec.url.startswith("file://") and _inside(urlsplit(spec.url).path, path)
            ):
                continue  # deleted above, with the root, or with the process
            else:
                kept.append(f"{spec.name} ({without_userinfo(spec.url)})")
        if not path.exists() and not segments:
            raise FileNotFoundError(f"no store at {path} and no shm segment it owns")
        # a reader (Checkpointer(root, read_only=True)) holds its LMDB environments open
        held = _still_held([*segments, *lmdb, *inner])
        if held:
            where, pid = next(iter(held.items()))
            raise StoreLocked(
                f"{where} is held open by process {pid}: stop it (or close its Checkpointer), "
                f"then delete the store {path}; nothing was deleted"
            )
        freed = sum(s.nbytes or 0 for s in segments.values())
        if not dry_run:
            for seg in segments.values():
                remove_segment(seg.path)
            for env in lmdb:
                for name in ("data.mdb", "lock.mdb"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(env, name))
                with contextlib.suppress(OSError):
                    os.rmdir(env)  # only if nothing else was in it
            if path.exists():
                shutil.rmtree(path)
    report = DestroyReport(
        root=str(path),
        segments=tuple(sorted(segments)),
        freed=freed,
        lmdb=tuple(lmdb),
        kept=tuple(kept),
        dry_run=dry_run,
        failed_open=failed_open,
    )
    if not dry_run:
        log.info("deleted store %s (%d shm segments, %d bytes)", path, len(segments), freed)
    return report


def _describe(owner: StoreOwner | None) -> str:
    if owner is None:
        return "no store: it records no owner"
    return f"store {owner.store_id or '(no id)'} at {owner.root}"


# --- adopting a copied root ---------------------------------------------------------


@dataclass(frozen=True)
class AdoptReport:
    """What :func:`adopt_store` changed: the root, its old and new store ids, the shm URLs
    it renamed (old -> new), the tiers now recorded as the new store's, and the tiers it
    left alone (outside the root: still owned by whoever owned them)."""

    root: str
    old_id: str | None
    new_id: str
    renamed: dict[str, str]
    claimed: tuple[str, ...]
    left: tuple[str, ...]


def _new_shm_url(url: str, new_id: str) -> str:
    """A new segment name for ``url`` (``shm://NAME``): a default name gets a new tag, any
    other name the new id's first digits; a ``{rank}`` after it is kept."""
    name = url[len("shm://") :].rstrip("/")
    tag = new_id[:12]
    match = re.match(r"^tiercheck-[0-9a-f]{12}(.*)$", name)
    if match:
        return f"shm://tiercheck-{tag}{match.group(1)}"
    head, sep, tail = name.partition("-{")
    return f"shm://{head}-{tag}{sep}{tail}"


def adopt_store(root: str | os.PathLike[str]) -> AdoptReport:
    """Make the store at ``root`` a store of its own (``tiercheck adopt ROOT``): for a copied
    root (``cp -r``, or a copied ``tiercheck.toml``), which otherwise opens read-only.

    Draws a new store id, gives its shm tiers new segment names (the original's segments
    stay the original's; the copy starts with empty shm), records the root, and records
    the new store as the owner of every tier inside the root (its copied LMDB and
    ``file://`` tiers: their versions become the new store's). Tiers outside the root are
    left to their owner: the next open refuses those the original owns (``ForeignTier``),
    so point them elsewhere, or declare them shared. ``StoreLocked`` while a process holds
    the store open for writing.
    """
    path = Path(root).expanduser().resolve()
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise ConfigError(f"{path} is not a tiercheck store (no {CONFIG_NAME})")
    with _writer_locks(path, then="adopt the copy"):
        config = load_config(config_path)
        new_id = new_store_id()
        renamed = {
            spec.url: _new_shm_url(spec.url, new_id)
            for spec in config.tiers
            if spec.url.startswith("shm://")
        }
        rewrite_store_file(config_path, store_id=new_id, root=str(path), urls=renamed)
        adopted = load_config(config_path)
        claimed: list[str] = []
        left: list[str] = []
        owner = StoreOwner(new_id, str(path), _this_host())
        for spec in _resolved(adopted, path):
            local = identity.local_path(spec.url)
            if local is None or not _inside(local, path):
                if not spec.url.startswith("shm://"):
                    left.append(f"{spec.name} ({without_userinfo(spec.url)})")
                continue
            if not os.path.exists(local):
                continue  # nothing there yet: the first open records the owner
            try:
                options = resolve_references(spec.options, tier=spec.name)
                tier = open_tier(spec.url, **options)
            except (TierError, ConfigError, OSError) as exc:
                left.append(f"{spec.name} ({without_userinfo(spec.url)}): cannot open it: {exc}")
                continue
            try:
                tier.write_owner(owner)
            finally:
                tier.close()
            claimed.append(f"{spec.name} ({without_userinfo(spec.url)})")
    log.info("%s is now store %s (was %s)", path, new_id, config.store_id)
    return AdoptReport(
        root=str(path),
        old_id=config.store_id,
        new_id=new_id,
        renamed=renamed,
        claimed=tuple(claimed),
        left=tuple(left),
    )
