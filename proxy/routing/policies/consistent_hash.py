"""Policy ``consistent_hash``.

Algorithm: a hash ring with ``num_virtual_nodes`` points per worker (point *i* of
worker *w* sits at ``H("w#i")``, H = the first 8 bytes of BLAKE2b). A request's
routing key (tenant id or session key) hashes to a point; the ring is walked
clockwise from there and each worker is ranked when first met, so the first choice
is stable while the fleet is, and a worker that leaves only moves its own keys (to
the next workers on the ring, which are exactly the fallbacks ranked for them).
Requests without a routing key fall back to ranking by load like ``least_loaded``.
Parameters: ``num_virtual_nodes`` (default 160): more points, smoother key spread.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from proxy.routing.policies.least_loaded import LeastLoadedPolicy
from proxy.routing.types import Candidate, RouteRequest, WorkerId


def ring_hash(text: str) -> int:
    """64-bit position on the ring."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Sorted virtual-node points of a fixed set of workers."""

    def __init__(self, worker_ids: Sequence[WorkerId], num_virtual_nodes: int) -> None:
        points = [
            (ring_hash(f"{worker_id}#{i}"), worker_id)
            for worker_id in worker_ids
            for i in range(num_virtual_nodes)
        ]
        points.sort()
        self._positions = [p for p, _ in points]
        self._owners = [w for _, w in points]
        self._num_workers = len(set(worker_ids))

    def walk(self, key: str) -> list[WorkerId]:
        """Distinct workers clockwise from the key's position."""
        if not self._positions:
            return []
        start = bisect.bisect_left(self._positions, ring_hash(key))
        seen: dict[WorkerId, None] = {}
        n = len(self._owners)
        for step in range(n):
            seen.setdefault(self._owners[(start + step) % n], None)
            if len(seen) == self._num_workers:
                break
        return list(seen)


class ConsistentHashPolicy:
    """Sticky routing by tenant or session key."""

    name = "consistent_hash"

    def __init__(self, num_virtual_nodes: int = 160) -> None:
        if num_virtual_nodes <= 0:
            raise ValueError("num_virtual_nodes must be positive")
        self._num_virtual_nodes = num_virtual_nodes
        self._ring_workers: tuple[WorkerId, ...] = ()
        self._ring = HashRing((), num_virtual_nodes)
        self._fallback = LeastLoadedPolicy()

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[WorkerId]:
        """Ring order from the routing key; load order when there is no key."""
        if request.routing_key is None:
            return self._fallback.rank(request, candidates)
        workers = tuple(sorted(c.worker_id for c in candidates))
        if workers != self._ring_workers:
            self._ring = HashRing(workers, self._num_virtual_nodes)
            self._ring_workers = workers
        return self._ring.walk(request.routing_key)
