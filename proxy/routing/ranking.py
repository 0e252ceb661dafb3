"""Ranking helper shared by the policies (a leaf: it imports no policy)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.routing.types import Candidate, WorkerId


def order_by_key(
    candidates: Sequence[Candidate],
    key: Callable[[Candidate], tuple[float, ...]],
    rotation: int,
) -> list[WorkerId]:
    """Sort by ``key`` ascending; equal keys in round-robin order starting at ``rotation``.

    The rotation keeps ties (an idle fleet, identical caches) from always landing on
    the first worker in the list.
    """
    n = len(candidates)
    indexed = sorted(range(n), key=lambda i: (key(candidates[i]), (i - rotation) % n))
    return [candidates[i].worker_id for i in indexed]
