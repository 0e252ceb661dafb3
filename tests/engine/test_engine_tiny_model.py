"""The engine (paged KV, chunked prefill, batching, prefix cache) against HF
transformers on the same random tiny Llama: greedy tokens must be identical."""

from __future__ import annotations

from collections.abc import Callable

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.llm_engine import LLMEngine

HFGreedy = Callable[[list[int], int], list[int]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    text = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
    return [list((text * 4).encode())[i * 7 : i * 7 + 5 + 11 * i] for i in range(n)]


def _run(
    engine: LLMEngine, prompts: list[list[int]], tag: str
) -> tuple[list[list[int]], list[int]]:
    reqs = [GenerationRequest(f"{tag}{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
    out = engine.generate_sync(reqs)
    tokens = [[t for c in out[r.request_id][0] for t in c.token_ids] for r in reqs]
    cached = [out[r.request_id][0][-1].cached_tokens for r in reqs]
    return tokens, cached


def test_alone_batched_and_prefix_cached_match_hf(
    tiny_model: LoadedModel, tiny_hf: HFGreedy
) -> None:
    prompts = [[t + 3 for t in p] for p in _prompts(10)]
    expected = [tiny_hf(p, GREEDY.max_tokens) for p in prompts]
    alone = build_llm_engine(EngineConfig.tiny(), tiny_model)
    for i, p in enumerate(prompts[:3]):
        assert _run(alone, [p], f"alone{i}-")[0] == [expected[i]]
    # small per-step budget: prefills are chunked and mixed with other sequences' decodes
    batched = build_llm_engine(
        EngineConfig.tiny(max_num_batched_tokens=24, num_kv_blocks=128), tiny_model
    )
    tokens, cached = _run(batched, prompts, "b")
    assert tokens == expected
    tokens, cached = _run(batched, prompts, "again")
    assert tokens == expected
    long_ones = [c for p, c in zip(prompts, cached, strict=True) if len(p) > 16]
    assert long_ones and all(c >= 16 for c in long_ones)


def test_preemption_under_tiny_cache_still_matches_hf(
    tiny_model: LoadedModel, tiny_hf: HFGreedy
) -> None:
    prompts = [[t + 3 for t in p] for p in _prompts(8)]
    expected = [tiny_hf(p, GREEDY.max_tokens) for p in prompts]
    engine = build_llm_engine(
        EngineConfig.tiny(num_kv_blocks=9, max_num_batched_tokens=32), tiny_model
    )
    tokens, _ = _run(engine, prompts, "p")
    assert tokens == expected
    assert engine.num_preemptions > 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.pool.num_free_blocks == 9
