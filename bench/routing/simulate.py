"""Event-driven replay of a request trace through a simulated fleet of workers.

Each simulated worker::

    arrival --route--> [FIFO prefill queue] --prefill--> [decoding set] --> done
                                             |
                         cache lookup + admit at prefill start (LRU of blocks);
                         stored/removed KV events -> the router's PreciseIndex

* KV cache: an LRU of ``cache_tokens / block_size`` blocks; a prompt hits its longest
  cached leading run of blocks; its blocks are then touched / inserted, evicting the
  least recently used ones.
* Prefill: one request at a time, ``uncached_tokens / prefill_tokens_per_s +
  prefill_overhead_s`` seconds, stretched by ``1 + decode_slowdown × decoding``
  (decode steps share the GPU with chunked prefill).
* Decode: ``output_length × decode_s_per_token`` seconds after the first token.
* TTFT = first token time − arrival time.

Routing goes through the live :class:`PrefixRouter` with the policy under test, the
same :class:`PreciseIndex` (fed by the caches' events) and the same load accounting;
with ``kv_events=False`` the caches' events are dropped and the router relies on its
:class:`ApproxIndex` (what it sent where, an LRU as large as a worker's cache + TTL).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.routing.sim_report import SimReport, build_report
from bench.routing.trace import TraceRequest
from engine.api import KVEvent, KVEventKind
from engine.kv.hashing import BlockHash
from proxy.routing.index import ApproxIndex
from proxy.routing.policy import Policy
from proxy.routing.router import PrefixRouter, WorkerStatus
from proxy.routing.types import WorkerId, WorkerLoad

MAX_WORKERS = 4096


@dataclass(frozen=True)
class SimConfig:
    """The simulated fleet (see the module header for the model)."""

    num_workers: int = 4
    cache_tokens: int = 3_072_000
    block_size: int = 512
    prefill_tokens_per_s: float = 16_000.0
    prefill_overhead_s: float = 0.02
    decode_s_per_token: float = 0.03
    decode_slowdown: float = 0.01
    kv_events: bool = True  # False: the router only has its approximate index
    approx_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.num_workers <= 0 or self.block_size <= 0 or not self.prefill_tokens_per_s > 0:
            raise ValueError("num_workers, block_size and prefill_tokens_per_s must be positive")
        if self.num_workers > MAX_WORKERS or not math.isfinite(self.prefill_tokens_per_s):
            raise ValueError(f"num_workers must be at most {MAX_WORKERS} and "
                             "prefill_tokens_per_s finite")
        if self.cache_tokens < self.block_size:
            raise ValueError("cache_tokens must hold at least one block")


class LRUBlockCache:
    """A worker's prefix cache: block hashes in LRU order, emitting ordered KV events."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def leading_hits(self, block_hashes: Sequence[BlockHash]) -> int:
        count = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            count += 1
        return count

    def admit(self, block_hashes: Sequence[BlockHash]) -> list[KVEvent]:
        """Touch/insert the prompt's blocks (root most recent); the events this caused."""
        stored: list[BlockHash] = []
        removed: list[BlockHash] = []
        for h in reversed(block_hashes[: self.capacity_blocks]):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                stored.append(h)
        while len(self._blocks) > self.capacity_blocks:
            removed.append(self._blocks.popitem(last=False)[0])
        events = []
        for kind, hashes in ((KVEventKind.REMOVED, removed), (KVEventKind.STORED, stored)):
            if hashes:
                events.append(KVEvent(self._next_seq, kind, tuple(hashes)))
                self._next_seq += 1
        return events


@dataclass
class _Job:
    request_id: str
    request: TraceRequest
    cached_tokens: int = 0


@dataclass
class SimWorker:
    """Queue, cache and counters of one simulated worker."""

    worker_id: WorkerId
    cache: LRUBlockCache
    queue: deque[_Job] = field(default_factory=deque)
    prefilling: _Job | None = None
    num_decoding: int = 0
    pinned_blocks: int = 0
    num_requests: int = 0
    prefill_tokens: int = 0

    def load(self) -> WorkerLoad:
        total = self.cache.capacity_blocks
        return WorkerLoad(
            num_running=self.num_decoding + (self.prefilling is not None),
            num_waiting=len(self.queue),
            num_free_blocks=max(0, total - self.pinned_blocks),
            num_total_blocks=total,
        )


class SimFleet:
    """The simulated workers, seen by the router as its :class:`WorkerSource`."""

    def __init__(self, config: SimConfig) -> None:
        self.kv_events = config.kv_events
        capacity = config.cache_tokens // config.block_size
        self.workers = {
            WorkerId(f"sim-{i}"): SimWorker(WorkerId(f"sim-{i}"), LRUBlockCache(capacity))
            for i in range(config.num_workers)
        }

    def healthy_workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(w.worker_id, w.load(), self.kv_events) for w in self.workers.values()]

    def report_failure(self, worker_id: WorkerId) -> None:
        raise RuntimeError("simulated workers never fail")


_ARRIVE, _PREFILL_DONE, _DECODE_DONE = 0, 1, 2


class Simulation:
    """One replay of a trace under one policy."""

    def __init__(self, config: SimConfig, policy: Policy) -> None:
        self.config = config
        self.fleet = SimFleet(config)
        capacity = config.cache_tokens // config.block_size
        approx = ApproxIndex(capacity, config.approx_ttl_s, clock=self._now)
        self.router = PrefixRouter(
            policy, self.fleet, config.block_size, approx=approx, clock=self._now
        )
        self._time = 0.0
        self._events: list[tuple[float, int, int, WorkerId | None, _Job]] = []
        self._seq = 0
        self._ttfts: list[float] = []
        self._cached_tokens = 0

    def _now(self) -> float:
        return self._time

    def run(self, requests: Sequence[TraceRequest]) -> SimReport:
        """Replay ``requests`` (sorted by arrival) to the end; the figures."""
        started = time.perf_counter()
        for i, r in enumerate(requests):
            self._push(r.arrival_s, _ARRIVE, None, _Job(f"r{i}", r))
        while self._events:
            t, _, kind, worker_id, job = heapq.heappop(self._events)
            self._time = t
            if kind == _ARRIVE:
                self._arrive(job)
            elif kind == _PREFILL_DONE:
                self._prefill_done(self._worker(worker_id), job)
            else:
                self._decode_done(self._worker(worker_id), job)
        return build_report(
            self.router.policy.name,
            requests,
            self._ttfts,
            self._cached_tokens,
            list(self.fleet.workers.values()),
            self.router.calibration.snapshot(),
            time.perf_counter() - started,
        )

    def _push(self, t: float, kind: int, worker_id: WorkerId | None, job: _Job) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, worker_id, job))
        self._seq += 1

    def _worker(self, worker_id: WorkerId | None) -> SimWorker:
        if worker_id is None:
            raise RuntimeError("worker event without a worker")
        return self.fleet.workers[worker_id]

    def _arrive(self, job: _Job) -> None:
        r = job.request
        plan = self.router.plan_blocks(r.block_hashes, r.input_length, r.session_key)
        worker = self.fleet.workers[plan.choices[0].worker_id]
        self.router.dispatched(job.request_id, plan, worker.worker_id)
        worker.queue.append(job)
        worker.num_requests += 1
        worker.pinned_blocks += len(r.block_hashes)
        if worker.prefilling is None:
            self._start_prefill(worker)

    def _start_prefill(self, worker: SimWorker) -> None:
        job = worker.queue.popleft()
        r = job.request
        hits = worker.cache.leading_hits(r.block_hashes)
        job.cached_tokens = min(r.input_length, hits * self.config.block_size)
        events = worker.cache.admit(r.block_hashes)
        if self.config.kv_events:
            self.router.precise.apply_events(worker.worker_id, events)
        uncached = r.input_length - job.cached_tokens
        worker.prefill_tokens += uncached
        cfg = self.config
        duration = (uncached / cfg.prefill_tokens_per_s + cfg.prefill_overhead_s) * (
            1.0 + cfg.decode_slowdown * worker.num_decoding
        )
        worker.prefilling = job
        self._push(self._time + duration, _PREFILL_DONE, worker.worker_id, job)

    def _prefill_done(self, worker: SimWorker, job: _Job) -> None:
        self._ttfts.append(self._time - job.request.arrival_s)
        self._cached_tokens += job.cached_tokens
        self.router.first_token(job.request_id)
        worker.prefilling = None
        worker.num_decoding += 1
        decode_s = job.request.output_length * self.config.decode_s_per_token
        self._push(self._time + decode_s, _DECODE_DONE, worker.worker_id, job)
        if worker.queue:
            self._start_prefill(worker)

    def _decode_done(self, worker: SimWorker, job: _Job) -> None:
        worker.num_decoding -= 1
        worker.pinned_blocks -= len(job.request.block_hashes)
        self.router.completed(job.request_id, job.cached_tokens)


def simulate(requests: Sequence[TraceRequest], config: SimConfig, policy: Policy) -> SimReport:
    """Replay ``requests`` under ``policy``; see :class:`SimReport` for the figures."""
    return Simulation(config, policy).run(requests)
