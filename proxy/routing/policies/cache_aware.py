"""Policy ``cache_aware`` (the default).

Algorithm, per request, over the healthy candidates (costs in prompt-token units,
i.e. roughly "prefill work a worker must get through before this request's first
token"):

1. Guard (as SGLang's router): if the fleet is imbalanced, meaning the busiest worker
   has more than ``balance_abs_threshold`` outstanding requests above the idlest AND
   more than ``balance_rel_threshold`` times as many, ignore caches and rank by load
   (``least_loaded``) so a hot prefix cannot pile work on one worker.
2. Each worker's predicted cached prefix counts only if it covers at least
   ``cache_threshold`` of the prompt's tokens: a match of a block or two (a chat
   template, a short shared preamble) on a long prompt pulls nobody.
3. The request's *common* leading blocks (carried by most recent requests, see
   :mod:`proxy.routing.popularity`) never count either: a global system prompt,
   however long, pulls nobody, while the part of a match beyond it still does.
4. cost(w) = ``prefill_weight``   × (prompt tokens − counted cached tokens on w
                                      − (1 − f_w) × shared-tier tokens of w)
           + ``pending_weight``   × prompt tokens routed to w without a first token yet
           + ``running_cost``     × requests decoding on w
           + ``waiting_cost``     × requests waiting on w (its own report)
           + ``pressure_cost``    × max(0, used-block fraction − ``pressure_start``)
                                    / (1 − ``pressure_start``)
   The cheapest worker ranks first; equal costs rotate round-robin.
   Shared-tier tokens of w: the leading blocks after w's own cached prefix that another
   worker holds, when w has a shared KV tier (they are in Redis, written through at
   caching time); ``f_w`` is w's measured cost of loading a block over recomputing it
   (its ``/load`` ``tier_load_fraction``): cheaper than recompute, dearer than resident.

``prefill_weight`` > 1 values a cache hit above the equal amount of queued work: a
hit also spares cache space on the other workers (no duplicate copy) and keeps the
prefix warm for the conversation's next turn. The defaults were tuned on the
Mooncake conversation trace with ``kvtoll bench routing`` / bench/routing_policies.py
(4 workers × 3,072,000 tokens: hit rate rises with ``prefill_weight`` up to about 8
and flattens after; mean TTFT is best near 8).

Defaults: prefill_weight 8, pending_weight 1, running_cost 256, waiting_cost 512,
pressure_cost 4096, pressure_start 0.9, cache_threshold 0.1, balance_abs_threshold 32,
balance_rel_threshold 1.5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.routing.policies.least_loaded import LeastLoadedPolicy
from proxy.routing.ranking import order_by_key
from proxy.routing.types import Candidate, RouteRequest, WorkerId


@dataclass(frozen=True)
class CacheAwareParams:
    """Every knob of :class:`CacheAwarePolicy` (see the module header)."""

    prefill_weight: float = 8.0
    pending_weight: float = 1.0
    running_cost: float = 256.0
    waiting_cost: float = 512.0
    pressure_cost: float = 4096.0
    pressure_start: float = 0.9
    cache_threshold: float = 0.1
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if not 0.0 <= self.pressure_start < 1.0:
            raise ValueError("pressure_start must be within [0, 1)")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")


class CacheAwarePolicy:
    """Lowest predicted cost (uncached prefill + load) first."""

    name = "cache_aware"

    def __init__(self, params: CacheAwareParams | None = None) -> None:
        self.params = params or CacheAwareParams()
        self._counter = 0
        self._fallback = LeastLoadedPolicy()

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[WorkerId]:
        """Candidates by ascending cost; by load alone while the fleet is imbalanced."""
        self._counter += 1
        if self.is_imbalanced(candidates):
            return self._fallback.rank(request, candidates)
        return order_by_key(candidates, lambda c: (self.cost(request, c),), self._counter)

    def is_imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        """SGLang-style guard over outstanding request counts."""
        if len(candidates) < 2:
            return False
        counts = [c.load.num_requests for c in candidates]
        busiest, idlest = max(counts), min(counts)
        p = self.params
        return (
            busiest - idlest > p.balance_abs_threshold
            and busiest > p.balance_rel_threshold * idlest
        )

    def cost(self, request: RouteRequest, candidate: Candidate) -> float:
        """Predicted cost of sending ``request`` to ``candidate`` (token units)."""
        p = self.params
        cached: float = self.cache_benefit(request, candidate.cached_blocks)
        load = candidate.load
        if candidate.shared_blocks > 0 and load.shared_load_fraction is not None:
            reachable = request.cached_tokens(candidate.cached_blocks + candidate.shared_blocks)
            shared = reachable - request.cached_tokens(candidate.cached_blocks)
            cached += (1.0 - load.shared_load_fraction) * shared
        pressure = max(0.0, load.used_block_fraction - p.pressure_start) / (1.0 - p.pressure_start)
        return (
            p.prefill_weight * (request.num_prompt_tokens - cached)
            + p.pending_weight * load.pending_prefill_tokens
            + p.running_cost * load.num_running
            + p.waiting_cost * load.num_waiting
            + p.pressure_cost * pressure
        )

    def cache_benefit(self, request: RouteRequest, cached_blocks: int) -> int:
        """Cached tokens that count for affinity: none below ``cache_threshold`` of the
        prompt, and never the request's common leading blocks (steps 2 and 3)."""
        cached = request.cached_tokens(cached_blocks)
        if cached <= 0 or cached < self.params.cache_threshold * request.num_prompt_tokens:
            return 0
        return cached - request.cached_tokens(min(cached_blocks, request.num_common_blocks))
