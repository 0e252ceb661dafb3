"""Durable local outbox: every usage record passes through it on its way to the ledger.

A SQLite file (``<data_dir>/outbox.sqlite3``) in WAL mode. With the default
``synchronous=NORMAL`` a committed :meth:`Outbox.put` is in the operating system's
page cache, so a ``kill -9`` of the process right after it loses nothing (about
0.1 ms per put); ``fsync_every_put=True`` (``synchronous=FULL``) also survives a
power loss, at the cost of one fsync per request. Records are keyed by request id (a
second put of the same id is a no-op) and deleted only after the ledger accepted
them; since the ledger write is idempotent by request id, a replay interrupted
between the two never bills twice.
All methods are blocking and short; ``put`` runs in the event loop, the rest in a
worker thread. One gateway process per ``data_dir``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

OUTBOX_FILE = "outbox.sqlite3"


class Outbox:
    """Append/peek/delete store of JSON usage records keyed by request id."""

    def __init__(self, path: Path, *, fsync_every_put: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA synchronous={'FULL' if fsync_every_put else 'NORMAL'}")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
            " request_id TEXT NOT NULL UNIQUE, payload TEXT NOT NULL)"
        )

    @classmethod
    def in_dir(cls, data_dir: str | Path, *, fsync_every_put: bool = False) -> Outbox:
        """The outbox file inside ``data_dir`` (created if missing)."""
        return cls(Path(data_dir) / OUTBOX_FILE, fsync_every_put=fsync_every_put)

    def put(self, request_id: str, payload: dict[str, Any]) -> None:
        """Store one record durably; a record already queued for ``request_id`` is kept."""
        with self._lock:
            self._conn.execute(
                "INSERT OR IGNORE INTO outbox (request_id, payload) VALUES (?, ?)",
                (request_id, json.dumps(payload, separators=(",", ":"))),
            )

    def peek(self, limit: int = 100) -> list[tuple[str, dict[str, Any]]]:
        """The oldest ``limit`` records, without removing them."""
        with self._lock:
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
            return int(self._conn.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()
