"""The few primitives the fsspec tier needs of a file system (:class:`Store`), one
implementation per kind of file system: :mod:`.local` (a POSIX file system through ``os``,
with fsync) and :mod:`.remote` (any fsspec file system, object stores included)."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence

from tiercheck.backends._packs import PackUpload
from tiercheck.backends.base import scatter

__all__ = ["Store"]


class Store(abc.ABC):
    """Byte objects addressed by '/'-separated paths relative to nothing (absolute keys)."""

    #: whether :meth:`create` is atomic against a concurrent writer
    exclusive_create: bool

    @abc.abstractmethod
    def put(self, path: str, parts: Sequence[memoryview], *, if_absent: bool) -> bool:
        """Write the concatenation of ``parts`` to ``path`` atomically; with ``if_absent``,
        return False if it exists.

        ``if_absent`` may race (both writers write): fine for content-addressed blobs.
        """

    def put_object(self, path: str, parts: Sequence[memoryview]) -> None:
        """Write a new, uniquely named object (a pack) atomically; large ones as fast as
        the store allows. Default: :meth:`put`."""
        self.put(path, parts, if_absent=True)

    def open_upload(self, path: str) -> PackUpload | None:
        """An object streamed while it is written (see ``PackUpload``), or None where
        the store cannot (then a pack is written whole by :meth:`put_object`)."""
        return None

    @abc.abstractmethod
    def create(self, path: str, data: memoryview) -> None:
        """Write ``path`` only if absent; raise ``FileExistsError`` if it exists."""

    def sync(self) -> None:  # noqa: B027 - a PUT to an object store is durable on return
        """Make the names of every ``put`` so far durable (called before a log record)."""

    @abc.abstractmethod
    def read(self, path: str, out: memoryview | None) -> memoryview:
        """The bytes of ``path`` (into ``out`` if given); ``FileNotFoundError`` if absent."""

    def read_parts(self, path: str, parts: Sequence[memoryview]) -> int:
        """Read ``path`` scattered over ``parts`` (see ``Tier.get_parts``); its size."""
        return scatter(self.read(path, None), parts)

    @abc.abstractmethod
    def read_range(self, path: str, start: int, parts: Sequence[memoryview]) -> int:
        """Fill ``parts`` from byte ``start`` of ``path`` (one ranged read); the bytes read
        (fewer if the object ends first). ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def sizes(self, directory: str) -> dict[str, int]:
        """Base name -> size of the files directly in ``directory`` ({} if it is missing)."""

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        """The bytes of each path, None for one that vanished."""
        result: list[bytes | None] = []
        for path in paths:
            try:
                result.append(bytes(self.read(path, None)))
            except FileNotFoundError:
                result.append(None)
        return result

    def head(self, path: str, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes of ``path``; ``FileNotFoundError`` if absent."""
        return bytes(self.read(path, None)[:nbytes])

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of ``path``; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def mtime(self, path: str) -> float | None:
        """When ``path`` was last written (seconds since the epoch), None where the store
        does not say; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def exists_many(self, paths: Sequence[str]) -> list[bool]:
        """Whether each path exists."""

    @abc.abstractmethod
    def remove_many(self, paths: Sequence[str]) -> None:
        """Remove paths (that were just seen present); absent ones are ignored."""

    @abc.abstractmethod
    def names(self, directory: str) -> list[str]:
        """Base names of the files directly in ``directory`` ([] if it does not exist)."""

    @abc.abstractmethod
    def files_below(self, directory: str) -> Iterator[str]:
        """Paths, relative to ``directory``, of every file below it."""
