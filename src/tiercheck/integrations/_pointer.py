"""Pointer files: a trainer's checkpoint path that names a tiercheck version.

A framework keeps deciding *where* checkpoints are (``last.ckpt``, ``epoch=3-step=120.ckpt``,
``checkpoint-500/``), lists them, picks the newest and deletes old ones by those paths;
tiercheck holds the state. At such a path it writes a small JSON document naming the store
root and the version::

    {"format": "tiercheck-pointer", "v": 1, "root": "/abs/ckpt", "version": 12, "step": 480}

A pointer is written only after its version is committed, atomically (a temporary file
renamed over the path on a local file system; one object put elsewhere), so a path that
exists always names a version that was committed.

A pointer at a path a framework may hand to ``torch.load`` (Lightning's
``load_from_checkpoint``) starts with a guard (``write_pointer(..., guard=True)``): a few
bytes of pickle that make ``torch.load`` fail, with ``weights_only`` True or False, with an
error naming :func:`tiercheck.integrations.lightning.load`, instead of torch's hint to
retry unsafely. The guard calls only ``_codecs.encode`` (one of the globals
``weights_only=True`` allows) with the message as the name of the encoding, so torch
raises ``LookupError: unknown encoding: <the message>`` and runs nothing else. The JSON
document follows the guard; :func:`read_pointer` reads both forms.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec

from tiercheck.errors import StateError

__all__ = ["POINTER_FORMAT", "Pointer", "is_local", "read_pointer", "write_pointer"]

POINTER_FORMAT = "tiercheck-pointer"
_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class Pointer:
    """A committed version of the store at ``root``."""

    root: str
    version: int
    step: int

    def to_json(self) -> bytes:
        doc = {
            "format": POINTER_FORMAT,
            "v": 1,
            "root": self.root,
            "version": self.version,
            "step": self.step,
        }
        return (json.dumps(doc) + "\n").encode()

    def torch_message(self) -> str:
        """What ``torch.load`` of a guarded pointer to this version says."""
        return (
            f"\n\nthis file is a tiercheck pointer to version {self.version} (step {self.step}) "
            f"of the store at {self.root}, not a torch checkpoint: read it with "
            "tiercheck.integrations.lightning.load(path), which returns the checkpoint dict "
            "(e.g. model.load_state_dict(load(path)['state_dict'])), or resume with "
            "trainer.fit(model, ckpt_path=path) and TiercheckIO"
        )


#: the guard's opening: pickle protocol 2, then the global ``_codecs.encode``
_GUARD = b"\x80\x02c_codecs\nencode\n"
#: the guard's end: the two arguments as a tuple, the call, the end of the pickle
_GUARD_END = b"\x86R."


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # pickle's BINUNICODE


def _guard(pointer: Pointer) -> bytes:
    return _GUARD + _unicode("") + _unicode(pointer.torch_message()) + _GUARD_END + b"\n"


def _after_guard(head: bytes) -> bytes | None:
    """The bytes after the guard that ``head`` starts with (None: not a guard)."""
    at = len(_GUARD)
    for _ in range(2):
        if head[at : at + 1] != b"X" or len(head) < at + 5:
            return None
        (n,) = struct.unpack("<I", head[at + 1 : at + 5])
        at += 5 + n
    if head[at : at + len(_GUARD_END)] != _GUARD_END:
        return None
    return head[at + len(_GUARD_END) :]


def is_local(path: str | os.PathLike[str]) -> bool:
    """True for a plain path or a ``file://`` URL."""
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def write_pointer(path: str | os.PathLike[str], pointer: Pointer, *, guard: bool = False) -> None:
    """Write ``pointer`` at ``path`` (a local path or an fsspec URL), replacing any file.

    ``guard``: start it with the guard against ``torch.load`` (module docstring), for a
    path a framework may hand to ``torch.load``."""
    data = (_guard(pointer) if guard else b"") + pointer.to_json()
    text = os.fspath(path)
    if is_local(text):
        target = Path(text.removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return
    fs, fs_path = fsspec.core.url_to_fs(text)
    fs.makedirs(fs.sep.join(fs_path.split(fs.sep)[:-1]) or fs.sep, exist_ok=True)
    fs.pipe_file(fs_path, data)  # one object put: readers see all of it or nothing


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer at ``path``; None if the file there is something else (a torch file).

    Raises FileNotFoundError if there is no file, StateError for a damaged pointer.
    """
    fs, fs_path = fsspec.core.url_to_fs(os.fspath(path))
    with fs.open(fs_path, "rb") as f:
        head = f.read(_MAX_BYTES + 1)
    if head.startswith(_GUARD):
        head = _after_guard(head) or b""
    if not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    if doc.get("v") != 1:
        raise StateError(f"{path}: tiercheck pointer version {doc.get('v')!r} is not supported")
    root, version, step = doc.get("root"), doc.get("version"), doc.get("step")
    if not (isinstance(root, str) and isinstance(version, int) and isinstance(step, int)):
        raise StateError(f"{path}: malformed tiercheck pointer {doc!r}")
    return Pointer(root, version, step)
