"""Policy ``round_robin``.

Algorithm: keep a counter; request *k* ranks the candidates starting at position
``k mod n`` of the candidate list and wrapping around. Ignores caches and load.
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.routing.types import Candidate, RouteRequest, WorkerId


class RoundRobinPolicy:
    """Rotate through the candidates, one step per request."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[WorkerId]:
        """Candidates in rotation order starting at the counter."""
        n = len(candidates)
        if n == 0:
            return []
        start = self._counter % n
        self._counter += 1
        return [candidates[(start + i) % n].worker_id for i in range(n)]
