"""The int8 KV cache (``kv_cache_dtype="int8"``) in the engine: ~1.9x the blocks in the
same bytes, answers within quantization noise of the model's own dtype, prefix reuse
as before, and clear refusals where it cannot run."""

from __future__ import annotations

import pytest
import torch

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.kernels import native_build
from engine.kernels.kv_int8 import row_width

pytestmark = pytest.mark.skipif(native_build.unavailable_reason() is not None,
                                reason="an int8 KV cache needs the native CPU kernels")  # fmt: skip
PROMPT = tuple((13 * i + 7) % 250 + 1 for i in range(70))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _config(**overrides: object) -> EngineConfig:
    return EngineConfig.tiny(num_kv_blocks=None, kv_cache_bytes=1 << 20, **overrides)


def test_the_same_bytes_hold_more_blocks_and_the_pool_is_int8_rows(
    tiny_model: LoadedModel,
) -> None:
    plain = build_llm_engine(_config(), tiny_model)
    int8 = build_llm_engine(_config(kv_cache_dtype="int8"), tiny_model)
    k = int8.runner.kv_caches[0][0]
    head_dim = tiny_model.config.head_size
    assert k.dtype == torch.int8 and k.shape[-1] == row_width(head_dim)
    # float32 tiny model: 4 bytes a value against 1 plus 4 bytes of scale per row
    want = 4 * head_dim / row_width(head_dim)
    assert int8.runner.num_blocks == pytest.approx(plain.runner.num_blocks * want, rel=0.01)


@pytest.mark.parametrize("fused_ops", [True, False])
def test_logits_stay_close_and_a_cached_prefix_is_reused(
    tiny_model: LoadedModel, fused_ops: bool
) -> None:
    """Both K/V writers (fused native, eager torch) feed the same kernels; the first
    token's logits stay within quantization noise of the float32 cache, and a repeated
    prompt reuses its cached blocks and answers as its first run."""
    ref = build_llm_engine(_config(fused_ops=fused_ops), tiny_model)
    eng = build_llm_engine(_config(kv_cache_dtype="int8", fused_ops=fused_ops), tiny_model)
    want = ref.generate_sync([GenerationRequest("a", PROMPT, GREEDY)])["a"][0]
    first = eng.generate_sync([GenerationRequest("a", PROMPT, GREEDY)])["a"][0]
    again = eng.generate_sync([GenerationRequest("b", PROMPT, GREEDY)])["b"][0]
    tokens = [t for c in first for t in c.token_ids]
    assert len(tokens) == 8 and tokens[0] == want[0].token_ids[0]
    assert [t for c in again for t in c.token_ids] == tokens
    assert again[-1].cached_tokens == 64  # every full block of 16 but the last token's


def test_the_first_step_logits_are_close_to_the_float32_cache(tiny_model: LoadedModel) -> None:
    ref = build_llm_engine(_config(), tiny_model)
    eng = build_llm_engine(_config(kv_cache_dtype="int8"), tiny_model)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True)
    a = ref.generate_sync([GenerationRequest("a", PROMPT, params)])["a"][0][-1]
    b = eng.generate_sync([GenerationRequest("a", PROMPT, params)])["a"][0][-1]
    assert a.logprobs is not None and b.logprobs is not None
    top_a = dict(a.logprobs[0].top)
    top_b = dict(b.logprobs[0].top)
    shared = top_a.keys() & top_b.keys()
    assert len(shared) >= 4
    assert max(abs(top_a[t] - top_b[t]) for t in shared) < 0.02  # measured ~0.005


def test_int8_refuses_other_backends_and_devices(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="needs the cpu attention backend"):
        build_llm_engine(_config(kv_cache_dtype="int8", attention_backend="torch"), tiny_model)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        _config(kv_cache_dtype="fp8")
