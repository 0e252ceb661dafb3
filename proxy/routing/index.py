"""Per-worker prefix indexes of block hashes: which leading blocks of a prompt each
worker holds.

Block hashes are chained (``engine.kv.hashing``): block *i*'s hash covers every token
before it, so "worker holds the first *k* blocks" is a walk down the request's hash
list that stops at the first hash the worker lacks::

    request:   h0  h1  h2  h3  h4
    worker A:  h0  h1  h2  .   .     -> 3 leading blocks
    worker B:  h0  .   h2  .   .     -> 1 (h2 without h1 is useless)

Two implementations share the :class:`PrefixIndex` query:

* :class:`PreciseIndex` mirrors a worker's cache from its ordered KV events
  (stored / removed, with sequence numbers; a gap resets that worker).
* :class:`ApproxIndex` remembers which prefix blocks the router *sent* where, for
  upstreams that publish no events, bounded by an LRU per worker and a TTL.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.api import KVEvent, KVEventKind
from engine.kv.hashing import BlockHash
from proxy.routing.types import WorkerId


class PrefixIndex(Protocol):
    """Longest cached prefix per worker."""

    def match(
        self, block_hashes: Sequence[BlockHash], worker_ids: Iterable[WorkerId]
    ) -> dict[WorkerId, int]:
        """For each of ``worker_ids``: how many leading ``block_hashes`` it holds."""
        ...

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget everything about ``worker_id``."""
        ...


@dataclass(frozen=True)
class ApplyResult:
    """What :meth:`PreciseIndex.apply_events` did."""

    num_applied: int
    num_skipped: int  # already applied (seq below the cursor)
    reset: bool  # a gap was found: the worker's entries were dropped first
    next_seq: int


class PreciseIndex:
    """Mirror of each worker's prefix cache, fed by its KV events."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[WorkerId]] = {}
        self._blocks: dict[WorkerId, set[BlockHash]] = {}
        self._next_seq: dict[WorkerId, int] = {}

    def next_seq(self, worker_id: WorkerId) -> int:
        """Sequence number of the next event expected from ``worker_id`` (its cursor)."""
        return self._next_seq.get(worker_id, 0)

    def num_blocks(self, worker_id: WorkerId) -> int:
        return len(self._blocks.get(worker_id, ()))

    def workers(self) -> list[WorkerId]:
        return list(self._blocks)

    def apply_events(self, worker_id: WorkerId, events: Iterable[KVEvent]) -> ApplyResult:
        """Apply events in ``seq`` order. Events below the cursor are skipped (already
        seen); an event past the cursor means some were lost, so the worker's entries
        are dropped and the log is followed from there (an under-estimate, never a lie).
        """
        applied = skipped = 0
        reset = False
        expected = self._next_seq.get(worker_id, 0)
        self._blocks.setdefault(worker_id, set())
        for event in events:
            if event.seq < expected:
                skipped += 1
                continue
            if event.seq > expected:
                self._clear(worker_id)
                reset = True
            self._apply_one(worker_id, event)
            expected = event.seq + 1
            applied += 1
        self._next_seq[worker_id] = expected
        return ApplyResult(applied, skipped, reset, expected)

    def reset_worker(self, worker_id: WorkerId, next_seq: int = 0) -> None:
        """Drop the worker's entries and expect ``next_seq`` next (a restart, a gap)."""
        self._clear(worker_id)
        self._blocks.setdefault(worker_id, set())
        self._next_seq[worker_id] = next_seq

    def store(self, worker_id: WorkerId, block_hashes: Iterable[BlockHash]) -> None:
        """Record blocks as held (an event's body, without sequence bookkeeping)."""
        held = self._blocks.setdefault(worker_id, set())
        for h in block_hashes:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: WorkerId, block_hashes: Iterable[BlockHash]) -> None:
        """Record blocks as evicted; unknown hashes are ignored."""
        held = self._blocks.get(worker_id)
        if held is None:
            return
        for h in block_hashes:
            if h in held:
                held.discard(h)
                self._drop_holder(h, worker_id)

    def match(
        self, block_hashes: Sequence[BlockHash], worker_ids: Iterable[WorkerId]
    ) -> dict[WorkerId, int]:
        """Leading blocks held, per worker (0 for workers the index never heard of)."""
        result = dict.fromkeys(worker_ids, 0)
        active = set(result)
        for i, h in enumerate(block_hashes):
            if not active:
                break
            holders = self._holders.get(h)
            still = active & holders if holders else set()
            for worker_id in active - still:
                result[worker_id] = i
            active = still
        for worker_id in active:
            result[worker_id] = len(block_hashes)
        return result

    def remove_worker(self, worker_id: WorkerId) -> None:
        self._clear(worker_id)
        self._blocks.pop(worker_id, None)
        self._next_seq.pop(worker_id, None)

    def _apply_one(self, worker_id: WorkerId, event: KVEvent) -> None:
        if event.kind is KVEventKind.STORED:
            self.store(worker_id, event.block_hashes)
        elif event.kind is KVEventKind.REMOVED:
            self.remove(worker_id, event.block_hashes)
        else:  # pragma: no cover - the enum has two members
            raise RuntimeError(f"unknown KV event kind {event.kind!r}")

    def _clear(self, worker_id: WorkerId) -> None:
        for h in self._blocks.get(worker_id, ()):
            self._drop_holder(h, worker_id)
        if worker_id in self._blocks:
            self._blocks[worker_id] = set()

    def _drop_holder(self, h: BlockHash, worker_id: WorkerId) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]


class ApproxIndex:
    """What the router sent where: per worker an LRU of block hashes with a TTL.

    Parameters: ``max_blocks_per_worker`` (LRU bound, roughly the worker's cache size
    in blocks), ``ttl_s`` (an entry not re-sent for this long is assumed evicted),
    ``clock`` (seconds, monotonic; injected for tests and the simulator).
    A prompt's blocks are recorded leaf first, so the root of a prefix is always at
    least as recent as its children and the LRU drops children first.
    """

    def __init__(
        self,
        max_blocks_per_worker: int = 100_000,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks_per_worker <= 0 or ttl_s <= 0:
            raise ValueError("max_blocks_per_worker and ttl_s must be positive")
        self._capacity = max_blocks_per_worker
        self._ttl = ttl_s
        self._clock = clock
        self._lru: dict[WorkerId, OrderedDict[BlockHash, float]] = {}

    def record(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> None:
        """Remember that a prompt with these leading blocks was sent to ``worker_id``."""
        lru = self._lru.setdefault(worker_id, OrderedDict())
        expiry = self._clock() + self._ttl
        for h in reversed(block_hashes):
            lru[h] = expiry
            lru.move_to_end(h)
        while len(lru) > self._capacity:
            lru.popitem(last=False)

    def num_blocks(self, worker_id: WorkerId) -> int:
        self._purge(worker_id)
        return len(self._lru.get(worker_id, ()))

    def match(
        self, block_hashes: Sequence[BlockHash], worker_ids: Iterable[WorkerId]
    ) -> dict[WorkerId, int]:
        """Leading blocks recorded and not expired, per worker."""
        result: dict[WorkerId, int] = {}
        for worker_id in worker_ids:
            self._purge(worker_id)
            lru = self._lru.get(worker_id)
            count = 0
            if lru:
                for h in block_hashes:
                    if h not in lru:
                        break
                    count += 1
            result[worker_id] = count
        return result

    def remove_worker(self, worker_id: WorkerId) -> None:
        self._lru.pop(worker_id, None)

    def _purge(self, worker_id: WorkerId) -> None:
        """Drop expired entries; recency order is expiry order, so they sit in front."""
        lru = self._lru.get(worker_id)
        if not lru:
            return
        now = self._clock()
        while lru:
            h, expiry = next(iter(lru.items()))
            if expiry > now:
                break
            del lru[h]
