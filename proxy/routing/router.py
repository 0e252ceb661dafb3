"""The prefix router: hash a request's prompt, ask the indexes which worker holds how
much of it, and let the policy order the healthy workers.

Use from the proxy, per request::

    plan = router.plan(prompt_token_ids, salt, routing_key=session_or_tenant)
    for choice in plan.choices:                    # best first
        router.dispatched(request_id, plan, choice.worker_id)
        ... stream from that upstream; on the first delta: router.first_token(request_id)
        ... failed before streaming: router.failed(request_id, worker_failed=True); next
    router.completed(request_id, usage.cached_tokens)   # feeds calibration

Workers that publish KV events are looked up in the :class:`PreciseIndex`; others in
the :class:`ApproxIndex` (what was sent where). Blocks sent to any worker within the
last ``recent_ttl_s`` also count, covering the lag before its events arrive.

With one candidate there is nothing to choose: the plan skips the policy and the load
figures, and keeps what the bookkeeping needs (the prompt's blocks, the worker's
predicted cached tokens for its pending load and calibration, the popularity counts).
Requests never closed are forgotten after ``inflight_ttl_s``, looked for at most once
every ``EXPIRY_CHECK_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from engine.kv.hashing import BlockHash, TenantSalt, hash_prompt_blocks
from proxy.routing.calibration import CalibrationStats
from proxy.routing.index import ApproxIndex, PreciseIndex
from proxy.routing.policy import Policy
from proxy.routing.popularity import PrefixPopularity
from proxy.routing.types import Candidate, RouteChoice, RouteRequest, WorkerId, WorkerLoad

EXPIRY_CHECK_S = 1.0  # how often in-flight requests past inflight_ttl_s are looked for


@dataclass(frozen=True)
class WorkerStatus:
    """A healthy worker as a :class:`WorkerSource` reports it."""

    worker_id: WorkerId
    load: WorkerLoad  # as last reported by the worker (pending tokens are the router's)
    kv_events: bool  # its cache is mirrored in the precise index


class WorkerSource(Protocol):
    """The pool: the registry live, the simulated fleet in ``kvtoll bench routing``."""

    def healthy_workers(self) -> list[WorkerStatus]: ...

    def report_failure(self, worker_id: WorkerId) -> None:
        """A request to ``worker_id`` failed before streaming (connection refused...)."""
        ...


@dataclass(frozen=True)
class RoutePlan:
    """A ranked plan for one request; pass it back to :meth:`PrefixRouter.dispatched`."""

    block_hashes: tuple[BlockHash, ...]
    num_prompt_tokens: int
    choices: tuple[RouteChoice, ...]


@dataclass
class _InFlight:
    worker_id: WorkerId
    predicted_cached_tokens: int
    pending_tokens: int  # uncached prompt tokens until the first token arrives
    started_at: float


class PrefixRouter:
    """Orders candidate workers for each request; tracks in-flight prefill work."""

    def __init__(
        self,
        policy: Policy,
        workers: WorkerSource,
        block_size: int,
        precise: PreciseIndex | None = None,
        approx: ApproxIndex | None = None,
        popularity: PrefixPopularity | None = None,
        *,
        recent_ttl_s: float = 10.0,
        inflight_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.policy = policy
        self.block_size = block_size
        self.precise = precise if precise is not None else PreciseIndex()
        self.approx = approx if approx is not None else ApproxIndex(clock=clock)
        self.calibration = CalibrationStats()
        self.popularity = popularity if popularity is not None else PrefixPopularity()
        self._workers = workers
        self._clock = clock
        self._recent = ApproxIndex(ttl_s=recent_ttl_s, clock=clock) if recent_ttl_s > 0 else None
        self._inflight: dict[str, _InFlight] = {}
        self._pending: dict[WorkerId, int] = {}
        self._inflight_ttl = inflight_ttl_s
        self._event_workers: set[WorkerId] = set()
        self._next_expiry_check = 0.0

    def rank(
        self,
        prompt_token_ids: Sequence[int],
        salt: TenantSalt | None,
        routing_key: str | None = None,
    ) -> list[RouteChoice]:
        """(worker, predicted cached tokens) pairs, best first."""
        return list(self.plan(prompt_token_ids, salt, routing_key).choices)

    def plan(
        self,
        prompt_token_ids: Sequence[int],
        salt: TenantSalt | None,
        routing_key: str | None = None,
        only: Sequence[WorkerId] | None = None,
    ) -> RoutePlan:
        """Hash the prompt with the engine's own function, then :meth:`plan_blocks`."""
        hashes = hash_prompt_blocks(prompt_token_ids, self.block_size, salt)
        return self.plan_blocks(hashes, len(prompt_token_ids), routing_key, only)

    def plan_blocks(
        self,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        routing_key: str | None = None,
        only: Sequence[WorkerId] | None = None,
    ) -> RoutePlan:
        """Rank the healthy workers for a prompt given as block hashes. With ``only``,
        rank exactly those workers (ones the source does not know get zero load)."""
        if only is not None and len(only) == 1:
            return self._plan_one(block_hashes, num_prompt_tokens, only[0])
        common = self.popularity.common_blocks(block_hashes)
        self.popularity.observe(block_hashes)
        request = RouteRequest(num_prompt_tokens, self.block_size, routing_key, common)
        statuses = self._workers.healthy_workers()
        if only is not None:
            known = {s.worker_id: s for s in statuses}
            statuses = [known.get(w) or WorkerStatus(w, WorkerLoad(), False) for w in only]
        candidates = self.candidates(block_hashes, statuses)
        cached = {c.worker_id: c.cached_blocks for c in candidates}
        order = self.policy.rank(request, candidates)
        choices = tuple(
            RouteChoice(worker_id, request.cached_tokens(cached[worker_id])) for worker_id in order
        )
        return RoutePlan(tuple(block_hashes), num_prompt_tokens, choices)

    def _plan_one(self, block_hashes: Sequence[BlockHash], num_prompt_tokens: int,
                  worker_id: WorkerId) -> RoutePlan:
        """:meth:`plan_blocks` for a single candidate: the same plan (its predicted cached
        tokens as :meth:`candidates` would count them), without scoring."""
        self.popularity.observe(block_hashes)
        self._expire_inflight()
        events = any(s.worker_id == worker_id and s.kv_events
                     for s in self._workers.healthy_workers())
        self._event_workers = {worker_id} if events else set()
        cached_blocks = 0
        if block_hashes:
            index = self.precise if events else self.approx
            cached_blocks = index.match(block_hashes, (worker_id,))[worker_id]
            if events and self._recent is not None:
                recent = self._recent.match(block_hashes, (worker_id,))[worker_id]
                cached_blocks = max(cached_blocks, recent)
        cached_tokens = min(cached_blocks * self.block_size, num_prompt_tokens)
        return RoutePlan(tuple(block_hashes), num_prompt_tokens,
                         (RouteChoice(worker_id, cached_tokens),))

    def candidates(
        self, block_hashes: Sequence[BlockHash], statuses: Sequence[WorkerStatus]
    ) -> list[Candidate]:
        """Each worker with its predicted leading cached blocks and its load."""
        self._expire_inflight()
        precise_ids = [s.worker_id for s in statuses if s.kv_events]
        approx_ids = [s.worker_id for s in statuses if not s.kv_events]
        self._event_workers = set(precise_ids)
        matched = self.precise.match(block_hashes, precise_ids)
        matched.update(self.approx.match(block_hashes, approx_ids))
        if self._recent is not None:
            for worker_id, n in self._recent.match(block_hashes, precise_ids).items():
                matched[worker_id] = max(matched[worker_id], n)
        best = max(matched.values(), default=0)
        return [
            Candidate(
                s.worker_id,
                matched[s.worker_id],
                self._with_pending(s),
                shared_blocks=best - matched[s.worker_id]
                if s.load.shared_load_fraction is not None
                else 0,
            )
            for s in statuses
        ]

    def dispatched(self, request_id: str, plan: RoutePlan, worker_id: WorkerId) -> None:
        """The proxy is sending the request to ``worker_id`` (one of the plan's choices)."""
        self._finish(request_id)
        predicted = next(
            (c.predicted_cached_tokens for c in plan.choices if c.worker_id == worker_id), 0
        )
        pending = plan.num_prompt_tokens - predicted
        self._inflight[request_id] = _InFlight(worker_id, predicted, pending, self._clock())
        self._pending[worker_id] = self._pending.get(worker_id, 0) + pending
        if worker_id not in self._event_workers:
            self.approx.record(worker_id, plan.block_hashes)
        elif self._recent is not None:
            self._recent.record(worker_id, plan.block_hashes)

    def first_token(self, request_id: str) -> None:
        """The worker produced its first token: its prefill work is done."""
        entry = self._inflight.get(request_id)
        if entry is not None:
            self._release_pending(entry)

    def completed(self, request_id: str, reported_cached_tokens: int | None) -> None:
        """The request finished; ``reported_cached_tokens`` (from usage) feeds calibration."""
        entry = self._finish(request_id)
        if entry is not None and reported_cached_tokens is not None:
            self.calibration.record(entry.predicted_cached_tokens, reported_cached_tokens)

    def failed(self, request_id: str, *, worker_failed: bool) -> None:
        """The attempt ended without an answer; ``worker_failed`` marks the worker suspect."""
        entry = self._finish(request_id)
        if entry is not None and worker_failed:
            self._workers.report_failure(entry.worker_id)

    def inflight_worker(self, request_id: str) -> WorkerId | None:
        """Where an in-flight request was (last) dispatched."""
        entry = self._inflight.get(request_id)
        return entry.worker_id if entry is not None else None

    def predicted_cached_tokens(self, request_id: str) -> int | None:
        """What was predicted for an in-flight request on the worker it was sent to."""
        entry = self._inflight.get(request_id)
        return entry.predicted_cached_tokens if entry is not None else None

    def pending_tokens(self, worker_id: WorkerId) -> int:
        """Prompt tokens sent to ``worker_id`` that have not produced a first token."""
        return self._pending.get(worker_id, 0)

    def _with_pending(self, status: WorkerStatus) -> WorkerLoad:
        load = status.load
        pending = self._pending.get(status.worker_id, 0)
        if pending == load.pending_prefill_tokens:
            return load
        return replace(load, pending_prefill_tokens=pending)

    def _finish(self, request_id: str) -> _InFlight | None:
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            self._release_pending(entry)
        return entry

    def _release_pending(self, entry: _InFlight) -> None:
        if entry.pending_tokens:
            left = self._pending.get(entry.worker_id, 0) - entry.pending_tokens
            self._pending[entry.worker_id] = max(0, left)
            entry.pending_tokens = 0

    def _expire_inflight(self) -> None:
        """Forget requests the proxy never closed (a bug elsewhere must not skew load)."""
        if not self._inflight:
            return
        now = self._clock()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + EXPIRY_CHECK_S
        cutoff = now - self._inflight_ttl
        oldest = next(iter(self._inflight.values()))
        if oldest.started_at >= cutoff:
            return
        for request_id in [k for k, v in self._inflight.items() if v.started_at < cutoff]:
            self._finish(request_id)
