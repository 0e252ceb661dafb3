"""The references themselves, against dense attention on an unpaged copy of the context."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.reference import reference_paged_attention, reference_write_kv


def test_reference_equals_dense_causal_attention_over_a_shuffled_pool() -> None:
    gen = torch.Generator().manual_seed(0)
    seq_len, q_len, heads, kv_heads, dim, block_size = 21, 5, 4, 2, 16, 8
    k_dense = torch.randn(seq_len, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_dense = torch.randn(seq_len, kv_heads, dim, generator=gen, dtype=torch.float64)
    q = torch.randn(q_len, heads, dim, generator=gen, dtype=torch.float64)
    table = [4, 0, 2]  # blocks of the sequence, out of order in a pool of 5
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(21)])
    empty = torch.full((5, block_size, kv_heads, dim), float("nan"), dtype=torch.float64)
    k_cache, v_cache = reference_write_kv(k_dense, v_dense, empty, empty, slots)

    out = reference_paged_attention(
        q, k_cache, v_cache, torch.tensor([0, q_len]), torch.tensor([seq_len]),
        torch.tensor([table]), scale=0.3,
    )  # fmt: skip

    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_dense.transpose(0, 1), v_dense.transpose(0, 1),
        attn_mask=mask, scale=0.3, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out, dense)


def test_reference_write_kv_skips_negative_slots() -> None:
    cache = torch.zeros(2, 8, 1, 4)
    k = torch.ones(2, 1, 4)
    new_k, _ = reference_write_kv(k, k, cache, cache, torch.tensor([-1, 9]))
    assert new_k.sum() == 4 and new_k[1, 1].sum() == 4
    assert cache.sum() == 0  # the input is left as it was
