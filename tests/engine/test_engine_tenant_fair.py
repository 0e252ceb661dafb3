"""Tenant-fair scheduling (engine.tenant_fair): decayed usage, fair waiting order, and
short prefills of a lighter tenant interjected between two layers of a long step:
exact order on the tiny model, and the same tokens as without interjection."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
import torch

from engine.api import GenerationChunk, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.kv.hashing import TenantSalt
from engine.llm_engine import LLMEngine
from engine.runner import RunnerSeq
from engine.tenant_fair import FairnessConfig, TenantUsage

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
A, B = TenantSalt(b"a" * 16), TenantSalt(b"b" * 16)


@dataclass
class _Seq:
    name: str
    salt: TenantSalt | None


def test_usage_adds_computed_tokens_then_decays_by_the_steps_work() -> None:
    usage = TenantUsage(FairnessConfig(half_life_tokens=100, decode_weight=2.0))
    usage.account([(A, 50), (B, 1), (B, 49)])  # 100 tokens: one half-life
    assert usage.usage(A) == pytest.approx(25.0)
    assert usage.usage(B) == pytest.approx((2.0 + 49) / 2)  # a decode weighs 2
    usage.account([(B, 100)])
    assert usage.usage(A) == pytest.approx(12.5)
    assert usage.usage(B) == pytest.approx((25.5 + 100) / 2)
    usage.account([])  # no work, no decay
    assert usage.usage(A) == pytest.approx(12.5)


def test_usage_forgets_a_tenant_once_its_counter_is_negligible() -> None:
    usage = TenantUsage(FairnessConfig(half_life_tokens=1))
    usage.account([(A, 1)])
    usage.account([(B, 40)])
    assert usage.usage(A) == 0.0 and A not in usage._usage


def test_order_is_stable_by_usage_and_leaves_one_tenant_alone() -> None:
    usage = TenantUsage()
    usage.account([(B, 500), (None, 100)])
    queue = deque([_Seq("b1", B), _Seq("a1", A), _Seq("b2", B), _Seq("n1", None), _Seq("a2", A)])
    assert [s.name for s in usage.order(queue)] == ["a1", "a2", "n1", "b1", "b2"]
    same = deque([_Seq("b2", B), _Seq("b1", B)])
    assert usage.order(same) is same
    off = TenantUsage(FairnessConfig(enabled=False))
    off.account([(B, 500)])
    assert off.order(queue) is queue


def test_only_a_tenant_lighter_than_the_steps_other_tenants_may_interject() -> None:
    usage = TenantUsage()
    usage.account([(A, 10), (B, 300)])
    assert usage.may_interject(A, {B})
    assert not usage.may_interject(B, {A})  # heavier
    assert usage.may_interject(A, {A, B})  # A's own decode in the step: B is the other
    assert not usage.may_interject(A, {A})  # its own step only
    assert not usage.may_interject(A, set())
    assert not usage.may_interject(None, {None})  # one tenant: never
    assert not TenantUsage(FairnessConfig(enabled=False)).may_interject(A, {B})


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="half_life_tokens"):
        FairnessConfig(half_life_tokens=0)
    with pytest.raises(ValueError, match="decode_weight"):
        FairnessConfig(decode_weight=-1)


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(3 + (seed * 31 + i * 7) % 200 for i in range(n))


def _batch(engine: LLMEngine) -> list[tuple[str, int, int]]:
    out = engine.scheduler.schedule()
    engine.execute(out)
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_waiting_long_prefills_are_admitted_lightest_tenant_first(
    tiny_model: LoadedModel,
) -> None:
    engine = build_llm_engine(
        EngineConfig.tiny(max_num_batched_tokens=32, short_prefill_tokens=4), tiny_model
    )
    engine.add_request(GenerationRequest("b0", _prompt(0, 32), GREEDY, B))
    assert _batch(engine) == [("b0", 0, 32)]  # B has used 32 tokens
    engine.add_request(GenerationRequest("b1", _prompt(1, 40), GREEDY, B))
    engine.add_request(GenerationRequest("a1", _prompt(2, 40), GREEDY, A))
    # b0 decodes; A, lighter, is admitted ahead of b1 though it came later
    assert _batch(engine) == [("b0", 32, 1), ("a1", 0, 31)]


def test_the_same_order_without_fairness_is_arrival_order(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(
        EngineConfig.tiny(max_num_batched_tokens=32, short_prefill_tokens=4,
                          fair_scheduling=False), tiny_model)  # fmt: skip
    engine.add_request(GenerationRequest("b0", _prompt(0, 32), GREEDY, B))
    assert _batch(engine) == [("b0", 0, 32)]
    engine.add_request(GenerationRequest("b1", _prompt(1, 40), GREEDY, B))
    engine.add_request(GenerationRequest("a1", _prompt(2, 40), GREEDY, A))
    assert _batch(engine) == [("b0", 32, 1), ("b1", 0, 31)]


class _Hooks:
    """Adds ``arrivals`` at the first poll; records every event in order."""

    def __init__(self, engine: LLMEngine, arrivals: list[GenerationRequest]) -> None:
        self.engine = engine
        self.arrivals = arrivals
        self.events: list[tuple[str, str]] = []
        self.delivered: list[GenerationChunk] = []

    def poll(self) -> bool:
        self.events.append(("poll", ""))
        arrived, self.arrivals = self.arrivals, []
        for request in arrived:
            self.engine.add_request(request)
        return bool(arrived)

    def deliver(self, chunks: list[GenerationChunk]) -> None:
        self.delivered += chunks
        self.events.extend(("deliver", f"{c.request_id}:{len(c.token_ids)}") for c in chunks)


def _engine(tiny_model: LoadedModel, **overrides: object) -> LLMEngine:
    return build_llm_engine(
        EngineConfig.tiny(max_num_batched_tokens=64, short_prefill_tokens=8, **overrides),
        tiny_model,
    )


def _warm_a(engine: LLMEngine, stem: tuple[int, ...]) -> None:
    engine.generate_sync([GenerationRequest("warm", (*stem, 7), GREEDY, A)])


def test_a_lighter_tenants_cached_request_runs_between_two_layers_of_a_long_step(
    tiny_model: LoadedModel,
) -> None:
    engine = _engine(tiny_model)
    bs = engine.block_size
    stem = _prompt(9, 4 * bs)
    _warm_a(engine, stem)  # A has used 4 blocks' worth of tokens
    engine.add_request(GenerationRequest("b", _prompt(1, 200), GREEDY, B))
    _batch(engine)
    _batch(engine)  # B's first 128 tokens: B is now the heavier tenant
    assert engine.scheduler.fair.usage(B) > engine.scheduler.fair.usage(A)
    out = engine.scheduler.schedule()
    assert [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("b", 128, 64)
    ]
    hooks = _Hooks(engine, [GenerationRequest("hit", (*stem, 5, 6, 7), GREEDY, A)])
    chunks = engine.execute(out, hooks)
    # one poll after layer 0 of 2; the hit's prefill (3 tokens past its 4 cached
    # blocks) ran and its first token went out before B's step finished
    assert hooks.events == [("poll", ""), ("deliver", "hit:1")]
    assert chunks == []  # B's chunk samples nothing yet
    assert engine.num_interjections == 1
    hit = engine._requests["hit"][0]
    assert hit.num_cached_tokens == 4 * bs and hit.num_computed_tokens == 4 * bs + 3
    assert [s.request_id for s in engine.scheduler.running] == ["b", "hit"]
    assert engine._requests["b"][0].num_computed_tokens == 192


def test_interjection_leaves_every_answer_as_without_it(tiny_model: LoadedModel) -> None:
    stem = _prompt(9, 64)
    runs: list[dict[str, list[int]]] = []
    for fair in (True, False):
        engine = _engine(tiny_model, fair_scheduling=fair)
        _warm_a(engine, stem)
        engine.add_request(GenerationRequest("b", _prompt(1, 200), GREEDY, B))
        _batch(engine)
        _batch(engine)
        hooks = _Hooks(engine, [GenerationRequest("hit", (*stem, 5, 6, 7), GREEDY, A)])
        chunks = engine.step(hooks)
        if hooks.arrivals:  # nothing polled without fairness: it arrives after the step
            hooks.poll()
        while engine.has_unfinished():
            chunks += engine.step(hooks)
        tokens: dict[str, list[int]] = {"b": [], "hit": []}
        for c in hooks.delivered + chunks:
            tokens[c.request_id] += c.token_ids
        runs.append(tokens)
        assert engine.num_interjections == (1 if fair else 0)
    assert len(runs[0]["hit"]) == 3 and len(runs[0]["b"]) == 3
    assert runs[0] == runs[1]


def test_one_tenant_never_interjects_into_its_own_long_step(tiny_model: LoadedModel) -> None:
    engine = _engine(tiny_model)
    bs = engine.block_size
    stem = _prompt(9, 4 * bs)
    _warm_a(engine, stem)
    engine.add_request(GenerationRequest("long", _prompt(1, 200), GREEDY, A))
    out = engine.scheduler.schedule()
    hooks = _Hooks(engine, [GenerationRequest("hit", (*stem, 5), GREEDY, A)])
    engine.execute(out, hooks)  # one tenant has worked: the step runs whole, no poll
    assert hooks.events == [] and engine.num_interjections == 0
    assert engine.scheduler.fair.num_tenants == 1


def test_a_second_tenants_first_request_waits_for_the_step(tiny_model: LoadedModel) -> None:
    """Staging starts once two tenants have worked: until then a newcomer's request
    comes in between steps, like any request (a single-tenant worker never pays for
    a layer-at-a-time step)."""
    engine = _engine(tiny_model)
    engine.add_request(GenerationRequest("b", _prompt(1, 200), GREEDY, B))
    _batch(engine)
    out = engine.scheduler.schedule()
    assert engine.scheduler.step_tenants(out) == set()
    hooks = _Hooks(engine, [GenerationRequest("a", _prompt(2, 5), GREEDY, A)])
    engine.execute(out, hooks)
    assert hooks.events == [] and engine.num_interjections == 0  # a never came in mid-step
    engine.add_request(GenerationRequest("a", _prompt(2, 5), GREEDY, A))  # between steps
    assert ("a", 0, 5) in _batch(engine)  # beside b's chunk: both tenants have worked
    assert engine.scheduler.fair.num_tenants == 2
    assert engine.scheduler.step_tenants(engine.scheduler.schedule())  # staged from now on


def test_an_uncached_request_of_a_lighter_tenant_waits_for_the_step(
    tiny_model: LoadedModel,
) -> None:
    engine = _engine(tiny_model)
    _warm_a(engine, _prompt(3, 4))  # A has worked a little: two tenants, steps are staged
    engine.add_request(GenerationRequest("b", _prompt(1, 200), GREEDY, B))
    _batch(engine)
    out = engine.scheduler.schedule()
    hooks = _Hooks(engine, [GenerationRequest("a", _prompt(2, 40), GREEDY, A)])  # 40 > 8
    assert engine.scheduler.fair.usage(B) > engine.scheduler.fair.usage(A) > 0
    engine.execute(out, hooks)
    assert engine.num_interjections == 0
    assert [s.request_id for s in engine.scheduler.waiting] == ["a"]  # a normal step's work


def test_staged_forward_gives_the_logits_of_one_forward(tiny_model: LoadedModel) -> None:
    engine = _engine(tiny_model)
    batch = [
        RunnerSeq(_prompt(1, 20), 0, (0, 1), needs_logits=True),
        RunnerSeq(_prompt(2, 5), 0, (2,), needs_logits=True),
    ]
    whole = engine.runner.execute(batch)
    forward = engine.runner.start(batch)
    with pytest.raises(RuntimeError, match="before layer 0"):
        forward.logits()
    assert forward.advance(1) is True
    engine.runner.execute([RunnerSeq(_prompt(3, 7), 0, (5,), needs_logits=True)])  # in between
    assert forward.advance(1) is False
    assert torch.equal(forward.logits(), whole)


def test_an_abort_that_arrives_inside_a_step_waits_for_its_end(tiny_model: LoadedModel) -> None:
    from engine.async_engine import AsyncEngine, _Op

    engine = _engine(tiny_model)
    engine.add_request(GenerationRequest("b", _prompt(1, 200), GREEDY, B))
    runner = AsyncEngine(engine)
    runner._ops.put(_Op("abort", request_id="b"))
    runner._drain_ops(adds_only=True)  # as between two layers
    assert engine.has_unfinished() and runner._held_aborts == ["b"]
    runner._drain_ops()  # between steps
    assert not engine.has_unfinished() and runner._held_aborts == []


def test_a_cached_request_also_runs_inside_another_tenants_decode_step(
    tiny_model: LoadedModel,
) -> None:
    engine = _engine(tiny_model)
    bs = engine.block_size
    stem = _prompt(9, 4 * bs)
    _warm_a(engine, stem)
    engine.add_request(GenerationRequest("b", _prompt(1, 100), GREEDY, B))
    _batch(engine)
    _batch(engine)  # b's prompt is done: its next steps are decodes
    out = engine.scheduler.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1)]
    hooks = _Hooks(engine, [GenerationRequest("hit", (*stem, 5), GREEDY, A)])
    chunks = engine.execute(out, hooks)
    assert hooks.events == [("poll", ""), ("deliver", "hit:1")]
    assert [c.request_id for c in chunks] == ["b"]  # b's decode token, after the hit's


def test_a_tenant_decoding_in_the_step_may_still_interject_its_next_request(
    tiny_model: LoadedModel,
) -> None:
    engine = _engine(tiny_model)
    bs = engine.block_size
    stem = _prompt(9, 4 * bs)
    _warm_a(engine, stem)
    engine.add_request(GenerationRequest("b", _prompt(1, 150), GREEDY, B))
    _batch(engine)
    _batch(engine)
    engine.add_request(GenerationRequest("hit1", (*stem, 4), GREEDY, A))
    assert _batch(engine) == [("hit1", 4 * bs, 1)]  # the short rule: b's chunk waits a step
    out = engine.scheduler.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("b", 22), ("hit1", 1)]  # fmt: skip
    hooks = _Hooks(engine, [GenerationRequest("hit2", (*stem, 5), GREEDY, A)])
    engine.execute(out, hooks)
    assert hooks.events == [("poll", ""), ("deliver", "hit2:1")]
