"""int8 KV cache: both attention kernels reading int8 + scales vs the reference over the
dequantized cache."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.extend_attention import extend_attention
from engine.kernels.launch import KVScales
from engine.kernels.reference import (
    reference_dequantize_int8,
    reference_paged_attention,
    reference_quantize_int8,
)
from tests.engine.kernels.kernel_batches import TOLERANCES, PagedBatch, build_paged_batch


def _quantized_pool(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, KVScales]:
    """int8 copy of the batch's whole float pool (reference quantization)."""
    k_cache, k_scale = reference_quantize_int8(batch.k_cache)
    v_cache, v_scale = reference_quantize_int8(batch.v_cache)
    return k_cache, v_cache, KVScales(k_scale, v_scale)


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        ([1, 20, 41], [1, 1, 1], 8, 2, 64, 16, torch.float32),
        ([9, 33], [1, 1], 4, 1, 128, 8, torch.float16),
        ([12, 30], [12, 7], 4, 2, 64, 16, torch.float32),
        ([5, 19], [2, 19], 2, 2, 128, 32, torch.bfloat16),
    ],
)
def test_attention_over_int8_cache_matches_dequantized_reference(
    device: str, seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int,
    head_dim: int, block_size: int, dtype: torch.dtype,
) -> None:  # fmt: skip
    batch = build_paged_batch(
        query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, device
    )
    k8, v8, scales = _quantized_pool(batch)
    scale = head_dim**-0.5
    if max(query_lens) == 1:
        out = paged_decode_attention(
            batch.q, k8, v8, batch.block_tables, batch.seq_lens, scale,
            max_seq_len=max(seq_lens), num_splits=2, block_n=16, kv_scales=scales,
        )  # fmt: skip
    else:
        out = extend_attention(
            batch.q, k8, v8, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
            max_query_len=max(query_lens), block_m=16, block_n=16, kv_scales=scales,
        )  # fmt: skip
    k_deq = reference_dequantize_int8(k8, scales.k)
    v_deq = reference_dequantize_int8(v8, scales.v)
    ref = reference_paged_attention(
        batch.q.float(), k_deq, v_deq, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[dtype])
    exact = reference_paged_attention(
        batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), batch.query_start_loc,
        batch.seq_lens, batch.block_tables, scale,
    )  # fmt: skip
    assert float((out.float() - exact).abs().max()) < 0.05  # the accuracy cost of int8


def test_int8_caches_need_scales(device: str) -> None:
    batch = build_paged_batch([1], [9], 2, 1, 64, 8, torch.float32, device)
    k8, v8, _ = _quantized_pool(batch)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(batch.q, k8, v8, batch.block_tables, batch.seq_lens, 0.1, 9)
