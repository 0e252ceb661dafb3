"""Routing policies: each ranking rule, and cache_aware's load protection."""

from __future__ import annotations

from collections import Counter

import pytest

from proxy.routing.policies.cache_aware import CacheAwareParams, CacheAwarePolicy
from proxy.routing.policies.consistent_hash import ConsistentHashPolicy
from proxy.routing.policies.least_loaded import LeastLoadedPolicy
from proxy.routing.policies.round_robin import RoundRobinPolicy
from proxy.routing.policy import POLICY_NAMES, make_policy
from proxy.routing.types import Candidate, RouteRequest, WorkerId, WorkerLoad

W = [WorkerId(f"w{i}") for i in range(4)]
REQUEST = RouteRequest(num_prompt_tokens=1600, block_size=16)


def cands(cached: list[int], loads: list[WorkerLoad] | None = None) -> list[Candidate]:
    loads = loads or [WorkerLoad()] * len(cached)
    return [Candidate(W[i], cached[i], loads[i]) for i in range(len(cached))]


def test_every_policy_ranks_each_candidate_once() -> None:
    for name in POLICY_NAMES:
        policy = make_policy(name)
        ranked = policy.rank(RouteRequest(100, 16, "k"), cands([0, 3, 1, 2]))
        assert sorted(ranked) == sorted(W), name
        assert policy.name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_round_robin_rotates() -> None:
    policy = RoundRobinPolicy()
    firsts = [policy.rank(REQUEST, cands([0, 0, 0]))[0] for _ in range(6)]
    assert firsts == [W[0], W[1], W[2], W[0], W[1], W[2]]


def test_least_loaded_orders_by_outstanding_requests() -> None:
    loads = [WorkerLoad(num_running=5), WorkerLoad(num_waiting=1), WorkerLoad(num_running=2)]
    assert LeastLoadedPolicy().rank(REQUEST, cands([9, 0, 0], loads)) == [W[1], W[2], W[0]]


def test_consistent_hash_is_sticky_and_moves_only_a_departed_workers_keys() -> None:
    policy = ConsistentHashPolicy()
    keys = [f"session-{i}" for i in range(200)]
    first = {k: policy.rank(RouteRequest(100, 16, k), cands([0] * 4))[0] for k in keys}
    again = {k: policy.rank(RouteRequest(100, 16, k), cands([0] * 4))[0] for k in keys}
    assert first == again
    assert len(set(first.values())) == 4  # virtual nodes spread keys over every worker
    without_w3 = {k: policy.rank(RouteRequest(100, 16, k), cands([0] * 3))[0] for k in keys}
    for k in keys:
        if first[k] != W[3]:
            assert without_w3[k] == first[k]


def test_cache_aware_prefers_the_holder_of_a_long_prefix() -> None:
    ranked = CacheAwarePolicy().rank(REQUEST, cands([0, 90, 40, 0]))
    assert ranked[:2] == [W[1], W[2]]


def test_cache_aware_leaves_a_holder_that_is_far_busier() -> None:
    busy = WorkerLoad(num_running=4, pending_prefill_tokens=20_000)
    ranked = CacheAwarePolicy().rank(REQUEST, cands([90, 0], [busy, WorkerLoad()]))
    assert ranked[0] == W[1]


def test_cache_aware_falls_back_to_load_when_the_fleet_is_imbalanced() -> None:
    params = CacheAwareParams(balance_abs_threshold=4, balance_rel_threshold=1.5)
    loads = [WorkerLoad(num_waiting=10), WorkerLoad(num_waiting=1)]
    policy = CacheAwarePolicy(params)
    assert policy.is_imbalanced(cands([100, 0], loads))
    assert policy.rank(REQUEST, cands([100, 0], loads))[0] == W[1]


def test_cache_aware_ignores_small_and_common_matches() -> None:
    policy = CacheAwarePolicy(CacheAwareParams(cache_threshold=0.25))
    assert policy.cache_benefit(REQUEST, 20) == 0  # 320 of 1600 tokens < 25 %
    assert policy.cache_benefit(REQUEST, 50) == 800
    common = RouteRequest(1600, 16, num_common_blocks=30)
    assert policy.cache_benefit(common, 30) == 0  # only the shared system prompt
    assert policy.cache_benefit(common, 50) == 20 * 16  # the part beyond it


def test_cache_aware_spreads_a_shared_prefix_under_load() -> None:
    """Every request shares a 60-block prefix that w0 holds; queued work must spread."""
    policy = CacheAwarePolicy()
    pending = [0, 0, 0, 0]
    holders = {0}
    chosen: Counter[WorkerId] = Counter()
    for _ in range(40):
        loads = [WorkerLoad(pending_prefill_tokens=p) for p in pending]
        cached = [60 if i in holders else 0 for i in range(4)]
        first = policy.rank(REQUEST, cands(cached, loads))[0]
        i = W.index(first)
        pending[i] += REQUEST.uncached_tokens(cached[i])
        holders.add(i)
        chosen[first] += 1
    assert len(chosen) == 4
    assert max(chosen.values()) <= 20  # no worker takes more than half


def test_ties_rotate_instead_of_piling_on_the_first_worker() -> None:
    policy = CacheAwarePolicy()
    firsts = {policy.rank(REQUEST, cands([0, 0, 0, 0]))[0] for _ in range(8)}
    assert firsts == set(W)
