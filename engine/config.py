"""Engine configuration: built once (CLI, settings or tests), frozen, passed down.

``model`` is a GGUF file, a Hugging Face safetensors directory, ``None`` for the
bundled SmolLM2-135M-Instruct GGUF, or :data:`TINY_MODEL` for a random-initialised
tiny Llama with a byte-level tokenizer (tests: builds in milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.api import TINY_MODEL
from engine.dtype_choice import resolve_dtype
from engine.gpu_memory import check_utilization
from engine.kernels.kv_int8 import KV_CACHE_DTYPES
from engine.kv.tier.config import TierConfig

DEFAULT_DTYPE = "auto"  # engine.dtype_choice: bfloat16 where the hardware computes it natively
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Beyond these no machine has the memory, and block ids and positions stop fitting in
# 32 bits: a value past one is a typo, refused before anything is allocated.
LINEAR_QUANTS = ("none", "int8")
UPPER_BOUNDS = {
    "block_size": 1024,
    "max_num_batched_tokens": 1 << 24,
    "max_num_seqs": 1 << 16,
    "max_n": 128,
    "kv_cache_bytes": 1 << 44,
    "num_kv_blocks": (1 << 31) - 1,
    "max_model_len": 1 << 24,
}


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of one engine instance.

    KV cache size: ``num_kv_blocks`` if set, else as many blocks as fit in
    ``kv_cache_bytes``; without either, 1 GiB on the CPU and, on a GPU, what
    ``gpu_memory_utilization`` of its memory leaves after the weights and a
    full-size warm-up step (:mod:`engine.gpu_memory`). ``max_model_len`` defaults to
    the model's context length.
    ``max_num_batched_tokens`` is the per-step token budget (chunked prefill).
    ``device`` is ``cpu``, ``cuda`` or ``cuda:N``. ``cuda_graphs`` runs decode steps as
    captured CUDA graphs (:mod:`engine.decode_graphs`; Triton backend only; off CUDA
    the same static-buffer path runs eagerly, which tests use).
    """

    model: str | None = None
    dtype: str = DEFAULT_DTYPE  # "auto" | "float32" | "bfloat16"; "auto" resolved on creation
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    num_kv_blocks: int | None = None
    # 2,048, as vLLM's CPU server: a 1k-token prompt is one step, not three, and the
    # bench's 64 prompts are prefilled in ~8 steps, not ~32 (each step reads every weight
    # once, and larger matmuls run nearer the machine's rate). Through the worker on the
    # 2-core AMX Xeon, 64 requests, 3 interleaved rounds: median 551 vs 480 output tok/s
    # at 512, cold 1k-token prefill 0.32 vs 0.38-0.55 s
    # (bench/figures/issue29_http_amx_budget_rounds.json).
    max_num_batched_tokens: int = 2048
    short_prefill_tokens: int = 64  # engine.scheduler: cached requests' short prefills first
    fair_scheduling: bool = True  # engine.tenant_fair: tenant-fair order and interjection
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_n: int = 8
    max_logprobs: int = 20
    attention_backend: str = "auto"  # auto | torch | cpu | triton (engine.attention.selector)
    served_model_name: str | None = None
    seed: int = 0  # tiny model weight init
    num_threads: int | None = None  # torch intra-op threads; None = torch default
    cuda_graphs: bool = False
    kv_tier: TierConfig | None = None  # tier 2 (engine.kv.tier); None: off
    linear_quant: str = "none"  # "none" | "int8" (CPU; engine.model.int8_linear; not bf16-exact)
    # "auto" (the model's dtype) | "int8" (CPU native attention; engine.kernels.kv_int8:
    # 0.53x of bfloat16's KV bytes, so ~1.9x the blocks in the same kv_cache_bytes)
    kv_cache_dtype: str = "auto"
    fused_ops: bool = True  # CPU: the decoder's small ops fused where they build (cpu_fused)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", check_device(self.device))
        # Resolved once, here: everything downstream sees a concrete dtype.
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
        if self.short_prefill_tokens < 0:
            raise ValueError(f"short_prefill_tokens must be >= 0, got {self.short_prefill_tokens}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_n"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("kv_cache_bytes", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        check_utilization(self.gpu_memory_utilization)
        if self.linear_quant not in LINEAR_QUANTS:
            raise ValueError(f"linear_quant must be one of {', '.join(LINEAR_QUANTS)}, "
                             f"got {self.linear_quant!r}")  # fmt: skip
        if self.linear_quant != "none" and self.device != "cpu":
            raise ValueError(f"linear_quant={self.linear_quant} runs on the CPU only")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")  # fmt: skip
        if self.kv_cache_dtype == "int8" and self.device != "cpu":
            raise ValueError("kv_cache_dtype=int8 runs on the CPU only")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        for name, most in UPPER_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value > most:
                raise ValueError(f"{name} must be at most {most}, got {value}")

    @classmethod
    def tiny(cls, **overrides: object) -> EngineConfig:
        """A config for the random tiny model (tests): small cache, small budgets."""
        base: dict[str, object] = {
            "model": TINY_MODEL,
            "dtype": "float32",
            "num_kv_blocks": 64,
            "max_num_batched_tokens": 64,
            "max_num_seqs": 16,
            "max_model_len": 256,
            "num_threads": 1,  # tiny matmuls: threads only contend on a shared CPU
        }
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]


def check_device(device: str) -> str:
    """``device`` as ``cpu``, ``cuda`` or ``cuda:N``; ``ValueError`` unless it is the CPU
    or a CUDA GPU this process can see."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: no CUDA GPU is visible to this process")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: only {count} CUDA GPU(s) visible")
    return "cpu" if dev.type == "cpu" else str(dev)
