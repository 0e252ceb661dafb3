"""Policy ``least_loaded``.

Algorithm: rank by the number of outstanding requests on the worker (running +
waiting, as its ``GET /load`` reports), then by the prompt tokens this router sent
there that have not produced a first token yet, then by KV blocks in use; remaining
ties rotate round-robin. Ignores which prefixes a worker holds.
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.routing.ranking import order_by_key
from proxy.routing.types import Candidate, RouteRequest, WorkerId


class LeastLoadedPolicy:
    """Fewest outstanding requests first."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._counter = 0

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[WorkerId]:
        """Candidates by ascending load."""
        self._counter += 1
        return order_by_key(candidates, _load_key, self._counter)


def _load_key(candidate: Candidate) -> tuple[float, ...]:
    load = candidate.load
    return (load.num_requests, load.pending_prefill_tokens, load.used_block_fraction)
