"""Small values exchanged between the routing layer's parts (index, policy, router)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

WorkerId = NewType("WorkerId", str)  # the upstream's ``name`` (what ``x-kvtoll-worker`` shows)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as the policy sees it.

    ``num_running``/``num_waiting``/``num_free_blocks``/``num_total_blocks`` come from the
    worker's ``GET /load`` (zeros when it reports none); ``pending_prefill_tokens`` is the
    router's own count of prompt tokens it sent there that have not produced a first token.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    pending_prefill_tokens: int = 0
    # The worker's shared KV tier: a block there costs this fraction of recomputing it
    # (its measured load cost); None = no shared tier.
    shared_load_fraction: float | None = None
    # (tenant, cached blocks, reserved blocks) per tenant, as the worker's /load reports
    tenant_blocks: tuple[tuple[str, int, int], ...] = ()

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def used_block_fraction(self) -> float:
        """Share of KV blocks in use, 0.0 when the worker reports no block counts."""
        if self.num_total_blocks <= 0:
            return 0.0
        used = self.num_total_blocks - self.num_free_blocks
        return min(1.0, max(0.0, used / self.num_total_blocks))


@dataclass(frozen=True)
class Candidate:
    """One worker a request could go to, with what the router predicts for it."""

    worker_id: WorkerId
    cached_blocks: int  # leading prompt blocks the worker is predicted to hold
    load: WorkerLoad
    # leading blocks after ``cached_blocks`` that another worker holds: reachable in
    # the shared KV tier when the worker has one (``load.shared_load_fraction``)
    shared_blocks: int = 0


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows about a request (no tokens, no text)."""

    num_prompt_tokens: int
    block_size: int
    routing_key: str | None = None  # tenant id or session key, for consistent hashing
    num_common_blocks: int = 0  # leading blocks most recent requests share (see popularity)

    def cached_tokens(self, cached_blocks: int) -> int:
        """Prompt tokens covered by ``cached_blocks`` leading blocks."""
        return min(self.num_prompt_tokens, cached_blocks * self.block_size)

    def uncached_tokens(self, cached_blocks: int) -> int:
        return self.num_prompt_tokens - self.cached_tokens(cached_blocks)


@dataclass(frozen=True)
class RouteChoice:
    """One ranked candidate handed to the proxy."""

    worker_id: WorkerId
    predicted_cached_tokens: int
