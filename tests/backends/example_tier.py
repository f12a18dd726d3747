"""``sqlite:///abs/path.db``: an example third-party tier keeping blobs and log in one SQLite file.

It is the tier shown in full in docs/writing-a-tier.md and is proven by the conformance
suite in tests/backends/test_example_tier.py. Only the standard library and tiercheck.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from tiercheck import Capabilities, FailureDomain, Tier, register_tier
from tiercheck.backends.base import Buffer, check_blob_id, invalid_url
from tiercheck.errors import NotFound, TierError, TierFull, TierUnavailable

__all__ = ["SqliteTier"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (id TEXT PRIMARY KEY, data BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS log (seq INTEGER PRIMARY KEY AUTOINCREMENT, record BLOB NOT NULL);
"""


class SqliteTier(Tier):
    """Blobs and log in one SQLite database. Thread-safe (one connection behind a lock)."""

    scheme: ClassVar[str] = "sqlite"

    def __init__(self, url: str, *, read_only: bool = False, **options: Any) -> None:
        if options:
            raise invalid_url(url, f"unknown options for sqlite://: {sorted(options)}")
        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or any(c in path for c in "?#"):
            raise invalid_url(url, "expected sqlite:///absolute/path.db")
        super().__init__(
            url,
            capabilities=Capabilities(
                survives=FailureDomain.PROCESS,  # a local file: lost with the node
                shared=False,
                persistent=True,
                speed_rank=35,
                atomic_batch=True,  # blobs and record of an append share one transaction
            ),
            read_only=read_only,
        )
        self._lock = threading.Lock()
        try:
            if read_only:
                self._db = sqlite3.connect(
                    f"file:{path}?mode=ro", uri=True, check_same_thread=False
                )
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._db = sqlite3.connect(path, check_same_thread=False)
                self._db.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
                self._db.execute("PRAGMA synchronous=FULL")  # a commit is durable when it returns
                self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise invalid_url(url, f"cannot open the database: {exc}") from exc

    def _error(self, exc: sqlite3.Error, key: str = "") -> TierError:
        """Classify a SQLite error into tiercheck's typed errors."""
        code = getattr(exc, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL:
            return TierFull(f"database full: {exc}", url=self.url, key=key)
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return TierUnavailable(f"database busy: {exc}", url=self.url, key=key)
        return TierError(f"sqlite error: {exc}", url=self.url, key=key)

    # --- blobs ---------------------------------------------------------------------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        check_blob_id(blob_id, self.url)
        self._check_writable("put")
        verb = "INSERT OR REPLACE" if overwrite else "INSERT OR IGNORE"
        try:
            with self._lock, self._db:  # one transaction, committed on exit
                cur = self._db.execute(f"{verb} INTO blobs VALUES (?, ?)", (blob_id, bytes(data)))
        except sqlite3.Error as exc:
            raise self._error(exc, blob_id) from exc
        return cur.rowcount > 0

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        check_blob_id(blob_id, self.url)
        with self._lock:
            row = self._db.execute("SELECT data FROM blobs WHERE id = ?", (blob_id,)).fetchone()
        if row is None:
            raise NotFound("blob not found", url=self.url, key=blob_id)
        data: bytes = row[0]
        return self._copy_out(data, out, self.url, blob_id)

    def size(self, blob_id: str) -> int:
        check_blob_id(blob_id, self.url)
        with self._lock:
            sql = "SELECT length(data) FROM blobs WHERE id = ?"
            row = self._db.execute(sql, (blob_id,)).fetchone()
        if row is None:
            raise NotFound("blob not found", url=self.url, key=blob_id)
        return int(row[0])

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        ids = list(blob_ids)
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        with self._lock:
            return {
                blob_id
                for blob_id in ids
                if self._db.execute("SELECT 1 FROM blobs WHERE id = ?", (blob_id,)).fetchone()
            }

    def delete(self, blob_ids: Iterable[str]) -> int:
        ids = list(dict.fromkeys(blob_ids))
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        self._check_writable("delete")
        removed = 0
        try:
            with self._lock, self._db:
                for blob_id in ids:
                    removed += self._db.execute(
                        "DELETE FROM blobs WHERE id = ?", (blob_id,)
                    ).rowcount
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        return removed

    # --- log -----------------------------------------------------------------------

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        items = [(blob_id, bytes(data)) for blob_id, data in blobs]
        for blob_id, _ in items:
            check_blob_id(blob_id, self.url)
        self._check_writable("append")
        try:
            with self._lock, self._db:  # blobs and record commit together, or not at all
                self._db.executemany("INSERT OR IGNORE INTO blobs VALUES (?, ?)", items)
                self._db.execute("INSERT INTO log (record) VALUES (?)", (bytes(record),))
        except sqlite3.Error as exc:
            raise self._error(exc) from exc

    def read_log(self) -> list[bytes]:
        with self._lock:
            rows = self._db.execute("SELECT record FROM log ORDER BY seq").fetchall()
        return [bytes(row[0]) for row in rows]

    # --- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # Last in the class: a method named ``list`` shadows the builtin in later annotations.
    def list(self) -> Iterator[str]:
        with self._lock:
            rows = self._db.execute("SELECT id FROM blobs").fetchall()
        return iter([row[0] for row in rows])


# At run time; a packaged tier would rather declare a ``tiercheck.tiers`` entry point.
register_tier("sqlite", SqliteTier)
