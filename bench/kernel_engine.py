"""The engine end to end for bench/kernels.py, with nano-vllm's recipe: random prompt
token ids and output lengths in [min_len, max_len], ignore_eos, temperature 0.6, all
requests submitted at once; throughput = output tokens / wall seconds.

The model is SmolLM2-135M's architecture with random weights (``RANDOM_SMOLLM2``) unless
a checkpoint path is given: with ignore_eos the speed does not depend on the weights,
and the bundled 98 MB GGUF need not travel to a GPU machine."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.api import GenerationRequest, SamplingParams
from engine.config import TINY_MODEL, EngineConfig
from engine.factory import LoadedModel, build_llm_engine, random_model
from engine.model.config import LlamaConfig
from engine.tokenizer import ChatTemplate, TextTokenizer

RANDOM_SMOLLM2 = "random-smollm2-135m"
# SmolLM2-135M-Instruct as engine.loader.gguf_loader reads it from the bundled GGUF.
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip


@dataclass(frozen=True)
class EnginePlan:
    model: str | None  # RANDOM_SMOLLM2, a checkpoint path, or None: the bundled GGUF
    smoke: bool  # tiny random model in float32 (CPU check of the script)
    device: str
    block_size: int
    kv_cache_gib: float
    max_num_seqs: int
    max_num_batched_tokens: int
    num_requests: int
    min_len: int
    max_len: int


def nano_vllm_requests(plan: EnginePlan, vocab_size: int) -> list[GenerationRequest]:
    """Seeded random requests: prompt and output lengths uniform in [min_len, max_len]."""
    gen = torch.Generator().manual_seed(0)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    requests = []
    for i in range(plan.num_requests):
        length = randint(plan.min_len, plan.max_len)
        prompt = tuple(torch.randint(3, vocab_size, (length,), generator=gen).tolist())
        sampling = SamplingParams(
            max_tokens=randint(plan.min_len, plan.max_len), temperature=0.6, ignore_eos=True,
            seed=i,
        )  # fmt: skip
        requests.append(GenerationRequest(f"r{i}", prompt, sampling))
    return requests


def numbered_tokenizer(vocab_size: int) -> TextTokenizer:
    """Token i is the word ``t<i>``: decodes every id of a random model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TextTokenizer(tok, ChatTemplate(None), eos_token_ids=(0,))


def engine_model(plan: EnginePlan, config: EngineConfig) -> LoadedModel | None:
    """The random SmolLM2-shaped model, or None to let the engine load ``config.model``."""
    if plan.smoke or plan.model != RANDOM_SMOLLM2:
        return None
    tokenizer = numbered_tokenizer(SMOLLM2_135M.vocab_size)
    return random_model(RANDOM_SMOLLM2, SMOLLM2_135M, tokenizer, config.dtype, config.device)


def engine_label(backend: str, cuda_graphs: bool) -> str:
    """How a run is named in the results: ``triton``, ``triton+graphs``, ``torch``."""
    return backend + ("+graphs" if cuda_graphs else "")


def bench_engine(backend: str, plan: EnginePlan, cuda_graphs: bool = False) -> dict[str, Any]:
    """Output tokens per second of the synchronous engine with ``backend``, its decode
    steps eager or replayed as CUDA graphs (engine.decode_graphs)."""
    config = EngineConfig(
        model=TINY_MODEL if plan.smoke else plan.model,
        dtype="float32" if plan.smoke else "bfloat16",
        device=plan.device, block_size=plan.block_size,
        kv_cache_bytes=int(plan.kv_cache_gib * 2**30),
        max_num_seqs=plan.max_num_seqs, max_num_batched_tokens=plan.max_num_batched_tokens,
        max_model_len=2 * plan.max_len, attention_backend=backend, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    start = time.perf_counter()
    llm = build_llm_engine(config, engine_model(plan, config))
    build_s = time.perf_counter() - start
    requests = nano_vllm_requests(plan, llm.limits.vocab_size)
    llm.generate_sync([GenerationRequest("warmup", (5, 6, 7), SamplingParams(max_tokens=4))])
    graphs = llm.runner.graphs
    steps, replays = llm.num_steps, graphs.num_replays if graphs else 0
    start = time.perf_counter()
    llm.generate_sync(requests)
    if plan.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out_tokens = sum(r.sampling.max_tokens for r in requests)
    rate = round(out_tokens / seconds, 1)
    return {"backend": engine_label(backend, cuda_graphs), "model": llm.model_name,
            "requests": len(requests), "output_tokens": out_tokens,
            "steps": llm.num_steps - steps,
            "graph_replays": graphs.num_replays - replays if graphs else 0,
            "build_s": round(build_s, 2), "seconds": round(seconds, 2),
            "tokens_per_s": rate}  # fmt: skip
