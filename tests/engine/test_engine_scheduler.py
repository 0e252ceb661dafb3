"""Scheduler with the tiny model: chunked prefill under the token budget, decodes
mixed with prefill chunks, preemption completes everything, admission refusal."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.api import EngineRejected, FinishReason, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _req(rid: str, n_prompt: int, params: SamplingParams = GREEDY) -> GenerationRequest:
    return GenerationRequest(rid, tuple(3 + (i * 7) % 200 for i in range(n_prompt)), params)


def _batch(engine: LLMEngine) -> list[tuple[str, int, int]]:
    out = engine.scheduler.schedule()
    engine.execute(out)
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_respects_budget_and_mixes_with_decodes(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(EngineConfig.tiny(max_num_batched_tokens=10), tiny_model)
    engine.add_request(_req("short", 3))
    assert _batch(engine) == [("short", 0, 3)]
    engine.add_request(_req("long", 25))
    assert _batch(engine) == [("short", 3, 1), ("long", 0, 9)]  # a decode + a prefill chunk
    assert _batch(engine) == [("short", 4, 1), ("long", 9, 9)]
    assert _batch(engine) == [("short", 5, 1), ("long", 18, 7)]  # long's prefill completes
    assert _batch(engine) == [("short", 6, 1), ("long", 25, 1)]
    short = engine._requests["short"][0]
    long = engine._requests["long"][0]
    assert short.num_output_tokens == 5 and long.num_output_tokens == 2


def test_preemption_under_tiny_block_budget_completes_every_request(
    tiny_model: LoadedModel,
) -> None:
    engine = build_llm_engine(
        EngineConfig.tiny(num_kv_blocks=6, max_num_batched_tokens=64), tiny_model
    )
    reqs = [
        _req(f"r{i}", 20 + i, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        for i in range(5)
    ]
    out = engine.generate_sync(reqs)
    for r in reqs:
        last = out[r.request_id][0][-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert last.completion_tokens == 40
        assert sum(len(c.token_ids) for c in out[r.request_id][0]) == 40
    assert engine.num_preemptions > 0
    assert engine.kv.pool.num_free_blocks == 6


def test_request_that_cannot_fit_an_empty_cache_is_refused(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(EngineConfig.tiny(num_kv_blocks=4), tiny_model)  # 64 tokens
    with pytest.raises(EngineRejected, match="max_tokens"):
        engine.add_request(_req("big", 40, SamplingParams(max_tokens=30)))
    assert not engine.has_unfinished()
    out = engine.generate_sync([_req("ok", 40, SamplingParams(max_tokens=24, temperature=0.0))])
    assert out["ok"][0][-1].finish_reason is not None
    assert engine.kv.pool.num_free_blocks == 4


def test_max_num_seqs_caps_the_running_batch(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(EngineConfig.tiny(max_num_seqs=2), tiny_model)
    for i in range(4):
        engine.add_request(_req(f"r{i}", 5))
    engine.step()
    assert len(engine.scheduler.running) == 2
    assert len(engine.scheduler.waiting) == 2


def test_choices_after_the_first_start_from_its_cached_prompt(tiny_model: LoadedModel) -> None:
    """n=3 over a 40-token prompt: choice 0 prefills it; choices 1 and 2 join in the
    next step and compute only the last, partial block; greedy choices agree with n=1."""
    config = EngineConfig.tiny(max_num_batched_tokens=64)
    bs = config.block_size
    engine = build_llm_engine(config, tiny_model)
    three = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=3)
    engine.add_request(_req("r", 40, three))
    assert _batch(engine) == [("r", 0, 40)]  # only choice 0
    full = 40 // bs * bs
    assert _batch(engine) == [("r", 40, 1), ("r", full, 40 - full), ("r", full, 40 - full)]
    choices = engine._requests["r"]
    assert [s.num_cached_tokens for s in choices] == [0, full, full]
    while engine.has_unfinished():
        engine.step()
    outputs = {tuple(s.output_token_ids) for s in choices}
    alone = build_llm_engine(config, tiny_model).generate_sync(
        [_req("one", 40, replace(three, n=1))]
    )
    assert outputs == {tuple(t for c in alone["one"][0] for t in c.token_ids)}


def test_aborting_while_later_choices_wait_finishes_every_choice(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(EngineConfig.tiny(max_num_batched_tokens=8), tiny_model)
    engine.add_request(_req("r", 30, SamplingParams(max_tokens=4, temperature=0.0, n=2)))
    _batch(engine)  # choice 0's first prefill chunk; choice 1 is held back
    chunks = engine.abort_request("r")
    assert sorted(c.index for c in chunks) == [0, 1]
    assert all(c.finish_reason == FinishReason.ABORT for c in chunks)
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_kv_share_reserves_a_tenants_prefix_under_another_tenants_flood(
    tiny_model: LoadedModel,
) -> None:
    from engine.api import KVShare
    from engine.kv.hashing import TenantSalt

    engine = build_llm_engine(EngineConfig.tiny(num_kv_blocks=12), tiny_model)
    bs = engine.block_size
    a, b = TenantSalt(b"a" * 16), TenantSalt(b"b" * 16)
    prompt = tuple(3 + i % 100 for i in range(3 * bs + 1))
    with pytest.raises(EngineRejected, match="exceeds this worker's pool of 12 blocks"):
        engine.add_request(GenerationRequest("big", prompt, GREEDY, a, KVShare("a", 13)))
    share = KVShare("a", reserved_blocks=3)
    engine.generate_sync([GenerationRequest("a0", prompt, GREEDY, a, share)])
    flood = [
        GenerationRequest(f"b{i}", tuple(100 + i * 7 + j % 50 for j in range(4 * bs)), GREEDY, b)
        for i in range(8)
    ]
    for request in flood:  # each fits beside the reservation: it never has to dip into it
        engine.generate_sync([request])
    assert engine.kv.pool.tenants.get(b).num_evicted > 0
    out = engine.generate_sync([GenerationRequest("a1", prompt, GREEDY, a, share)])
    assert out["a1"][0][0].cached_tokens == 3 * bs
    assert engine.kv.pool.tenants.get(a).num_evicted == 0


def test_a_cached_short_prefill_runs_ahead_of_long_prefills(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(
        EngineConfig.tiny(max_num_batched_tokens=64, short_prefill_tokens=16), tiny_model
    )
    bs = engine.block_size
    stem = tuple(3 + i % 90 for i in range(4 * bs))
    engine.generate_sync([GenerationRequest("warm", (*stem, 7), GREEDY)])
    engine.add_request(_req("long1", 200))
    engine.add_request(_req("long2", 200))
    assert _batch(engine) == [("long1", 0, 64)]
    engine.add_request(GenerationRequest("hit", (*stem, 9, 9, 9), GREEDY))  # 4 blocks cached
    # the hit jumps the queue and long1's next chunk waits a step: hit's prompt is done now
    assert _batch(engine) == [("hit", 4 * bs, 3)]
    assert _batch(engine) == [("long1", 64, 64)]  # no short prefill left: the old order


def test_a_long_prefill_is_deferred_a_bounded_number_of_steps(tiny_model: LoadedModel) -> None:
    engine = build_llm_engine(
        EngineConfig.tiny(max_num_batched_tokens=32, short_prefill_tokens=8), tiny_model
    )
    engine.scheduler.max_deferrals = 2
    engine.add_request(_req("long", 100))
    assert _batch(engine) == [("long", 0, 32)]
    for i in range(3):
        engine.add_request(_req(f"s{i}", 5))
    assert [r for r, _, _ in _batch(engine)] == ["s0", "s1", "s2"]
    engine.add_request(_req("s3", 5))
    assert [r for r, _, _ in _batch(engine)] == ["s0", "s1", "s2", "s3"]  # deferred twice
    engine.add_request(_req("s4", 5))
    assert "long" in [r for r, _, _ in _batch(engine)]  # then it runs regardless
