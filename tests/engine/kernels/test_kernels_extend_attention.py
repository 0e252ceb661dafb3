"""Prefill/extend kernel vs the pure-torch reference (pairwise-pruned grid)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.extend_attention import extend_attention
from engine.kernels.reference import reference_paged_attention
from tests.engine.kernels.kernel_batches import TOLERANCES, build_paged_batch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# query lens, cached prefix lens, heads, kv heads, head_dim, block size, dtype, block_m, block_n
CASES = [
    ([4], [0], 4, 4, 64, 8, F32, 16, 16),
    ([1, 7, 20], [0, 9, 13], 8, 2, 64, 16, F16, 16, 16),
    ([17, 3], [30, 0], 4, 1, 128, 32, BF16, 16, 32),
    ([5, 1, 33], [3, 40, 16], 6, 2, 128, 8, F32, 32, 16),
    ([40], [0], 4, 2, 64, 16, BF16, 64, 64),
    ([2, 0, 9], [1, 5, 0], 2, 1, 64, 32, F16, 16, 16),
    ([12, 1], [21, 64], 8, 4, 128, 8, F16, 16, 64),
    ([1, 1, 1], [0, 8, 30], 4, 2, 64, 16, F32, 16, 16),
]


@pytest.mark.parametrize(
    "query_lens, prefix_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, block_m, "
    "block_n",
    CASES,
)
def test_extend_matches_reference(
    device: str,
    query_lens: list[int],
    prefix_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    block_m: int,
    block_n: int,
) -> None:
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens, strict=True)]
    batch = build_paged_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    scale = head_dim**-0.5
    out = extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale, max_query_len=max(query_lens), block_m=block_m,
        block_n=block_n,
    )  # fmt: skip
    ref = reference_paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, scale,
    )  # fmt: skip
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_extend_reads_strided_q(device: str) -> None:
    """q as a view of a fused qkv projection (token stride > H * D) is accepted."""
    batch = build_paged_batch([6, 3], [6, 10], 4, 2, 64, 8, F32, device, seed=5)
    fused = torch.cat([batch.q, torch.zeros_like(batch.q)], dim=1)
    q_view = fused[:, :4]
    assert not q_view.is_contiguous()
    out = extend_attention(
        q_view, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, 0.125, max_query_len=6, block_m=16, block_n=16,
    )  # fmt: skip
    ref = reference_paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, 0.125,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **TOLERANCES[F32])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("qsl_len", "query_start_loc"),
        ("cache_not_contiguous", "contiguous"),
        ("block_size", "block_size"),
        ("head_dim_stride", "unit stride"),
    ],
)
def test_extend_rejects_bad_inputs(device: str, change: str, message: str) -> None:
    batch = build_paged_batch([3, 2], [3, 9], 4, 2, 64, 8, F32, device)
    q, qsl, k_cache, v_cache = batch.q, batch.query_start_loc, batch.k_cache, batch.v_cache
    if change == "qsl_len":
        qsl = qsl[:-1]
    elif change == "cache_not_contiguous":
        k_cache = k_cache.transpose(0, 1).contiguous().transpose(0, 1)
        v_cache = v_cache.transpose(0, 1).contiguous().transpose(0, 1)
    elif change == "block_size":
        k_cache = k_cache.reshape(-1, 12, 2, 64)[:4]
        v_cache = k_cache.clone()
    else:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=message):
        extend_attention(
            q, k_cache, v_cache, qsl, batch.seq_lens, batch.block_tables, 0.1, max_query_len=3
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_extend_long_prefix_on_gpu() -> None:
    batch = build_paged_batch([300, 1, 64], [2048, 513, 64], 32, 8, 128, 16, BF16, "cuda")
    out = extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, 128**-0.5, max_query_len=300,
    )  # fmt: skip
    ref = reference_paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, 128**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **TOLERANCES[BF16])
