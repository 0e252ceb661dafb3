"""Ordered, bounded log of KV-cache events (block stored / removed) for the router.

Written by the engine thread, read by the server thread: guarded by a lock. Each
event gets the next sequence number; the log keeps the newest ``capacity`` events,
so a reader whose cursor fell behind resumes at the oldest one still kept.
"""

from __future__ import annotations

import threading
from collections import deque

from engine.api import KVEvent, KVEventKind
from engine.kv.hashing import BlockHash


class KVEventLog:
    """Append-only event log with monotonically increasing ``seq``."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._next_seq = 0
        self._lock = threading.Lock()

    def emit(self, kind: KVEventKind, block_hashes: list[BlockHash], tenant: str = "") -> None:
        """Record one event (no-op for an empty hash list); ``tenant``: whose blocks."""
        if not block_hashes:
            return
        with self._lock:
            self._events.append(KVEvent(self._next_seq, kind, tuple(block_hashes), tenant))
            self._next_seq += 1

    def since(self, cursor: int, limit: int = 1000) -> list[KVEvent]:
        """Events with ``seq >= cursor`` in order, at most ``limit``."""
        with self._lock:
            if not self._events or cursor >= self._next_seq:
                return []
            start = max(0, cursor - self._events[0].seq)
            return [self._events[i] for i in range(start, min(len(self._events), start + limit))]

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq
