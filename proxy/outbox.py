"""Durable local outbox: every usage record passes through it on its way to the ledger.

Two files in ``data_dir``::

    put ──► outbox.journal (append-only, one JSON line per record: one write(2))
                │ taken (renamed to outbox.journal.taken; its records, kept in
                │ memory since their put, go to the ledger; then it is deleted)
                │   or absorbed (renamed to outbox.journal.absorbing, copied in one
                ▼   transaction, deleted) before any peek
            outbox.sqlite3 (WAL): ordered, keyed by request id; peek / remove

While the ledger keeps up, records never touch SQLite: the drainer takes the
journal's records in one rename (:meth:`Outbox.take_fresh`) and deletes the taken
file once the ledger committed them (:meth:`Outbox.settle_taken`). A backlog (a
failed ledger write, :meth:`Outbox.keep_taken`, or records a crash left) goes
through SQLite as before, oldest first.

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
file, one between taking and settling the ``.taken`` file: both are absorbed at the
next start (with the journal itself; duplicates ignored); a torn last line (power
loss) is logged and skipped.
``put`` runs in the event loop, the rest (blocking, short) in a worker thread. One
gateway process per ``data_dir``. Every outbox file is readable by its owner only
(mode 0600: usage records name tenants, keys and models).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

from kvtoll import fastjson

log = logging.getLogger(__name__)
OUTBOX_FILE = "outbox.sqlite3"
JOURNAL_FILE = "outbox.journal"
ABSORBING_SUFFIX = ".absorbing"
TAKEN_SUFFIX = ".taken"


def owner_only(path: Path) -> None:
    """``chmod 0600`` ``path`` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, 0o600)


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
        self._taken = path.with_name(JOURNAL_FILE + TAKEN_SUFFIX)
        # the journal's records since it was last taken or absorbed, by request id
        self._fresh: dict[str, dict[str, Any]] = {}
        self._num_taken = 0  # records taken and not yet settled or kept
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={'FULL' if fsync_every_put else 'NORMAL'}")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
            " request_id TEXT NOT NULL UNIQUE, payload TEXT NOT NULL)"
        )
        for name in (path.name, path.name + "-wal", path.name + "-shm"):
            owner_only(path.with_name(name))
        with self._lock:  # left by a crash: absorbing, taken, or never drained
            for left in (self._absorbing, self._taken, self._journal):
                self._absorb_file(left)
        self._fd = self._open_journal()

    @classmethod
    def in_dir(cls, data_dir: str | Path, *, fsync_every_put: bool = False) -> Outbox:
        """The outbox file inside ``data_dir`` (created if missing)."""
        return cls(Path(data_dir) / OUTBOX_FILE, fsync_every_put=fsync_every_put)

    def _open_journal(self) -> int:
        """Open (append) the journal and note its size (call with ``_journal_lock`` held
        once the outbox is in use)."""
        fd = os.open(self._journal, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        self._size = os.fstat(fd).st_size
        if self._size and os.pread(fd, 1, self._size - 1) != b"\n":
            self._size += os.write(fd, b"\n")  # a torn last line stays alone (skipped)
        return fd

    def put(self, request_id: str, payload: dict[str, Any]) -> None:
        """Store one record durably; a record already queued for ``request_id`` is kept.
        Raises ``OSError`` if the journal cannot be written."""
        data = fastjson.dumps([request_id, payload]) + b"\n"
        with self._journal_lock:
            written = os.write(self._fd, data)
            if written != len(data):  # a full disk: cut the partial line off again, so
                os.ftruncate(self._fd, self._size)  # the next record starts a line
                raise OSError(f"short write to the outbox journal ({written} bytes)")
            self._size += written
            if self._fsync:
                os.fsync(self._fd)
            self._fresh.setdefault(request_id, payload)

    def _absorb(self) -> None:
        """Move the journal's records into the database (call with ``_lock`` held)."""
        self._absorb_file(self._absorbing)  # a previous attempt that failed: first
        self._absorb_file(self._taken)  # records taken, then kept
        if self._rotate(self._absorbing) is not None:
            self._absorb_file(self._absorbing)

    def _rotate(self, target: Path) -> dict[str, dict[str, Any]] | None:
        """Rename the journal to ``target`` and start a new one; returns its records
        (None if it had none)."""
        with self._journal_lock:
            if self._size == 0:
                return None
            os.replace(self._journal, target)
            old, self._fd = self._fd, self._open_journal()
            fresh, self._fresh = self._fresh, {}
        os.close(old)
        return fresh

    def backlog(self) -> bool:
        """True if records wait in the database (or in a file a failure left)."""
        with self._lock:
            if self._absorbing.exists() or self._taken.exists():
                return True
            return self._conn.execute("SELECT 1 FROM outbox LIMIT 1").fetchone() is not None

    def take_fresh(self) -> list[tuple[str, dict[str, Any]]]:
        """The journal's records (put since the last take or absorb, first put of each
        request id), the journal renamed aside until :meth:`settle_taken` (the ledger
        has them) or :meth:`keep_taken` (it failed). Call when :meth:`backlog` is
        False, one take at a time."""
        with self._lock:
            if self._taken.exists():
                raise RuntimeError("the previous take was neither settled nor kept")
            fresh = self._rotate(self._taken)
            self._num_taken = len(fresh) if fresh else 0
        return list(fresh.items()) if fresh else []

    def settle_taken(self) -> None:
        """The taken records are in the ledger: forget them."""
        with self._lock:
            self._taken.unlink(missing_ok=True)
            self._num_taken = 0

    def keep_taken(self) -> None:
        """The taken records could not be written: queue them in the database."""
        with self._lock:
            self._absorb_file(self._taken)
            self._num_taken = 0

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
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(
                    "DELETE FROM outbox WHERE request_id = ?", [(r,) for r in request_ids]
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def depth(self) -> int:
        """How many records wait: queued in the database, taken and not yet settled, or
        put since the last take (a record put again while queued counts twice)."""
        with self._lock:
            queued = int(self._conn.execute("SELECT count(*) FROM outbox").fetchone()[0])
            with self._journal_lock:
                return queued + self._num_taken + len(self._fresh)

    def close(self) -> None:
        with self._lock:
            try:
                self._absorb()
            finally:
                with self._journal_lock:
                    os.close(self._fd)
                self._conn.close()
