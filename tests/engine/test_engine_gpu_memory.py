"""engine.gpu_memory: the KV cache's share of a GPU, and its measurement there."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import build_llm_engine, load_model
from engine.gpu_memory import GpuMemory, check_utilization, kv_cache_budget, measure, reset_peak
from engine.runner import ModelRunner

GIB = 1 << 30


def test_budget_is_the_share_left_after_use_and_activations() -> None:
    mem = GpuMemory(total=80 * GIB, free=70 * GIB, peak_allocated=9 * GIB, allocated=6 * GIB)
    # 0.9 * 80 = 72 GiB; 10 GiB in use; 3 GiB of activations on top of the weights.
    assert kv_cache_budget(mem, 0.9) == 72 * GIB - 10 * GIB - 3 * GIB


def test_a_share_already_used_up_is_an_error() -> None:
    mem = GpuMemory(total=10 * GIB, free=2 * GIB, peak_allocated=GIB, allocated=GIB)
    with pytest.raises(ValueError, match=r"leaves no room for the KV cache: 8\.00 GiB in use"):
        kv_cache_budget(mem, 0.8)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01, float("nan")])
def test_utilization_must_be_a_fraction(utilization: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        check_utilization(utilization)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.tiny(gpu_memory_utilization=utilization)


@given(
    total=st.integers(1, 1 << 40),
    used_share=st.floats(0, 1),
    transient=st.integers(0, 1 << 36),
    utilization=st.floats(0.01, 1.0),
)
def test_budget_never_exceeds_the_share(
    total: int, used_share: float, transient: int, utilization: float
) -> None:
    used = int(total * used_share)
    mem = GpuMemory(total, total - used, peak_allocated=GIB + transient, allocated=GIB)
    room = int(total * utilization) - used - transient
    if room <= 0:
        with pytest.raises(ValueError):
            kv_cache_budget(mem, utilization)
        return
    budget = kv_cache_budget(mem, utilization)
    assert budget == room
    assert used + transient + budget <= total * utilization


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_measure_sees_a_freed_peak_and_returns_cached_memory() -> None:
    reset_peak("cuda")
    before = measure("cuda")
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del block
    after = measure("cuda")
    assert after.peak_allocated >= before.allocated + (256 << 20)
    assert after.allocated == before.allocated
    assert after.free >= before.free - (64 << 20)  # the 256 MiB went back to the driver


@needs_gpu
def test_the_engine_takes_its_share_of_the_gpu_for_the_kv_cache() -> None:
    """Without a KV size, a GPU engine warms up, measures and gives the KV cache what
    the share leaves: here a share set to leave about 256 MiB beyond what is in use."""
    config = EngineConfig.tiny(device="cuda", attention_backend="triton")
    loaded = load_model(config)
    mem = measure("cuda")
    room = 256 << 20
    share = (mem.used + room) / mem.total
    engine = build_llm_engine(replace(config, num_kv_blocks=None, gpu_memory_utilization=share),
                              loaded)  # fmt: skip
    cfg = loaded.config
    per_block = ModelRunner.bytes_per_block(
        cfg.num_hidden_layers, config.block_size, cfg.num_key_value_heads, cfg.head_size, 4
    )
    kv_bytes = engine.runner.num_blocks * per_block
    assert room // 2 < kv_bytes <= room  # warm-up activations of a tiny model are small
    request = GenerationRequest("a", (1, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True))
    chunks = engine.generate_sync([request])["a"][0]
    assert sum(len(c.token_ids) for c in chunks) == 4
