"""Paged GQA decode kernel vs the pure-torch reference (pairwise-pruned grid)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.decode_attention import choose_num_splits, paged_decode_attention
from engine.kernels.reference import reference_paged_decode
from tests.engine.kernels.kernel_batches import TOLERANCES, build_paged_batch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# seq_lens, heads, kv heads, head_dim, block size, dtype, num_splits, block_n
CASES = [
    ([1], 4, 4, 64, 8, F32, None, 16),
    ([1, 19, 40], 8, 2, 64, 16, F16, 3, 16),
    ([33, 8], 4, 1, 128, 32, BF16, 2, 16),
    ([5, 16, 17, 64], 6, 2, 128, 8, F32, 4, 32),
    ([70, 3], 8, 8, 64, 32, BF16, 1, 64),
    ([9, 24, 50], 4, 2, 128, 16, F16, None, 64),
    ([100, 1], 16, 2, 64, 8, F32, 5, 16),
    ([23, 1, 8], 4, 2, 64, 8, BF16, 2, 32),
    ([47], 2, 1, 128, 16, F16, 7, 16),
]


@pytest.mark.parametrize(
    "seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, splits, block_n",
    CASES,
)
def test_decode_matches_reference(
    device: str,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    splits: int | None,
    block_n: int,
) -> None:
    batch = build_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    scale = head_dim**-0.5
    out = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale,
        max_seq_len=max(seq_lens), num_splits=splits, block_n=block_n,
    )  # fmt: skip
    ref = reference_paged_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale
    )
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_split_count_does_not_change_the_result(device: str) -> None:
    batch = build_paged_batch([1, 1], [61, 30], 4, 2, 64, 8, F32, device, seed=3)
    outs = [
        paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.1,
            max_seq_len=61, num_splits=n, block_n=16,
        )
        for n in (1, 2, 4)
    ]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-5, rtol=1e-5)


def test_each_sequence_splits_its_own_context(device: str) -> None:
    """An upper bound for max_seq_len (what a CUDA graph captures with) and more splits
    than a short sequence can fill: every sequence still gets its exact attention."""
    batch = build_paged_batch([1, 1, 1], [61, 1, 30], 4, 2, 64, 8, F32, device, seed=5)
    ref = reference_paged_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.1
    )
    for splits in (None, 3, 8):
        out = paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.1,
            max_seq_len=4096, num_splits=splits, block_n=16,
        )  # fmt: skip
        torch.testing.assert_close(out, ref, **TOLERANCES[F32])


def test_num_splits_heuristic_bounds() -> None:
    assert choose_num_splits(64, 8, 512, 64) == 1  # enough programs already
    assert choose_num_splits(1, 8, 32768, 64) == 33  # fills the GPU, long ranges
    assert choose_num_splits(1, 1, 10**6, 64) == 64  # capped
    assert choose_num_splits(1, 8, 100, 64) == 1  # short context: no split


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("seq_lens_int64", "seq_lens"),
        ("q_dtype", "dtypes"),
        ("block_table_rows", "block_tables"),
        ("heads_not_multiple", "H %"),
        ("block_n", "block_n"),
    ],
)
def test_decode_rejects_bad_inputs(
    device: str, change: str, message: str
) -> None:
    batch = build_paged_batch([1, 1], [9, 4], 4, 2, 64, 8, F32, device)
    q, seq_lens, tables, block_n = batch.q, batch.seq_lens, batch.block_tables, 16
    if change == "seq_lens_int64":
        seq_lens = seq_lens.long()
    elif change == "q_dtype":
        q = q.half()
    elif change == "block_table_rows":
        tables = tables[:1]
    elif change == "heads_not_multiple":
        q = torch.cat([q, q[:, :1]], dim=1)
    else:
        block_n = 24
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(
            q, batch.k_cache, batch.v_cache, tables, seq_lens, 0.1, max_seq_len=9,
            block_n=block_n,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_long_context_on_gpu() -> None:
    batch = build_paged_batch([1] * 4, [4096, 1, 2049, 777], 32, 8, 128, 16, BF16, "cuda")
    out = paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 128**-0.5,
        max_seq_len=4096,
    )  # fmt: skip
    ref = reference_paged_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 128**-0.5
    )
    torch.testing.assert_close(out, ref, **TOLERANCES[BF16])
