"""Crash-safe metering of streams: what a stream has delivered so far, journaled.

The ledger row of a request is written when it finishes (:mod:`proxy.metering`). A
gateway killed with SIGKILL mid-stream never gets there, so while a streamed request
runs its provisional usage (the ledger entry it would bill if it ended now, marked
``cut``) is appended to ``KVTOLL_DATA_DIR/progress.journal`` at least every
``every_tokens`` completion tokens or ``every_s`` seconds (checked at each delta)::

    [request_id, {ledger entry as JSON, "cut": true}]   a stream's progress (latest wins)
    [request_id, null]                                  it finished: its own row is in the outbox

At the next start :meth:`ProgressJournal.recover` returns the entries of streams that
never finished; the gateway puts them in the usage outbox (before serving), and the
file starts empty. Each request is billed once: the outbox and the ledger keep the
first record of a request id, so a stream whose final record was already written
keeps that one. What a cut stream is billed lags what it delivered by at most one
journal interval. Lines are single ``write(2)`` calls (like the outbox journal: a
``kill -9`` loses none); a torn last line (power loss) is skipped. The file is
rewritten with only the live streams once it grows past ``compact_bytes``. One
gateway process per data directory; everything runs in the event loop.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtoll import fastjson

log = logging.getLogger(__name__)
PROGRESS_FILE = "progress.journal"


class ProgressJournal:
    """The progress file of one data directory (see module doc)."""

    def __init__(self, path: Path, *, every_tokens: int = 16, every_s: float = 0.5,
                 compact_bytes: int = 4 << 20,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if every_tokens < 1 or every_s <= 0:
            raise ValueError("progress intervals must be positive")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.every_tokens = every_tokens
        self.every_s = every_s
        self._compact_bytes = compact_bytes
        self._clock = clock
        self._live: dict[str, dict[str, Any]] = {}  # request id -> latest payload
        self._failing = False  # the last write failed (logged once)
        self._left = _read(path)  # what a previous process left, until recovered
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(self._fd, 0o600)
        self._size = os.fstat(self._fd).st_size
        if self._size:
            self._size += os.write(self._fd, b"\n")  # a torn last line stays alone

    @classmethod
    def in_dir(cls, data_dir: str | Path, **options: Any) -> ProgressJournal:
        return cls(Path(data_dir) / PROGRESS_FILE, **options)

    def recover(self) -> list[tuple[str, dict[str, Any]]]:
        """Entries of streams a previous process left unfinished (once; the caller must
        make them durable, then call :meth:`forget_recovered`)."""
        left, self._left = self._left, {}
        return list(left.items())

    def forget_recovered(self) -> None:
        """The recovered entries are durable elsewhere: start the file afresh (if the disk
        refuses, they are recovered again at the next start: billed once all the same)."""
        try:
            self._rewrite()
        except OSError as exc:
            log.warning("progress journal: cannot start afresh (%s)", exc)

    def due(self, tokens: int, last_tokens: int, last_at: float) -> bool:
        """Whether a stream at ``tokens`` (journaled at ``last_tokens``, ``last_at``)
        should be journaled now."""
        if tokens <= last_tokens:
            return False
        return tokens - last_tokens >= self.every_tokens or (
            self._clock() - last_at >= self.every_s)

    def now(self) -> float:
        return self._clock()

    def note(self, request_id: str, payload: dict[str, Any]) -> bool:
        """Journal ``payload`` as the latest progress of ``request_id``; False if the disk
        refused (logged once per failing spell: the stream is then billed at its end, and
        only its last journaled progress if the gateway dies first)."""
        self._live[request_id] = payload
        try:
            self._append(request_id, payload)
        except OSError as exc:
            if not self._failing:
                log.warning("progress journal: write failed (%s); cut streams may be billed "
                            "short until it works again", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("progress journal: writes work again")
        self._failing = False
        return True

    def done(self, request_id: str) -> None:
        """``request_id`` finished (its row is in the outbox): no longer a cut stream."""
        if self._live.pop(request_id, None) is None:
            return
        try:
            self._append(request_id, None)
        except OSError:  # recovered at the next start: the ledger keeps the final row
            log.debug("progress journal: cannot mark %s finished", request_id)
        if self._size > self._compact_bytes:
            try:
                self._rewrite()
            except OSError as exc:
                log.warning("progress journal: compaction failed (%s)", exc)

    def _append(self, request_id: str, payload: dict[str, Any] | None) -> None:
        data = fastjson.dumps([request_id, payload]) + b"\n"
        written = os.write(self._fd, data)
        if written != len(data):
            os.ftruncate(self._fd, self._size)
            raise OSError(f"short write to the progress journal ({written} bytes)")
        self._size += written

    def _rewrite(self) -> None:
        """The file with only the live streams' latest progress (atomic rename)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = b"".join(fastjson.dumps([rid, p]) + b"\n" for rid, p in self._live.items())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND)
        os.close(old)
        self._size = len(data)

    def close(self) -> None:
        os.close(self._fd)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    """Unfinished streams' latest progress in ``path`` (missing file: none)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    left: dict[str, dict[str, Any]] = {}
    for line in raw.split(b"\n"):
        if not line:
            continue
        try:
            request_id, payload = json.loads(line)
        except (ValueError, TypeError):
            log.error("progress journal: unreadable line skipped: %r", line[:200])
            continue
        if payload is None:
            left.pop(str(request_id), None)
        elif isinstance(payload, dict):
            left[str(request_id)] = payload
    return left
