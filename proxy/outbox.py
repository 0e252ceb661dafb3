"""Durable local outbox: every usage record passes through it on its way to the ledger.

Two files in ``data_dir``::

    put ──► outbox.journal (append-only, one JSON line per record: one write(2))
                │ absorbed (renamed to outbox.journal.absorbing, copied in one
                ▼ transaction, deleted) before any peek / depth
            outbox.sqlite3 (WAL): ordered, keyed by request id; peek / remove

A :meth:`Outbox.put` returns once its line is written to the journal: in the operating
system's page cache, so a ``kill -9`` of the process right after it loses nothing
(``fsync_every_put=True`` also fsyncs, and runs SQLite with ``synchronous=FULL``, to
survive a power loss). The put runs in the event loop on every request: one
``write`` (~10 us) instead of a SQLite transaction (~50 us, and waiting on the
lock while the drainer used the database). Records are keyed by request id: a
second put of the same id is a no-op (the first is kept when the journal is
absorbed); they are deleted only after the ledger accepted them, and since the
ledger write is idempotent by request id, a replay interrupted between the two
never bills twice. A crash in the middle of absorbing leaves the ``.absorbing``
file, absorbed again at the next start (duplicates ignored); a torn last line (power
loss) is logged and skipped.
``put`` runs in the event loop, the rest (blocking, short) in a worker thread. One
gateway process per ``data_dir``.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
OUTBOX_FILE = "outbox.sqlite3"
JOURNAL_FILE = "outbox.journal"
ABSORBING_SUFFIX = ".absorbing"


class Outbox:
    """Append/peek/delete store of JSON usage records keyed by request id."""

    def __init__(self, path: Path, *, fsync_every_put: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fsync = fsync_every_put
        self._lock = threading.Lock()  # the database connection
        self._journal_lock = threading.Lock()  # the journal's file descriptor
        self._journal = path.with_name(JOURNAL_FILE)
        self._absorbing = path.with_name(JOURNAL_FILE + ABSORBING_SUFFIX)
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={'FULL' if fsync_every_put else 'NORMAL'}")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
            " request_id TEXT NOT NULL UNIQUE, payload TEXT NOT NULL)"
        )
        with self._lock:
            self._absorb_file(self._absorbing)  # left by a crash while absorbing
        self._fd = self._open_journal()

    @classmethod
    def in_dir(cls, data_dir: str | Path, *, fsync_every_put: bool = False) -> Outbox:
        """The outbox file inside ``data_dir`` (created if missing)."""
        return cls(Path(data_dir) / OUTBOX_FILE, fsync_every_put=fsync_every_put)

    def _open_journal(self) -> int:
        """Open (append) the journal and note its size (call with ``_journal_lock`` held
        once the outbox is in use)."""
        fd = os.open(self._journal, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(fd).st_size
        if self._size and os.pread(fd, 1, self._size - 1) != b"\n":
            self._size += os.write(fd, b"\n")  # a torn last line stays alone (skipped)
        return fd

    def put(self, request_id: str, payload: dict[str, Any]) -> None:
        """Store one record durably; a record already queued for ``request_id`` is kept.
        Raises ``OSError`` if the journal cannot be written."""
        line = json.dumps([request_id, payload], separators=(",", ":")) + "\n"
        data = line.encode()
        with self._journal_lock:
            written = os.write(self._fd, data)
            if written != len(data):  # a full disk: cut the partial line off again, so
                os.ftruncate(self._fd, self._size)  # the next record starts a line
                raise OSError(f"short write to the outbox journal ({written} bytes)")
            self._size += written
            if self._fsync:
                os.fsync(self._fd)

    def _absorb(self) -> None:
        """Move the journal's records into the database (call with ``_lock`` held)."""
        self._absorb_file(self._absorbing)  # a previous attempt that failed: first
        with self._journal_lock:
            if self._size == 0:
                return
            os.replace(self._journal, self._absorbing)
            old, self._fd = self._fd, self._open_journal()
        os.close(old)
        self._absorb_file(self._absorbing)

    def _absorb_file(self, path: Path) -> None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        rows: list[tuple[str, str]] = []
        for line in raw.split(b"\n"):
            if not line:
                continue
            try:
                request_id, payload = json.loads(line)
                rows.append((str(request_id), json.dumps(payload, separators=(",", ":"))))
            except (ValueError, TypeError):
                log.error("outbox journal %s: unreadable line skipped: %r", path, line[:200])
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.executemany(
                "INSERT OR IGNORE INTO outbox (request_id, payload) VALUES (?, ?)", rows
            )
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        path.unlink()

    def peek(self, limit: int = 100) -> list[tuple[str, dict[str, Any]]]:
        """The oldest ``limit`` records, without removing them."""
        with self._lock:
            self._absorb()
            rows = self._conn.execute(
                "SELECT request_id, payload FROM outbox ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
        return [(rid, json.loads(payload)) for rid, payload in rows]

    def remove(self, request_ids: list[str]) -> None:
        """Forget records the ledger has accepted."""
        if not request_ids:
            return
        with self._lock:
            self._conn.executemany(
                "DELETE FROM outbox WHERE request_id = ?", [(r,) for r in request_ids]
            )

    def depth(self) -> int:
        """How many records wait."""
        with self._lock:
            self._absorb()
            return int(self._conn.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            try:
                self._absorb()
            finally:
                with self._journal_lock:
                    os.close(self._fd)
                self._conn.close()
