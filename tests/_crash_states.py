"""Crash states of a file tree, in the manner of ALICE and CrashMonkey.

:class:`Recorder` stands in for a backend's ``_os`` (the module-level name through which
``backends/_fsspec/local.py`` and ``backends/_shm.py`` make every call that changes the file
system): each call is performed for real and, when it touches the tree under ``root``,
recorded as an :class:`Op` on model inodes. :func:`crash_states` then builds, from a
snapshot of the tree before recording and the recorded trace, the trees a crash could
leave, and :func:`materialize` writes one out.

The power-loss model is the weakest POSIX promises, not one file system's behaviour:

- a file's writes and truncations are durable once a later ``fsync`` of that file
  returned; after its last ``fsync`` any subset of them may be lost (a lost write reads
  as the bytes that were there, zeros past the old end) and any may be torn (only a
  prefix written, or its new bytes zeros);
- a directory's changes (a create, ``mkdir``, ``link``, ``unlink``, either side of a
  ``rename``) are durable once a later ``fsync`` of that directory returned; after it
  any prefix of them may persist (or, in a reordered state, any subset), independently
  of every other directory, so a ``rename`` is durable only after its directory's
  ``fsync`` and a file's name may persist without its unsynced data;
- what the snapshot holds is durable.

The process-crash model (a SIGKILLed writer on a live kernel, what tmpfs offers) keeps
every operation before the cut, in order, and may tear the one write the cut lands in.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# An entry change: (directory inode, name, inode it now names or None for removed).
Change = tuple[int, str, int | None]


@dataclass(frozen=True)
class Op:
    """One recorded operation on model inodes.

    ``kind``: ``entry`` (``changes`` to directories, ``what`` says which call), ``write``
    (``data`` at ``offset`` of file ``ino``), ``truncate`` (file ``ino`` to ``size``),
    ``fsync`` (of file or directory ``ino``) or ``mark`` (``what`` is a label the test put
    in the trace, e.g. "ack 3": no file system effect).
    """

    kind: str
    ino: int = -1
    changes: tuple[Change, ...] = ()
    offset: int = 0
    data: bytes = b""
    size: int = 0
    what: str = ""


@dataclass
class Tree:
    """A model file tree: directories map names to inodes, files hold bytes."""

    root: int
    dirs: dict[int, dict[str, int]] = field(default_factory=dict)
    files: dict[int, bytes] = field(default_factory=dict)

    def copy(self) -> Tree:
        return Tree(self.root, {d: dict(e) for d, e in self.dirs.items()}, dict(self.files))

    def key(self) -> bytes:
        """A digest of what :func:`materialize` would write (paths, kinds, contents)."""
        h = hashlib.blake2b(digest_size=16)
        for path, ino in sorted(self.walk()):
            h.update(path.encode() + b"\0")
            if ino in self.dirs:
                h.update(b"D")
            else:
                h.update(hashlib.blake2b(self.files.get(ino, b"")).digest())
        return h.digest()

    def walk(self) -> Iterator[tuple[str, int]]:
        """``(relative path, inode)`` of everything reachable from the root."""
        stack = [("", self.root)]
        while stack:
            prefix, d = stack.pop()
            for name, ino in self.dirs.get(d, {}).items():
                path = f"{prefix}{name}"
                yield path, ino
                if ino in self.dirs:
                    stack.append((f"{path}/", ino))


def snapshot(root: str) -> tuple[Tree, dict[tuple[int, int], int]]:
    """The tree under ``root`` as a model, and its real ``(st_dev, st_ino)`` -> model inode."""
    ids: dict[tuple[int, int], int] = {}
    st = os.stat(root)
    tree = Tree(root=0, dirs={0: {}})
    ids[(st.st_dev, st.st_ino)] = 0
    stack = [(root, 0)]
    while stack:
        path, d = stack.pop()
        for entry in os.scandir(path):
            est = entry.stat(follow_symlinks=False)
            real = (est.st_dev, est.st_ino)
            ino = ids.get(real)
            if ino is None:
                ino = ids[real] = len(ids)
                if stat.S_ISDIR(est.st_mode):
                    tree.dirs[ino] = {}
                    stack.append((entry.path, ino))
                else:
                    with open(entry.path, "rb") as f:
                        tree.files[ino] = f.read()
            tree.dirs[d][entry.name] = ino
    return tree, ids


class Recorder:
    """An ``os`` for a backend's ``_os``: performs each call and records those under
    ``root`` (see module doc). Thread-safe: a call and its record are one step, so the
    trace is the order the calls took effect in. ``hard_links=False`` answers ``link``
    with EPERM, as a file system without hard links does."""

    def __init__(self, root: str, *, hard_links: bool = True) -> None:
        self.root = os.path.realpath(root)
        self.hard_links = hard_links
        self.base, self._ids = snapshot(self.root)
        self.ops: list[Op] = []
        self._next = len(self._ids)
        self._fds: dict[int, list[int]] = {}  # fd -> [inode, position]
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)  # constants (O_CREAT, ...) and calls that change nothing

    # -- helpers --

    def _inside(self, path: str) -> bool:
        absolute = os.path.abspath(path)
        real = os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))
        return real == self.root or real.startswith(self.root + os.sep)

    def _ino(self, path: str) -> int:
        st = os.stat(path, follow_symlinks=False)
        return self._ids[(st.st_dev, st.st_ino)]

    def _new(self, path: str) -> int:
        st = os.stat(path, follow_symlinks=False)
        ino = self._ids[(st.st_dev, st.st_ino)] = self._next
        self._next += 1
        return ino

    def _where(self, path: str) -> tuple[int, str]:
        return self._ino(os.path.dirname(os.path.abspath(path))), os.path.basename(path)

    def mark(self, what: str) -> None:
        """Put a label (e.g. an acknowledgement) in the trace."""
        with self._lock:
            self.ops.append(Op("mark", what=what))

    # -- calls that create or name --

    def open(self, path: str, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        assert dir_fd is None
        with self._lock:
            if not self._inside(path):
                return os.open(path, flags, mode)
            existed = os.path.lexists(path)
            fd = os.open(path, flags, mode)
            if existed:
                ino = self._ino(path)
                if flags & os.O_TRUNC:
                    self.ops.append(Op("truncate", ino, size=0))
            else:
                ino = self._new(path)
                d, name = self._where(path)
                self.ops.append(Op("entry", changes=((d, name, ino),), what="create"))
            self._fds[fd] = [ino, 0]
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            os.close(fd)
            self._fds.pop(fd, None)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        with self._lock:
            os.mkdir(path, mode)
            if self._inside(path):
                ino = self._new(path)
                d, name = self._where(path)
                self.ops.append(Op("entry", changes=((d, name, ino),), what="mkdir"))

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        head = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(head):
            self.makedirs(head, mode, exist_ok=True)
        try:
            self.mkdir(path, mode)
        except FileExistsError:
            if not (exist_ok and os.path.isdir(path)):
                raise

    def _move(self, src: str, dst: str, real: Any, what: str) -> None:
        with self._lock:
            if not self._inside(dst):
                real(src, dst)
                return
            ino = self._ino(src)
            sd, sname = self._where(src)
            real(src, dst)
            dd, dname = self._where(dst)
            changes: tuple[Change, ...] = ((dd, dname, ino),)
            if what != "link":
                changes = ((sd, sname, None), *changes)
            self.ops.append(Op("entry", changes=changes, what=what))

    def rename(self, src: str, dst: str) -> None:
        self._move(src, dst, os.rename, "rename")

    def replace(self, src: str, dst: str) -> None:
        self._move(src, dst, os.replace, "rename")

    def link(self, src: str, dst: str) -> None:
        if not self.hard_links:
            raise OSError(errno.EPERM, "hard links not supported here", dst)
        self._move(src, dst, os.link, "link")

    def unlink(self, path: str) -> None:
        with self._lock:
            if not self._inside(path):
                os.unlink(path)
                return
            d, name = self._where(path)
            os.unlink(path)
            self.ops.append(Op("entry", changes=((d, name, None),), what="unlink"))

    # -- calls on descriptors --

    def writev(self, fd: int, buffers: Sequence[Any]) -> int:
        with self._lock:
            n = os.writev(fd, buffers)
            rec = self._fds.get(fd)
            if rec is not None:
                data = b"".join(bytes(b) for b in buffers)[:n]
                self.ops.append(Op("write", rec[0], offset=rec[1], data=data))
                rec[1] += n
            return n

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self._lock:
            n = os.pwrite(fd, data, offset)
            rec = self._fds.get(fd)
            if rec is not None:
                self.ops.append(Op("write", rec[0], offset=offset, data=bytes(data)[:n]))
            return n

    def ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            os.ftruncate(fd, size)
            rec = self._fds.get(fd)
            if rec is not None:
                self.ops.append(Op("truncate", rec[0], size=size))

    def fsync(self, fd: int) -> None:
        with self._lock:
            os.fsync(fd)
            rec = self._fds.get(fd)
            if rec is not None:
                self.ops.append(Op("fsync", rec[0]))

    fdatasync = fsync

    # -- checks --

    def check_trace(self) -> None:
        """Assert that replaying every recorded operation gives the live tree: nothing that
        changed it went around the recorder."""
        live, _ = snapshot(self.root)
        replayed = apply(self.base, self.ops, lambda i, op: True)
        assert replayed.key() == live.key(), "the tree changed outside the recorded calls"


def apply(base: Tree, ops: Sequence[Op], keep: Any) -> Tree:
    """``base`` with each op ``i`` for which ``keep(i, op)`` is true applied, in order.
    ``keep`` may return the op to apply instead (a torn write)."""
    tree = base.copy()
    for i, op in enumerate(ops):
        chosen = keep(i, op)
        if chosen is False or chosen is None:
            continue
        if isinstance(chosen, Op):
            op = chosen
        if op.kind == "entry":
            for d, name, ino in op.changes:
                entries = tree.dirs.setdefault(d, {})
                if ino is None:
                    entries.pop(name, None)
                else:
                    entries[name] = ino
                    if op.what == "mkdir":
                        tree.dirs.setdefault(ino, {})
        elif op.kind == "write":
            old = tree.files.get(op.ino, b"")
            end = op.offset + len(op.data)
            if len(old) < op.offset:
                old += bytes(op.offset - len(old))
            tree.files[op.ino] = old[: op.offset] + op.data + old[end:]
        elif op.kind == "truncate":
            old = tree.files.get(op.ino, b"")
            tree.files[op.ino] = old[: op.size] + bytes(max(0, op.size - len(old)))
    return tree


@dataclass(frozen=True)
class CrashState:
    """A tree a crash could leave: ``cut`` ops had been issued; ``variant`` names how the
    unsynced ones were chosen; ``acked`` is the last ``mark`` before the cut (or "")."""

    cut: int
    variant: str
    acked: str
    tree: Tree = field(repr=False)


def _units(ops: Sequence[Op], cut: int) -> tuple[dict[int, list[int]], set[int]]:
    """For the first ``cut`` ops: the unsynced units per inode (op indices, trace order)
    and the indices of ops that are durable (a later fsync of their inode covers them).
    An entry op that changes two directories is durable when both are synced; it is a
    unit of each."""
    last_sync: dict[int, int] = {}
    for i in range(cut):
        if ops[i].kind == "fsync":
            last_sync[ops[i].ino] = i
    pending: dict[int, list[int]] = {}
    durable: set[int] = set()
    for i in range(cut):
        op = ops[i]
        if op.kind == "entry":
            dirs = {d for d, _, _ in op.changes}
            if all(last_sync.get(d, -1) > i for d in dirs):
                durable.add(i)
            else:
                for d in dirs:
                    pending.setdefault(d, []).append(i)
        elif op.kind in ("write", "truncate"):
            if last_sync.get(op.ino, -1) > i:
                durable.add(i)
            else:
                pending.setdefault(op.ino, []).append(i)
    return pending, durable


def _torn(op: Op, rng: random.Random) -> Op:
    if op.kind != "write" or not op.data:
        return op
    if rng.random() < 0.5:  # the size got out, the data did not
        return Op("write", op.ino, offset=op.offset, data=bytes(len(op.data)))
    keep = rng.randrange(len(op.data))
    return Op("write", op.ino, offset=op.offset, data=op.data[:keep])


def power_loss_states(
    ops: Sequence[Op], base: Tree, *, seed: int, reorders: int
) -> list[CrashState]:
    """Distinct crash states after power loss (see module doc): at every cut just before an
    ``fsync``, a ``rename`` or a ``link`` (the barriers, and the commit points of a tier that
    never fsyncs), after a ``mark``, and at the end, the tree with nothing unsynced kept,
    with everything kept, and ``reorders`` seeded mixes (per directory a prefix or a subset
    of its unsynced changes, per file a subset of its unsynced writes, some torn)."""
    cuts = sorted(
        {i for i, op in enumerate(ops) if op.kind == "fsync" or op.what in ("rename", "link")}
        | {i + 1 for i, op in enumerate(ops) if op.kind == "mark"}
        | {len(ops)}
    )
    rng = random.Random(seed)
    seen: set[bytes] = set()  # tree and acknowledgement
    out: list[CrashState] = []
    for cut in cuts:
        acked = next((ops[i].what for i in range(cut - 1, -1, -1) if ops[i].kind == "mark"), "")
        pending, durable = _units(ops, cut)
        plans: list[tuple[str, Any]] = [
            ("synced", lambda i, op, d=durable: i in d),
            ("everything", lambda i, op, c=cut: i < c),
        ]
        for r in range(reorders):
            kept: dict[int, Op | bool] = dict.fromkeys(durable, True)
            sides: dict[int, set[int]] = {}  # entry op -> the directories that kept it
            reorder = r % 2 == 1
            for ino, units in pending.items():
                if reorder:
                    chosen = [u for u in units if rng.random() < 0.5]
                else:
                    chosen = units[: rng.randint(0, len(units))]
                for u in chosen:
                    if ops[u].kind == "entry":
                        sides.setdefault(u, set()).add(ino)
                    else:
                        kept[u] = _torn(ops[u], rng) if rng.random() < 0.3 else True
            for u, dirs in sides.items():
                # a rename across directories may persist on one side only
                changes = tuple(c for c in ops[u].changes if c[0] in dirs)
                kept[u] = Op("entry", changes=changes, what=ops[u].what)
            plans.append((f"{'reordered' if reorder else 'prefix'}-{r}", kept.get))
        for variant, keep in plans:
            tree = apply(base, ops[:cut], keep)
            k = tree.key() + acked.encode()  # the same tree owes more after an ack
            if k in seen:
                continue
            seen.add(k)
            out.append(CrashState(cut, variant, acked, tree))
    return out


def process_crash_states(ops: Sequence[Op], base: Tree, *, seed: int) -> list[CrashState]:
    """Distinct crash states after a SIGKILL: every prefix of the trace, and each write the
    cut lands in torn (a seeded prefix of it)."""
    rng = random.Random(seed)
    seen: set[bytes] = set()
    out: list[CrashState] = []
    tree = base.copy()
    acked = ""
    for cut in range(len(ops) + 1):
        if cut:
            op = ops[cut - 1]
            if op.kind == "mark":
                acked = op.what
            tree = apply(tree, [op], lambda i, o: True)
        candidates = [("prefix", tree)]
        if cut < len(ops) and ops[cut].kind == "write" and len(ops[cut].data) > 1:
            nxt = ops[cut]
            keep = rng.randrange(1, len(nxt.data))
            torn = Op("write", nxt.ino, offset=nxt.offset, data=nxt.data[:keep])
            candidates.append(("torn", apply(tree, [torn], lambda i, o: True)))
        for variant, t in candidates:
            k = t.key() + acked.encode()
            if k not in seen:
                seen.add(k)
                out.append(CrashState(cut, variant, acked, t))
    return out


def materialize(tree: Tree, target: str) -> None:
    """Write ``tree`` under the empty directory ``target`` (hard links stay hard links)."""
    first: dict[int, str] = {}
    for rel, ino in sorted(tree.walk()):
        path = os.path.join(target, rel)
        if ino in tree.dirs:
            os.mkdir(path)
        elif ino in first:
            os.link(first[ino], path)
        else:
            first[ino] = path
            with open(path, "wb") as f:
                f.write(tree.files.get(ino, b""))
