"""Build engines from an :class:`EngineConfig`.

Production::

    engine = build_engine(EngineConfig())               # bundled SmolLM2 GGUF
    engine = build_engine(EngineConfig(model="/path/model.gguf", dtype="bfloat16"))

Tests (random tiny Llama, byte tokenizer, builds in milliseconds)::

    engine = build_engine(EngineConfig.tiny())          # AsyncEngine
    llm = build_llm_engine(EngineConfig.tiny(num_kv_blocks=8))   # synchronous LLMEngine
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.api import Tokenizer
from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, TINY_MODEL, EngineConfig
from engine.decode_graphs import graph_batch_sizes
from engine.dtype_choice import native_bf16
from engine.gpu_memory import GpuMemory, kv_cache_budget, measure, reset_peak
from engine.host_memory import keep_tensor_memory
from engine.kernels.cpu_fused import fused_kernels_here
from engine.kernels.cpu_gemm import gemm_here
from engine.kernels.kv_int8 import row_width
from engine.kv.block_pool import BlockPool
from engine.kv.kv_manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.loader.bundled import bundled_model_path
from engine.model.config import LlamaConfig
from engine.model.int8_linear import native_int8_kernel, quantize_linears
from engine.model.llama import LlamaForCausalLM, stack_checkpoint
from engine.model.native_linear import kept_rows_limit, use_native_linears
from engine.model.packed_linear import PackedLinear, best_packing, pack_linears
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.tenant_fair import FairnessConfig
from engine.tokenizer import ByteTokenizer
from engine.validation import Limits
from kvtoll.progress import start_phase

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.kv.tier.tier import KVTier

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: LlamaConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer


def tiny_llama_config(vocab_size: int = ByteTokenizer.vocab_size) -> LlamaConfig:
    """2 layers, hidden 64, 4 heads / 2 KV heads (GQA), head_dim 16."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    )


def _build_model(
    cfg: LlamaConfig,
    state: dict[str, torch.Tensor] | None,
    dtype: str,
    device: str,
    seed: int,
    linear_quant: str = "none",
) -> LlamaForCausalLM:
    with torch.device("meta" if state is not None else "cpu"):
        model = LlamaForCausalLM(cfg)
    if state is not None:
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(stack_checkpoint(state), strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
    else:
        _init_tiny(model, seed)
    model = model.to(device=device, dtype=_DTYPES[dtype]).eval()
    if linear_quant == "int8":  # engine.model.int8_linear: the opt-in quantized path
        quantize_linears(model, gemm=native_int8_kernel() if device == "cpu" else None)
    if device == "cpu" and (packing := best_packing()) is not None:
        # the rest (all, without int8); a bf16 model on a CPU without bf16 instructions
        # multiplies in float32 (engine.model.packed_linear.pack_linears' upcast_bf16)
        pack_linears(model, packing, upcast_bf16=not native_bf16(device))
        bf16_layers = any(isinstance(m, PackedLinear) and m.weight.dtype == torch.bfloat16
                          for m in model.modules())  # fmt: skip
        if bf16_layers and (gemm := gemm_here()) is not None:
            max_rows = kept_rows_limit(gemm)  # engine.model.native_linear: raced once here
            if max_rows:
                use_native_linears(model, gemm, max_rows)
    return model


def _init_tiny(model: LlamaForCausalLM, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)


def random_model(
    name: str, cfg: LlamaConfig, tokenizer: Tokenizer, dtype: str, device: str, seed: int = 0
) -> LoadedModel:
    """Architecture ``cfg`` with random weights (benchmarks: with ``ignore_eos`` the
    engine's speed does not depend on the weights, so no checkpoint has to travel).
    ``tokenizer`` must decode every id below ``cfg.vocab_size``."""
    return LoadedModel(name, cfg, _build_model(cfg, None, dtype, device, seed), tokenizer)


def load_model(config: EngineConfig) -> LoadedModel:
    """Weights, architecture and tokenizer for ``config.model``."""
    if config.model == TINY_MODEL:
        cfg = tiny_llama_config()
        model = _build_model(
            cfg, None, config.dtype, config.device, config.seed, config.linear_quant
        )
        return LoadedModel(TINY_MODEL, cfg, model, ByteTokenizer())
    path = Path(config.model) if config.model else bundled_model_path()
    if path.is_dir():
        from engine.loader.hf_loader import load_hf_dir

        cfg, state, tok = load_hf_dir(path)
    elif path.suffix == ".gguf":
        from engine.loader.gguf_loader import load_gguf

        cfg, state, tok = load_gguf(path)
    else:
        raise ValueError(f"model: {path} is neither a .gguf file nor a safetensors directory")
    model = _build_model(
        cfg, state, config.dtype, config.device, config.seed, config.linear_quant
    )
    name = config.served_model_name or (path.name if path.is_dir() else path.stem)
    return LoadedModel(name, cfg, model, tok)


def make_backend(name: str, device: str) -> AttentionBackend:
    """The attention backend for ``name`` (``auto``/``torch``/``cpu``/``triton``) on ``device``."""
    if name == "torch":
        return TorchAttentionBackend()
    from engine.attention.selector import select_attention_backend

    return select_attention_backend(name, device)


def num_kv_blocks(
    config: EngineConfig, cfg: LlamaConfig, gpu_memory: Callable[[], GpuMemory]
) -> int:
    """Blocks from ``num_kv_blocks``, else the byte budget: ``kv_cache_bytes``, else
    1 GiB on the CPU and on a GPU :func:`~engine.gpu_memory.kv_cache_budget` of
    ``gpu_memory()`` (called only then: it runs a warm-up step)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if sized_from_gpu_memory(config):
        budget = kv_cache_budget(gpu_memory(), config.gpu_memory_utilization)
    else:
        budget = config.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    if config.kv_cache_dtype == "int8":  # a head's row: head_size int8 values and a scale
        elem, width = 1, row_width(cfg.head_size)
    else:
        elem, width = torch.finfo(_DTYPES[config.dtype]).bits // 8, cfg.head_size
    per_block = ModelRunner.bytes_per_block(
        cfg.num_hidden_layers, config.block_size, cfg.num_key_value_heads, width, elem
    )
    return max(1, budget // per_block)


def sized_from_gpu_memory(config: EngineConfig) -> bool:
    """Whether the KV cache takes its size from the GPU's memory (a probe warm-up runs
    first): on a GPU, with neither ``num_kv_blocks`` nor ``kv_cache_bytes`` set."""
    return (
        config.device != "cpu" and config.num_kv_blocks is None and config.kv_cache_bytes is None
    )


def profile_gpu_memory(
    lm: LoadedModel, backend: AttentionBackend, config: EngineConfig, max_len: int
) -> GpuMemory:
    """The GPU's memory after a full-size warm-up step on a runner with a few KV
    blocks (freed before measuring; the peak still counts its activations)."""
    reset_peak(config.device)
    probe = ModelRunner(
        lm.model, backend, -(-config.max_num_batched_tokens // config.block_size) + 1,
        config.block_size, max_len, _DTYPES[config.dtype], config.device,
    )  # fmt: skip
    probe.warmup(config.max_num_batched_tokens, config.max_num_seqs)
    del probe
    return measure(config.device)


def build_llm_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> LLMEngine:
    """The synchronous engine (tests, benchmarks); pass ``loaded`` to reuse weights."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if config.device == "cpu":
        keep_tensor_memory()  # engine.host_memory: temporaries without page faults
        if torch.cuda.is_available():
            log.warning(
                "a CUDA GPU is visible, but the engine runs on the CPU: "
                "set KVTOLL_DEVICE=cuda or kvtoll worker --device cuda to use it"
            )
    with start_phase("model load"):
        lm = loaded or load_model(config)
    max_len = min(
        config.max_model_len or lm.config.max_position_embeddings, lm.config.max_position_embeddings
    )
    with start_phase("kernel build and probes"):
        backend = make_backend(config.attention_backend, config.device)
        fused = fused_kernels_here() if config.device == "cpu" and config.fused_ops else None
        if config.kv_cache_dtype == "int8" and backend.name != "cpu":
            raise ValueError(f"kv_cache_dtype=int8 needs the cpu attention backend, "
                             f"not {backend.name}")  # fmt: skip
    graph_sizes: tuple[int, ...] = ()
    if config.cuda_graphs:
        if backend.name != "triton":
            raise ValueError(
                f"cuda_graphs needs the triton attention backend, not {backend.name}"
            )
        graph_sizes = graph_batch_sizes(config.max_num_seqs)
    with start_phase("KV cache" + (" (warm-up to size it)" if sized_from_gpu_memory(config)
                                   else "")):
        n_blocks = num_kv_blocks(
            config, lm.config, lambda: profile_gpu_memory(lm, backend, config, max_len)
        )
        runner = ModelRunner(
            lm.model,
            backend,
            n_blocks,
            config.block_size,
            max_len,
            _DTYPES[config.dtype],
            config.device,
            graph_sizes,
            fused,
            torch.int8 if config.kv_cache_dtype == "int8" else None,
        )
    if config.device != "cpu" and not sized_from_gpu_memory(config):
        with start_phase("warm-up"):  # compile the kernels now, not in a request
            runner.warmup(config.max_num_batched_tokens, config.max_num_seqs)
    pool = BlockPool(n_blocks, config.block_size)
    tier = build_tier(config, lm.name, runner) if config.kv_tier is not None else None
    if tier is not None:
        pool.on_evict = tier.on_evict
    kv = KVCacheManager(pool, tier)
    scheduler = Scheduler(kv, config.max_num_batched_tokens, config.max_num_seqs,
                          config.short_prefill_tokens,
                          fairness=FairnessConfig(enabled=config.fair_scheduling))
    limits = Limits(
        max_len,
        config.max_n,
        config.max_logprobs,
        lm.config.vocab_size,
        config.block_size,
        n_blocks,
    )
    log.info(
        "engine ready: %s on %s (%s, %s attention%s%s), %d KV blocks of %d tokens, "
        "max_model_len %d",
        lm.name,
        config.device,
        config.dtype,
        backend.name,
        ", fused small ops" if fused is not None else "",
        f", decode CUDA graphs for batch sizes up to {graph_sizes[-1]}" if graph_sizes else "",
        n_blocks,
        config.block_size,
        max_len,
    )
    return LLMEngine(lm.name, lm.tokenizer, runner, kv, scheduler, limits, config.dtype, tier)


def build_tier(config: EngineConfig, model_name: str, runner: ModelRunner) -> KVTier:
    """Tier 2 over ``runner``'s KV cache: host tier, and the shared store if asked.
    Blocks are keyed by the model's name and KV dtype (a worker never loads blocks
    another model or dtype made)."""
    from engine.kv.tier.block_io import BlockIO
    from engine.kv.tier.shared_redis import RedisBlockStore
    from engine.kv.tier.tier import KVTier

    tc = config.kv_tier
    assert tc is not None
    shared = None
    if tc.shared == "redis" and tc.redis_url:
        shared = RedisBlockStore(
            tc.redis_url, tc.ttl_s, tc.timeout_s, tc.backoff_s, tc.redis_prefix
        )
    kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else f"kv-{config.kv_cache_dtype}"
    return KVTier(tc, f"{model_name}/{kv_dtype}", BlockIO(runner.kv_caches), shared)


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> AsyncEngine:
    """The async engine (the :class:`AsyncEngineClient` for the proxy / worker server).

    Call ``await engine.start()`` or just use it: the step thread starts lazily on
    the first ``generate``; ``await engine.close()`` (or ``engine.shutdown()``) stops it.
    """
    from engine.async_engine import AsyncEngine

    return AsyncEngine(build_llm_engine(config, loaded))
