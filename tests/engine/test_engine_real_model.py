"""End to end on the real SmolLM2-135M-Instruct GGUF (float32): greedy tokens equal
HF transformers' LlamaForCausalLM on the same dequantized weights, alone, batched
with requests of mixed lengths, and again from the prefix cache."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.llm_engine import LLMEngine
from engine.loader.gguf_loader import unpermute

pytestmark = pytest.mark.slow
HFGreedy = Callable[[list[int], int], list[int]]
MAX_NEW = 16
QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow, please.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
)


def _greedy(
    engine: LLMEngine, prompts: list[list[int]], tag: str
) -> tuple[list[list[int]], list[int]]:
    p = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(f"{tag}{i}", tuple(x), p) for i, x in enumerate(prompts)]
    out = engine.generate_sync(reqs)
    toks = [[t for c in out[r.request_id][0] for t in c.token_ids] for r in reqs]
    return toks, [out[r.request_id][0][-1].cached_tokens for r in reqs]


def test_greedy_matches_hf_alone_batched_and_cached(
    real_model: LoadedModel, real_hf: HFGreedy
) -> None:
    tok = real_model.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = [real_hf(p, MAX_NEW) for p in prompts]
    assert "Paris" in tok.decode(expected[0])  # weights (Q/K un-permute included) are right
    config = EngineConfig(
        dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48, num_threads=1
    )
    engine = build_llm_engine(config, real_model)
    assert _greedy(engine, prompts[:1], "alone")[0] == expected[:1]
    fillers = [list(range(1000, 1000 + n)) for n in (5, 41)]  # mixed lengths, chunked prefill
    batch, _ = _greedy(engine, [fillers[0], prompts[1], fillers[1]], "batch")
    assert batch[1] == expected[1]
    again, cached = _greedy(engine, prompts, "again")
    assert again == expected
    assert all(c > 0 for c in cached)  # the shared system prompt at least


def test_chat_template_renders_chatml(real_model: LoadedModel) -> None:
    tok = real_model.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert tok.decode(ids) == "system\nBe brief.\nuser\nHi\nassistant\n"  # specials skipped
    assert ids[0] == tok.encode("<|im_start|>")[0] == 1
    assert tok.eos_token_ids == (2,)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    assert np.array_equal(unpermute(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)
