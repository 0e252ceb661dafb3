"""Tier 2 in the tiny engine: evicted blocks come back from the host tier with the same
answers as recompute, are counted as cached tokens, never cross tenants, and a corrupt
block is recomputed."""

from __future__ import annotations

import pytest

from engine.api import GenerationChunk, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.kernels import native_build
from engine.kv.hashing import TenantSalt
from engine.kv.tier.codec import TierMode
from engine.kv.tier.config import TierConfig
from engine.llm_engine import LLMEngine
from kvtoll.openai.responses import TierCachedTokens

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT_A = [(7 * i + 3) % 250 + 1 for i in range(99)]  # 6 full blocks + 3 tokens
PROMPT_B = [(11 * i + 5) % 250 + 1 for i in range(120)]
SALT_A, SALT_B = TenantSalt(b"a" * 16), TenantSalt(b"b" * 16)


def _engine(
    loaded: LoadedModel, tier: TierConfig | None, blocks: int = 10, kv_cache_dtype: str = "auto"
) -> LLMEngine:
    return build_llm_engine(
        EngineConfig.tiny(num_kv_blocks=blocks, kv_tier=tier, kv_cache_dtype=kv_cache_dtype),
        loaded,
    )


def _last(
    engine: LLMEngine, rid: str, prompt: list[int], salt: TenantSalt | None = None
) -> tuple[list[int], GenerationChunk]:
    out = engine.generate_sync([GenerationRequest(rid, tuple(prompt), GREEDY, salt)])[rid][0]
    if engine.tier is not None:
        engine.tier.writer.drain()
    return [t for c in out for t in c.token_ids], out[-1]


def _run(engine: LLMEngine, rid: str, prompt: list[int], salt: TenantSalt | None = None):
    tokens, last = _last(engine, rid, prompt, salt)
    return tokens, last.cached_tokens


@pytest.mark.parametrize("mode", [TierMode.RAW, TierMode.INT8])
def test_evicted_prefix_is_loaded_back_and_answers_match_recompute(
    tiny_model: LoadedModel, mode: TierMode
) -> None:
    plain = _engine(tiny_model, None)
    expected, _ = _run(plain, "a", PROMPT_A, SALT_A)
    _run(plain, "b", PROMPT_B, SALT_A)  # evicts A's blocks from the 10-block pool
    assert _run(plain, "a2", PROMPT_A, SALT_A)[1] < 96

    tiered = _engine(tiny_model, TierConfig(host_bytes=1 << 20, mode=mode))
    assert _run(tiered, "a", PROMPT_A, SALT_A) == (expected, 0)
    _run(tiered, "b", PROMPT_B, SALT_A)
    assert tiered.tier is not None and tiered.tier.host.num_bytes > 0
    tokens, cached = _run(tiered, "a2", PROMPT_A, SALT_A)
    assert cached == 96  # every full block but the one holding the last token
    assert tiered.tier.num_loaded_blocks > 0
    if mode is TierMode.RAW:
        assert tokens == expected  # the same K/V bytes: the same greedy answer


@pytest.mark.skipif(native_build.unavailable_reason() is not None,
                    reason="an int8 KV cache needs the native CPU kernels")  # fmt: skip
@pytest.mark.parametrize("mode", [TierMode.RAW, TierMode.INT8])
def test_an_int8_kv_cache_round_trips_through_the_tier_exactly(
    tiny_model: LoadedModel, mode: TierMode
) -> None:
    """int8 KV blocks carry their scales, so the tier stores them as they are (either
    mode) and a reloaded prefix answers exactly as the int8 engine's recompute."""
    plain = _engine(tiny_model, None, kv_cache_dtype="int8")
    expected, _ = _run(plain, "a", PROMPT_A, SALT_A)
    tiered = _engine(tiny_model, TierConfig(host_bytes=1 << 20, mode=mode),
                     kv_cache_dtype="int8")  # fmt: skip
    assert _run(tiered, "a", PROMPT_A, SALT_A) == (expected, 0)
    _run(tiered, "b", PROMPT_B, SALT_A)  # evicts A's blocks
    tokens, cached = _run(tiered, "a2", PROMPT_A, SALT_A)
    assert tiered.tier is not None and tiered.tier.num_loaded_blocks > 0
    assert (tokens, cached) == (expected, 96)


def test_usage_says_which_tier_loaded_the_cached_tokens(tiny_model: LoadedModel) -> None:
    plain = _engine(tiny_model, None)
    assert _last(plain, "a", PROMPT_A, SALT_A)[1].tier_cached_tokens is None  # no tier
    tiered = _engine(tiny_model, TierConfig(host_bytes=1 << 20))
    tier = tiered.tier
    assert tier is not None
    assert _last(tiered, "a", PROMPT_A, SALT_A)[1].tier_cached_tokens == TierCachedTokens()
    _run(tiered, "b", PROMPT_B, SALT_A)  # evicts A's blocks into the host tier
    _, last = _last(tiered, "a2", PROMPT_A, SALT_A)
    assert tier.num_loaded_blocks > 0
    assert last.tier_cached_tokens == TierCachedTokens(host=tier.num_loaded_blocks * 16)
    assert last.cached_tokens == 96  # the rest of the 96 were still resident
    _, again = _last(tiered, "a3", PROMPT_A, SALT_A)  # now all resident: no tier load
    assert (again.cached_tokens, again.tier_cached_tokens) == (96, TierCachedTokens())


def test_another_tenant_never_loads_the_block(tiny_model: LoadedModel) -> None:
    tiered = _engine(tiny_model, TierConfig(host_bytes=1 << 20))
    _run(tiered, "a", PROMPT_A, SALT_A)
    _run(tiered, "b", PROMPT_B, SALT_A)
    assert tiered.tier is not None and tiered.tier.host.num_bytes > 0
    assert _run(tiered, "x", PROMPT_A, SALT_B)[1] == 0
    assert tiered.tier.num_loaded_blocks == 0


def test_a_corrupt_block_is_dropped_and_recomputed(tiny_model: LoadedModel) -> None:
    plain = _engine(tiny_model, None)
    expected, _ = _run(plain, "a", PROMPT_A, SALT_A)
    tiered = _engine(tiny_model, TierConfig(host_bytes=1 << 20))
    tier = tiered.tier
    assert tier is not None
    _run(tiered, "a", PROMPT_A, SALT_A)
    _run(tiered, "b", PROMPT_B, SALT_A)
    data = tier.host._data  # the stored bytes: flip one in every block
    for key in list(data):
        bad = bytearray(data[key])
        bad[len(bad) // 2] ^= 0xFF
        data[key] = bytes(bad)
    tokens, _ = _run(tiered, "a2", PROMPT_A, SALT_A)
    assert tokens == expected and tier.num_loaded_blocks == 0
    assert tier.host.stats.corrupt == 1  # the first one stops the run of loads


def test_recompute_is_chosen_when_measured_cheaper(tiny_model: LoadedModel) -> None:
    tiered = _engine(tiny_model, TierConfig(host_bytes=1 << 20))
    tier = tiered.tier
    assert tier is not None
    _run(tiered, "a", PROMPT_A, SALT_A)
    _run(tiered, "b", PROMPT_B, SALT_A)
    tier.cost.observe_load(1, 10.0)  # as if a load took 10 s per block
    tier.cost.load_s_per_block = 10.0
    _, cached = _run(tiered, "a2", PROMPT_A, SALT_A)
    assert tier.num_loaded_blocks == 0 and tier.num_skipped_loads > 0 and cached < 96
