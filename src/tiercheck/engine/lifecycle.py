"""Store lifecycle: deleting a store with the node memory it holds, and finding orphans.

A store's shm tier lives in /dev/shm, outside the store root, so deleting the root alone
would leave the segment behind for good. Every shm segment records its owner (the store
root, the node, the creating process and time: ``owner.json``, written by the shm tier
and :meth:`~tiercheck.backends.base.Tier.bind_store`), which lets this module:

- :func:`destroy_store` (``tiercheck rm ROOT``, ``Checkpointer.destroy()``): delete a
  store, its shm segments and its LMDB environments, refusing while a writer holds the
  store's lock;
- :func:`find_orphans` (``tiercheck gc --orphans``): find the segments of this node whose
  store is gone (no ``tiercheck.toml`` at the root any more) or no longer names them (a
  store created again at the same path gets a new segment name);
- :func:`warn_orphans`: log one warning per process and shm root when a store is opened
  next to orphans (a listing of small files; the segments are not measured).

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tiercheck.backends import DEFAULT_SHM_ROOT, Segment, list_segments, remove_segment
from tiercheck.engine.config import CONFIG_NAME, StoreConfig, TierSpec, load_config
from tiercheck.errors import ConfigError, StoreLocked

__all__ = [
    "DestroyReport",
    "Orphan",
    "destroy_store",
    "find_orphans",
    "remove_orphans",
    "shm_root_left_as_found",
    "store_shm_roots",
    "warn_orphans",
]

log = logging.getLogger(__name__)

_PLACEHOLDER = re.compile(r"\\\{(rank|local_rank|node|src)\\\}")


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
    peer daemons), each with its URL, so the user can decide.
    """

    root: str
    segments: tuple[str, ...]
    freed: int
    lmdb: tuple[str, ...]
    kept: tuple[str, ...]
    dry_run: bool


def _this_host() -> str:
    return socket.gethostname()


def _name_pattern(template: str) -> re.Pattern[str]:
    """A regex for segment names made from ``template`` (``{rank}`` etc. match any)."""
    return re.compile("^" + _PLACEHOLDER.sub(r"[^/]+", re.escape(template)) + "$")


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


def _names_segment(config: StoreConfig, seg: Segment) -> bool:
    for spec in config.tiers:
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


def _orphan_reason(seg: Segment) -> str | None:
    """Why ``seg`` is an orphan, or None if its store still uses it (or cannot tell)."""
    if seg.store is None:
        return None
    if (seg.store_host or seg.host or _this_host()) != _this_host():
        return None  # its store is on another node: only that node can tell
    config_path = Path(seg.store) / CONFIG_NAME
    if not config_path.exists():
        return f"its store {seg.store} is gone (no {CONFIG_NAME})"
    try:
        config = load_config(config_path)
    except ConfigError:
        return None  # unreadable right now: never guess toward deleting
    if not _names_segment(config, seg):
        return f"its store {seg.store} no longer names it"
    return None


def find_orphans(
    shm_roots: Iterable[str | os.PathLike[str]] = (DEFAULT_SHM_ROOT,), *, sizes: bool = True
) -> list[Orphan]:
    """Segments under ``shm_roots`` created on this node whose store is gone."""
    orphans = []
    for root in dict.fromkeys(os.fspath(r) for r in shm_roots):
        for seg in list_segments(root, sizes=sizes):
            reason = _orphan_reason(seg)
            if reason is not None:
                orphans.append(Orphan(seg, reason))
    return orphans


def remove_orphans(orphans: Iterable[Orphan]) -> int:
    """Delete the orphans' segments (each judged again first); returns the bytes freed."""
    freed = 0
    for orphan in orphans:
        seg = orphan.segment
        fresh = [s for s in list_segments(seg.root, sizes=False) if s.path == seg.path]
        if fresh and _orphan_reason(fresh[0]) is not None:
            freed += remove_segment(seg.path)
            log.info("removed orphaned shm segment %s (%s)", seg.path, orphan.reason)
    return freed


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_orphans(shm_roots: Iterable[str | os.PathLike[str]] = (DEFAULT_SHM_ROOT,)) -> None:
    """Log a warning about orphaned segments under each root, once per process and root."""
    fresh = []
    with _warned_lock:
        for root in shm_roots:
            key = os.path.realpath(root)
            if key not in _warned:
                _warned.add(key)
                fresh.append(os.fspath(root))
    if not fresh:
        return
    try:
        orphans = find_orphans(fresh, sizes=False)
    except OSError as exc:  # a scan must never stop a store from opening
        log.debug("orphan scan failed: %s", exc)
        return
    if orphans:
        log.warning(
            "%d shm segment(s) of deleted stores hold memory on this node (%s); "
            "run `tiercheck gc --orphans --yes` to free them",
            len(orphans),
            ", ".join(o.segment.path for o in orphans[:3]) + (", ..." if len(orphans) > 3 else ""),
        )


# --- destroying a store -------------------------------------------------------------


@contextlib.contextmanager
def _writer_locks(root: Path) -> Iterator[None]:
    """Hold every writer lock of the store at ``root`` (``.lock``, ``.lock.rankN``);
    ``StoreLocked`` if a process holds one."""
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
                    "close that Checkpointer or stop the process, then delete the store"
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


def destroy_store(root: str | os.PathLike[str], *, dry_run: bool = False) -> DestroyReport:
    """Delete the store at ``root``: its shm segments, its LMDB environments and the root.

    Refuses with ``StoreLocked`` while a process holds the store open for writing, and
    holds the writer locks while it deletes, so no writer opens it meanwhile. Segments are
    found through the store's configuration and through their owner records (which also
    finds the segments of a root that is already gone). Remote tiers (``file://`` outside
    the root, object stores) and peer daemons are left as they are and listed in
    ``kept``. ``dry_run`` reports and deletes nothing. ``FileNotFoundError`` if there is
    neither a store at ``root`` nor a segment it owns.
    """
    path = Path(root).expanduser().resolve()
    config: StoreConfig | None = None
    config_path = path / CONFIG_NAME
    if path.exists() and not config_path.is_file():
        raise ConfigError(f"{path} is not a tiercheck store (no {CONFIG_NAME}); not deleting it")
    lock = _writer_locks(path) if path.exists() else contextlib.nullcontext()
    with lock:
        if config_path.is_file():
            config = load_config(config_path)
        segments: dict[str, Segment] = {}
        for shm_root in store_shm_roots(config):
            for seg in list_segments(shm_root):
                named = config is not None and _names_segment(config, seg)
                if named or (seg.store is not None and _same_path(seg.store, str(path))):
                    segments[seg.path] = seg
        lmdb: list[str] = []
        kept: list[str] = []
        for spec in config.tiers if config is not None else ():
            if spec.url.startswith("lmdb://"):
                lmdb += [p for p in _lmdb_paths(spec) if not _inside(p, path)]
            elif spec.url.startswith(("shm://", "collective://", "memory://")) or (
                spec.url.startswith("file://") and _inside(urlsplit(spec.url).path, path)
            ):
                continue  # deleted above, with the root, or with the process
            else:
                kept.append(f"{spec.name} ({spec.url})")
        if not path.exists() and not segments:
            raise FileNotFoundError(f"no store at {path} and no shm segment it owns")
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
    )
    if not dry_run:
        log.info("deleted store %s (%d shm segments, %d bytes)", path, len(segments), freed)
    return report
