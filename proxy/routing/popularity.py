"""Which leading blocks are *common*: shared by most recent requests.

A prefix that nearly every request carries (a global system prompt, a chat template,
a tenant's fixed instructions) says nothing about where a request should go: once
any worker holds it, preferring that worker would pull all traffic onto it. The
router counts, over the last ``window`` requests, how many carried each of their
first ``max_blocks`` block hashes; a request's common blocks are its leading blocks
carried by at least ``common_fraction`` of the window and by at least ``min_count``
requests (once ``min_requests`` were seen).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from engine.kv.hashing import BlockHash


class PrefixPopularity:
    """Sliding-window counts of leading block hashes."""

    def __init__(
        self,
        window: int = 256,
        common_fraction: float = 0.5,
        max_blocks: int = 64,
        min_requests: int = 2,
        min_count: int = 2,
    ) -> None:
        if window <= 0 or max_blocks <= 0 or not 0.0 < common_fraction <= 1.0:
            raise ValueError("window and max_blocks must be positive, common_fraction in (0, 1]")
        self._window = window
        self._fraction = common_fraction
        self._max_blocks = max_blocks
        self._min_requests = min_requests
        self._min_count = min_count
        self._recent: deque[tuple[BlockHash, ...]] = deque()
        self._counts: Counter[BlockHash] = Counter()

    def common_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of this prompt are common right now."""
        if len(self._recent) < self._min_requests:
            return 0
        needed = max(self._min_count, self._fraction * len(self._recent))
        count = 0
        for h in block_hashes[: self._max_blocks]:
            if self._counts[h] < needed:
                break
            count += 1
        return count

    def observe(self, block_hashes: Sequence[BlockHash]) -> None:
        """Count one routed request."""
        leading = tuple(block_hashes[: self._max_blocks])
        self._recent.append(leading)
        self._counts.update(leading)
        if len(self._recent) > self._window:
            old = self._recent.popleft()
            self._counts.subtract(old)
            for h in old:
                if self._counts[h] <= 0:
                    del self._counts[h]
