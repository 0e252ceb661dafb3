"""TritonAttentionBackend against the engine's TorchAttentionBackend on random batches."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from tests.engine.kernels.kernel_batches import TOLERANCES, PagedBatch, build_paged_batch


def _metadata(batch: PagedBatch) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping,
        max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.seq_lens_cpu),
        query_lens_cpu=batch.query_lens,
        seq_lens_cpu=batch.seq_lens_cpu,
    )


def _run(backend: AttentionBackend, batch: PagedBatch, scale: float) -> tuple[torch.Tensor, ...]:
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
    out = backend.forward(batch.q, k_cache, v_cache, _metadata(batch), scale)
    return out, k_cache, v_cache


def _random_lengths(seed: int, decode_only: bool) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 5, (1,), generator=gen))
    prefix = torch.randint(0, 40, (num_seqs,), generator=gen).tolist()
    if decode_only:
        query = [1] * num_seqs
    else:
        query = torch.randint(1, 24, (num_seqs,), generator=gen).tolist()
        query[0] = 1  # a decode row in a mixed batch
    return query, [p + q for p, q in zip(prefix, query, strict=True)]


@pytest.mark.parametrize(
    ("seed", "decode_only", "heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        (0, False, 4, 2, 64, 16, torch.float32),
        (1, True, 8, 2, 128, 8, torch.float32),
        (2, False, 2, 1, 128, 32, torch.float16),
        (3, True, 4, 4, 64, 16, torch.bfloat16),
    ],
)
def test_triton_backend_matches_torch_backend(
    device: str, seed: int, decode_only: bool, heads: int, kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype,
) -> None:  # fmt: skip
    query_lens, seq_lens = _random_lengths(seed, decode_only)
    batch = build_paged_batch(
        query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, device, seed=seed
    )
    scale = head_dim**-0.5
    out, k_cache, v_cache = _run(TritonAttentionBackend(), batch, scale)
    ref_out, ref_k, ref_v = _run(TorchAttentionBackend(), batch, scale)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(out, ref_out, **TOLERANCES[dtype])


def test_forced_split_count_reaches_the_decode_kernel(device: str) -> None:
    batch = build_paged_batch([1, 1], [50, 7], 4, 2, 64, 8, torch.float32, device, seed=9)
    meta = _metadata(batch)
    one = TritonAttentionBackend(decode_num_splits=1).forward(
        batch.q, batch.k_cache, batch.v_cache, meta, 0.125
    )
    many = TritonAttentionBackend(decode_num_splits=3).forward(
        batch.q, batch.k_cache, batch.v_cache, meta, 0.125
    )
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)
