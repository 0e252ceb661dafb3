"""The router and the shared KV tier: blocks another worker holds count for a worker
with a shared tier as cheaper than recompute and dearer than resident, at the load
cost the worker measured (its ``/load`` ``tier_load_fraction``)."""

from __future__ import annotations

from engine.api import KVEvent, KVEventKind
from engine.kv.hashing import TenantSalt, hash_prompt_blocks
from proxy.routing.policies.cache_aware import CacheAwarePolicy
from proxy.routing.policy import make_policy
from proxy.routing.registry import parse_load
from proxy.routing.router import PrefixRouter, WorkerStatus
from proxy.routing.types import Candidate, RouteRequest, WorkerId, WorkerLoad

BS = 16
SALT = TenantSalt(b"a" * 16)
W = [WorkerId(f"w{i}") for i in range(3)]


def test_shared_blocks_cost_between_resident_and_recompute() -> None:
    policy = CacheAwarePolicy()
    request = RouteRequest(num_prompt_tokens=640, block_size=BS)
    resident = policy.cost(request, Candidate(W[0], 40, WorkerLoad()))
    tier = WorkerLoad(shared_load_fraction=0.2)
    shared = policy.cost(request, Candidate(W[1], 0, tier, shared_blocks=40))
    recompute = policy.cost(request, Candidate(W[2], 0, WorkerLoad()))
    assert resident < shared < recompute
    assert shared == 8.0 * 0.2 * 640  # prefill_weight x the measured fraction of the work
    no_tier = policy.cost(request, Candidate(W[2], 0, WorkerLoad(), shared_blocks=40))
    assert no_tier == recompute


class Source:
    def __init__(self, loads: dict[WorkerId, WorkerLoad]) -> None:
        self.loads = loads

    def healthy_workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(w, load, True) for w, load in self.loads.items()]

    def report_failure(self, worker_id: WorkerId) -> None:
        pass


def test_router_counts_another_workers_prefix_for_tiered_workers_only() -> None:
    busy = WorkerLoad(num_running=4)
    loads = {
        W[0]: busy,
        W[1]: WorkerLoad(shared_load_fraction=0.1),
        W[2]: WorkerLoad(),
    }
    router = PrefixRouter(make_policy("cache_aware"), Source(loads), BS)
    prefix = list(range(640))
    hashes = tuple(hash_prompt_blocks(prefix, BS, SALT))
    router.precise.apply_events(W[0], [KVEvent(0, KVEventKind.STORED, hashes)])
    candidates = {
        c.worker_id: c for c in router.candidates(list(hashes), router._workers.healthy_workers())
    }
    assert (candidates[W[0]].cached_blocks, candidates[W[0]].shared_blocks) == (40, 0)
    assert (candidates[W[1]].cached_blocks, candidates[W[1]].shared_blocks) == (0, 40)
    assert candidates[W[2]].shared_blocks == 0  # no shared tier: nothing reachable
    choices = router.rank([*prefix, 7], SALT)
    # w0 holds the prefix but is busy; w1 loads it from the shared tier at 10% of the
    # prefill; w2 would recompute all of it
    assert [c.worker_id for c in choices] == [W[1], W[0], W[2]]


def test_load_reports_the_fraction_within_bounds() -> None:
    assert parse_load({"tier_load_fraction": 0.25}).shared_load_fraction == 0.25
    assert parse_load({"tier_load_fraction": 3}).shared_load_fraction == 1.0
    assert parse_load({"tier_load_fraction": "x"}).shared_load_fraction is None
    assert parse_load({}).shared_load_fraction is None
