"""Restore's safety net: :class:`Undo` keeps what a load will overwrite and puts it back.

A restore is all or nothing for the caller's state (issue 21): nothing of it changes until
every chunk of the version has been read and verified, and if loading it then fails (a
``load_state_dict`` that raises, a leaf that cannot be decoded, a replay that breaks),
everything the load wrote is put back as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercheck.core.sharded import is_dtensor
from tiercheck.errors import StateError, TiercheckError

if TYPE_CHECKING:
    from tiercheck.restore.binding import Binding

__all__ = ["Undo"]


def _local(t: Any) -> Any:
    """The tensor holding a tensor's bytes here: a DTensor's local piece, else itself."""
    return t._local_tensor if is_dtensor(t) else t


class Undo:
    """What a restore is about to change in the caller's state, kept so that a restore
    that fails can put it all back (issue 21): the restore is all or nothing.

    Why a snapshot and not a dry run into fresh objects: the caller's modules and
    optimizers cannot be copied cheaply or faithfully (an optimizer refers to the model's
    parameters, a module *is* the model), and ``load_state_dict`` is the object's own
    code: it may raise after changing part of the object (``nn.Module`` copies every
    parameter that fits before it raises for one that does not), and some read the values
    when called (an RNG state), so the values cannot be loaded later than the call. So
    what will be written is kept before anything is: the bytes of every caller tensor and
    array the restore writes or an object's ``state_dict()`` holds (once per piece of
    memory, a CUDA tensor's in host memory), every object's ``state_dict()`` as a tree of
    fresh containers whose tensors are those same caller tensors, and each container of
    the state before a member of it is replaced. The copies are made before the first byte
    is written: :meth:`keep` makes them on the I/O pool while the version's chunks are
    still being fetched, and :meth:`on_failure` waits for them before letting the load
    begin (a CUDA tensor's copy stays on its device where there is memory for it, else
    goes to host memory). A success throws them away.

    Only what can still fail is copied: the tensors of stateful objects and of fresh
    values copied in place while the tree is put together, not the binding's loose
    entries (a caller's tensor or array outside every stateful object, or held by a
    module or optimizer that loads by reference, written straight from the verified
    stream). Those are written last, after every ``load_state_dict`` and leaf decoding
    succeeded, and nothing after them can fail: a plain dict of tensors, or a model and
    its optimizer, is restored with no copy of the state at all. An object that loads by
    reference is given its own tensors, not yet written (:func:`~tiercheck.restore.
    binding.loads_by_reference`); if its load kept copies of them after all
    (:func:`~tiercheck.restore.loading.copied_on_load`), :meth:`late` keeps their bytes
    before they are written and it is loaded again. A log version
    (``keep_all``) copies everything its entries write: its replay runs after the base's
    entries were written, and may break.

    :meth:`rollback`, in reverse: the kept bytes are copied back into the same tensors
    (identities kept), containers get their members back, gradients the replay replaced
    are put back, then each object whose ``load_state_dict`` ran (or the replay stepped)
    is compared with what it was and, if it differs, given ``load_state_dict`` of its kept
    ``state_dict()``, whose tensors are its own again, and compared once more. What still
    differs is reported, never passed over.
    """

    def __init__(self, *, keep_all: bool = False) -> None:
        self.keep_all = keep_all
        self._tensors: dict[tuple[Any, ...], Any] = {}  # memory -> the live tensor or array
        self._kept: dict[tuple[Any, ...], Any] = {}  # memory -> its copy
        self._copying: dict[tuple[Any, ...], Future[Any]] = {}
        self._objects: dict[int, tuple[str, Any, Any]] = {}  # id -> (key, object, kept sd)
        self._touched: dict[int, Any] = {}  # id -> object whose load_state_dict may have run
        self._containers: list[tuple[dict[Any, Any] | list[Any], Any]] = []
        self._grads: list[tuple[Any, Any]] = []  # (parameter, its .grad before)

    # --- before anything is written ------------------------------------------------------

    def cover(self, binding: Binding) -> None:
        """Keep everything a load of ``binding`` can write (call before the first byte is):
        an object that loads by reference (``binding.by_reference``) keeps its tree but not
        its tensors' bytes, which are written last, like the loose entries."""
        for node_id, (key, obj) in binding.objects.items():
            by_reference = not self.keep_all and node_id in binding.by_reference
            self.object(key, obj, binding.stateful.get(node_id), keep_bytes=not by_reference)
        for i, target in binding.targets.items():
            if self.keep_all or i not in binding.loose:
                self.tensor(target)
        for piece in binding.pieces:
            self.tensor(piece.dest)

    def object(
        self, key: str, obj: Any, sd: Mapping[str, Any] | None = None, *, keep_bytes: bool = True
    ) -> None:
        """Keep ``obj``'s state (``sd``: its ``state_dict()`` taken now, if already taken);
        with ``keep_bytes=False`` its tree only, its tensors' bytes left to the caller."""
        if id(obj) in self._objects:
            return
        current = obj.state_dict() if sd is None else sd
        self._objects[id(obj)] = (key, obj, self._tree(current, keep_bytes))

    def tensor(self, t: Any) -> None:
        """Keep the bytes of a caller tensor or array the restore may write (copied by
        :meth:`keep`, or by :meth:`ready` at the latest)."""
        import torch

        if isinstance(t, np.ndarray):
            if t.size and t.flags.writeable:
                where = t.__array_interface__["data"][0]
                k: tuple[Any, ...] = ("ndarray", where, t.shape, t.strides, t.dtype.str)
                self._tensors.setdefault(k, t)
            return
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        if not t.numel() or t.is_meta or t.layout != torch.strided:
            return
        where = t.untyped_storage().data_ptr()
        self._tensors.setdefault(
            (t.device, where, t.storage_offset(), t.shape, t.stride(), t.dtype), t
        )

    def keep(self, pool: Executor) -> None:
        """Start copying, on ``pool``, every tensor noted so far and not copied yet."""
        for k, t in self._tensors.items():
            if k not in self._kept and k not in self._copying:
                self._copying[k] = pool.submit(_copy_of, t)

    def ready(self) -> None:
        """Wait until every noted tensor is copied (copying the rest here). Raises
        :class:`~tiercheck.errors.StateError` if a copy cannot be made (out of memory,
        say): then nothing has been written."""
        try:
            for k, t in self._tensors.items():
                if k in self._kept:
                    continue
                copying = self._copying.pop(k, None)
                self._kept[k] = copying.result() if copying is not None else _copy_of(t)
        except Exception as exc:
            self.discard()
            raise StateError(
                f"could not keep a copy of the state to put back should the restore fail "
                f"({type(exc).__name__}: {exc}); nothing of the state was written"
            ) from exc

    def late(self, tensors: Iterable[Any]) -> None:
        """Keep the bytes of ``tensors`` now, on this thread, while loading: those of an
        object that was to load by reference but kept copies (they are written before its
        ``load_state_dict`` runs again). A copy that cannot be made raises, the copies
        kept so far intact, so that the load's rollback puts everything back."""
        for t in tensors:
            self.tensor(t)
        for k, t in self._tensors.items():
            if k not in self._kept and k not in self._copying:
                self._kept[k] = _copy_of(t)

    def discard(self) -> None:
        """Drop the copies (the restore did not get to load: nothing to put back)."""
        for copying in self._copying.values():
            copying.cancel()
        self._copying.clear()
        self._kept.clear()

    def grads(self, params: Sequence[Any]) -> None:
        """Keep which ``.grad`` each parameter has (the replay sets and clears them)."""
        self._grads.extend((p, p.grad) for p in params)

    def _tree(self, value: Any, keep_bytes: bool = True) -> Any:
        """A copy of a ``state_dict()``'s containers whose tensors are the same objects,
        their bytes kept unless not ``keep_bytes`` (a dict keeps its type and attributes:
        a module's ``_metadata``)."""
        import torch

        if isinstance(value, (torch.Tensor, np.ndarray)):
            if keep_bytes:
                self.tensor(value)
            return value
        if isinstance(value, dict):
            try:
                out = copy.copy(value)
            except Exception:
                out = dict(value)
            for k in list(out):
                out[k] = self._tree(out[k], keep_bytes)
            return out
        if isinstance(value, list):
            return [self._tree(v, keep_bytes) for v in value]
        if isinstance(value, tuple):
            items = [self._tree(v, keep_bytes) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, (set, bytearray)):
            return copy.copy(value)
        return value

    # --- while loading ---------------------------------------------------------------------

    def container(self, c: dict[Any, Any] | list[Any]) -> None:
        """``c`` is about to have members replaced."""
        self._containers.append((c, dict(c) if isinstance(c, dict) else list(c)))

    def touched(self, obj: Any) -> None:
        """``obj.load_state_dict`` (or a replayed step) is about to change ``obj``."""
        self._touched[id(obj)] = obj

    # --- on failure --------------------------------------------------------------------------

    def rollback(self) -> list[str]:
        """Put the state back as it was; return what could not be put back (empty: all)."""
        import torch

        problems: list[str] = []
        with torch.no_grad():
            for k, live in self._tensors.items():
                kept = self._kept.get(k)
                try:
                    if kept is None:
                        raise StateError("its bytes were not kept before the restore")
                    if isinstance(live, np.ndarray):
                        np.copyto(live, kept)
                    else:
                        live.detach().copy_(kept)
                except Exception as exc:
                    problems.append(f"a {tuple(live.shape)} tensor: {exc}")
        for c, members in reversed(self._containers):
            if isinstance(c, dict):
                c.clear()
                c.update(members)
            else:
                c[:] = members
        for p, grad in reversed(self._grads):
            p.grad = grad
        for obj_id, obj in reversed(self._touched.items()):
            key, _, kept = self._objects.get(obj_id, (type(obj).__qualname__, obj, None))
            try:
                if kept is None:
                    raise StateError("its state was not kept before the restore")
                if _same(obj.state_dict(), kept):
                    continue
                try:
                    obj.load_state_dict(kept)
                except Exception:
                    if not _same(obj.state_dict(), kept):
                        raise
                if not _same(obj.state_dict(), kept):
                    raise StateError(
                        "load_state_dict of its state before the restore did not give "
                        "that state back"
                    )
            except Exception as exc:
                problems.append(f"{key or 'the state'}: {type(exc).__name__}: {exc}")
        return problems

    @contextmanager
    def on_failure(self, what: str) -> Iterator[None]:
        """Roll back if the block raises; then raise a typed error saying what failed:
        a :class:`~tiercheck.errors.TiercheckError` as it is, anything else as a
        :class:`~tiercheck.errors.StateError`. If something could not be put back, a
        :class:`StateError` names it (the state is then partly restored). Waits for the
        copies first (:meth:`ready`)."""
        self.ready()
        try:
            yield
        except BaseException as exc:
            problems = self.rollback()
            key = exc.key if isinstance(exc, StateError) else ""
            if problems:
                raise StateError(
                    f"{what} failed ({type(exc).__name__}: {exc}), and putting the state "
                    f"back failed too for {'; '.join(problems)}: the state is partly "
                    "restored; restore again (or rebuild it) before training on",
                    key=key,
                ) from exc
            if isinstance(exc, TiercheckError):
                exc.add_note(f"{what} failed; the state was left as it was before restore()")
                raise
            if isinstance(exc, Exception):
                raise StateError(
                    f"{what} failed ({type(exc).__name__}: {exc}); the state was left as "
                    "it was before restore()"
                ) from exc
            raise


def _copy_of(t: Any) -> Any:
    """A copy of a tensor's or array's bytes: on the tensor's own device where there is
    memory for it (a device-to-device copy, far faster than to the host), else in host
    memory."""
    import torch

    if isinstance(t, np.ndarray):
        return t.copy()
    if t.device.type == "cpu":
        return t.detach().clone()
    try:
        return t.detach().clone()
    except torch.OutOfMemoryError:
        return t.detach().to("cpu")


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values, tensors compared bit for bit."""
    import torch

    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = _local(a), _local(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.device == b.device and (
            a.untyped_storage().data_ptr(),
            a.storage_offset(),
            a.stride(),
        ) == (b.untyped_storage().data_ptr(), b.storage_offset(), b.stride()):
            return True

        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

        return bool(torch.equal(raw(a), raw(b)))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return bool(b != b)
    try:
        return bool(a == b)
    except Exception:
        return False
