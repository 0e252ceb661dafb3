"""PrefixRouter: engine-identical hashing, precise/approximate prediction, in-flight
load, calibration, and the global-system-prompt case with no load at all."""

from __future__ import annotations

from collections import Counter

from engine.api import KVEvent, KVEventKind
from engine.kv.hashing import TenantSalt, hash_prompt_blocks
from proxy.routing.calibration import CalibrationStats
from proxy.routing.policy import make_policy
from proxy.routing.router import EXPIRY_CHECK_S, PrefixRouter, WorkerStatus
from proxy.routing.types import WorkerId, WorkerLoad

BS = 16
W = [WorkerId(f"w{i}") for i in range(3)]
SALT_A = TenantSalt(b"a" * 16)
SALT_B = TenantSalt(b"b" * 16)


class StaticSource:
    """A fixed pool (the registry's job live); records failure reports."""

    def __init__(self, kv_events: bool = True) -> None:
        self.kv_events = kv_events
        self.failed: list[WorkerId] = []
        self.down: set[WorkerId] = set()

    def healthy_workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(w, WorkerLoad(), self.kv_events) for w in W if w not in self.down]

    def report_failure(self, worker_id: WorkerId) -> None:
        self.failed.append(worker_id)
        self.down.add(worker_id)


def store(router: PrefixRouter, worker: WorkerId, tokens: list[int], salt: TenantSalt) -> None:
    seq = router.precise.next_seq(worker)
    hashes = tuple(hash_prompt_blocks(tokens, BS, salt))
    router.precise.apply_events(worker, [KVEvent(seq, KVEventKind.STORED, hashes)])


def test_prediction_uses_the_engines_block_hashes_and_respects_the_salt() -> None:
    router = PrefixRouter(make_policy("cache_aware"), StaticSource(), BS)
    prefix = list(range(200))
    store(router, W[2], prefix, SALT_A)
    choices = router.rank([*prefix, 7, 7, 7], SALT_A)
    assert choices[0].worker_id == W[2]
    assert choices[0].predicted_cached_tokens == 192  # 12 full blocks of 16
    other_tenant = router.rank([*prefix, 7, 7, 7], SALT_B)
    assert all(c.predicted_cached_tokens == 0 for c in other_tenant)


def test_approximate_mode_remembers_what_was_sent_where() -> None:
    router = PrefixRouter(make_policy("cache_aware"), StaticSource(kv_events=False), BS)
    prompt = list(range(300))
    plan = router.plan(prompt, SALT_A)
    target = plan.choices[0].worker_id
    router.dispatched("r1", plan, target)
    router.first_token("r1")
    router.completed("r1", 0)
    again = router.plan([*prompt, 1, 2, 3], SALT_A)
    assert again.choices[0].worker_id == target
    assert again.choices[0].predicted_cached_tokens == 288


def test_in_flight_prefill_work_counts_until_the_first_token() -> None:
    router = PrefixRouter(make_policy("least_loaded"), StaticSource(), BS)
    plan = router.plan(list(range(100)), SALT_A)
    router.dispatched("r1", plan, W[1])
    assert router.pending_tokens(W[1]) == 100
    assert router.plan(list(range(500, 600)), SALT_A).choices[-1].worker_id == W[1]
    router.first_token("r1")
    assert router.pending_tokens(W[1]) == 0


def test_calibration_records_predicted_against_reported() -> None:
    router = PrefixRouter(make_policy("cache_aware"), StaticSource(), BS)
    store(router, W[0], list(range(64)), SALT_A)
    plan = router.plan(list(range(80)), SALT_A)
    router.dispatched("r1", plan, W[0])
    router.completed("r1", 48)
    snap = router.calibration.snapshot()
    assert (snap.num_requests, snap.sum_predicted_tokens, snap.sum_reported_tokens) == (1, 64, 48)
    assert snap.sum_error_tokens == 16 and snap.num_exact == 0
    assert dict(snap.buckets)[16] == 1


def test_calibration_histogram_is_cumulative() -> None:
    stats = CalibrationStats(bucket_bounds=(0, 10, 100))
    for predicted, reported in [(5, 5), (20, 15), (0, 50), (500, 0)]:
        stats.record(predicted, reported)
    snap = stats.snapshot()
    assert snap.buckets == ((0, 1), (10, 2), (100, 3), (float("inf"), 4))
    assert snap.mean_abs_error_tokens == (0 + 5 + 50 + 500) / 4


def test_a_failed_attempt_reports_the_worker_and_frees_its_load() -> None:
    source = StaticSource()
    router = PrefixRouter(make_policy("round_robin"), source, BS)
    plan = router.plan(list(range(40)), SALT_A)
    router.dispatched("r1", plan, W[0])
    router.failed("r1", worker_failed=True)
    assert source.failed == [W[0]] and router.pending_tokens(W[0]) == 0
    assert W[0] not in [c.worker_id for c in router.rank(list(range(40)), SALT_A)]


def test_only_ranks_the_given_workers_and_unknown_ones_get_zero_load() -> None:
    router = PrefixRouter(make_policy("round_robin"), StaticSource(), BS)
    names = [W[1], WorkerId("in-process")]
    ranked = router.plan(list(range(40)), SALT_A, only=names).choices
    assert sorted(c.worker_id for c in ranked) == sorted(names)


def test_a_global_system_prompt_does_not_pull_sequential_traffic_to_one_worker() -> None:
    """Idle fleet, one request at a time, every prompt = a 64-token system prompt plus a
    short distinct question: whoever first cached the system prompt must not get all."""
    router = PrefixRouter(make_policy("cache_aware"), StaticSource(), BS)
    system = list(range(1000, 1064))
    chosen: Counter[WorkerId] = Counter()
    for i in range(30):
        prompt = [*system, *range(i * 100, i * 100 + 20)]
        plan = router.plan(prompt, SALT_A)
        worker = plan.choices[0].worker_id
        router.dispatched(f"r{i}", plan, worker)
        store(router, worker, prompt, SALT_A)
        router.first_token(f"r{i}")
        router.completed(f"r{i}", plan.choices[0].predicted_cached_tokens)
        chosen[worker] += 1
    assert set(chosen) == set(W)
    assert max(chosen.values()) <= 15


def test_metrics_collector_exports_the_prediction_error_histogram() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from proxy.routing.metrics import RoutingCollector

    router = PrefixRouter(make_policy("cache_aware"), StaticSource(), BS)
    store(router, W[0], list(range(64)), SALT_A)
    plan = router.plan(list(range(80)), SALT_A)
    router.dispatched("r1", plan, W[0])
    router.completed("r1", 32)
    registry = CollectorRegistry()
    registry.register(RoutingCollector(router))
    text = generate_latest(registry).decode()
    assert 'kvtoll_router_prediction_error_tokens_bucket{le="16.0"} 0.0' in text
    assert 'kvtoll_router_prediction_error_tokens_bucket{le="64.0"} 1.0' in text
    assert "kvtoll_router_prediction_error_tokens_sum 32.0" in text
    assert "kvtoll_router_prediction_signed_error_tokens_total 32.0" in text


def _routers(kv_events: bool) -> tuple[PrefixRouter, PrefixRouter]:
    """Two routers fed the same history: one ranks a single candidate (the fast path),
    the other ranks it beside a second worker (the scoring path)."""
    routers = (PrefixRouter(make_policy("cache_aware"), StaticSource(kv_events), BS),
               PrefixRouter(make_policy("cache_aware"), StaticSource(kv_events), BS))
    for router in routers:
        store(router, W[0], list(range(64)), SALT_A)  # precise: 4 blocks on w0
        plan = router.plan(list(range(48)), SALT_A, only=[W[0], W[1]])
        router.dispatched("sent", plan, W[0])  # approx and recent: 3 blocks sent to w0
        router.completed("sent", 48)
    return routers


def test_a_single_candidate_is_planned_as_the_scoring_path_would() -> None:
    for kv_events in (True, False):
        one, many = _routers(kv_events)
        for prompt in ([], list(range(10)), list(range(100)), list(range(40))):
            single = one.plan(prompt, SALT_A, only=[W[0]])
            scored = many.plan(prompt, SALT_A, only=[W[0], W[1]])
            assert single.block_hashes == scored.block_hashes
            assert single.choices == tuple(c for c in scored.choices if c.worker_id == W[0])
        unknown = one.plan(list(range(100)), SALT_A, only=[WorkerId("elsewhere")])
        assert unknown.choices[0].predicted_cached_tokens == 0


def test_a_single_candidate_keeps_the_load_and_index_bookkeeping() -> None:
    for kv_events in (True, False):
        one, many = _routers(kv_events)
        prompt = list(range(200, 300))
        for router, only in ((one, [W[2]]), (many, [W[2], W[1]])):
            plan = router.plan(prompt, SALT_A, only=only)
            router.dispatched("r", plan, W[2])
        assert one.pending_tokens(W[2]) == many.pending_tokens(W[2]) == 100
        one.first_token("r")
        assert one.pending_tokens(W[2]) == 0
        one.completed("r", 0)
        # what was sent to w2 now predicts its cache (approx index, or recent blocks)
        again = one.plan(prompt, SALT_A, only=[W[2]])
        assert again.choices[0].predicted_cached_tokens == 96


def test_unclosed_requests_expire_at_most_once_per_check_interval() -> None:
    now = [0.0]
    router = PrefixRouter(make_policy("cache_aware"), StaticSource(), BS,
                          inflight_ttl_s=0.1, clock=lambda: now[0])
    router.dispatched("lost", router.plan(list(range(32)), SALT_A), W[0])
    now[0] = 0.2
    router.plan([], SALT_A)  # checked: "lost" is past its ttl
    assert router.inflight_worker("lost") is None and router.pending_tokens(W[0]) == 0
    router.dispatched("lost2", router.plan(list(range(32)), SALT_A, only=[W[0]]), W[0])
    now[0] = 0.2 + EXPIRY_CHECK_S / 2
    router.plan([], SALT_A, only=[W[0]])  # past its ttl, but checked too recently
    assert router.inflight_worker("lost2") == W[0]
    now[0] = 0.2 + EXPIRY_CHECK_S
    router.plan([], SALT_A, only=[W[0]])  # the single-candidate path checks as well
    assert router.inflight_worker("lost2") is None and router.pending_tokens(W[0]) == 0
