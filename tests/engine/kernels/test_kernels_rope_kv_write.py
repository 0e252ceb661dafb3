"""Fused RoPE + KV write vs the references (rotation, then the plain KV write)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.reference import reference_rope, reference_write_kv
from engine.kernels.rope_kv_write import rope_write_kv
from tests.engine.kernels.kernel_batches import TOLERANCES


def _tables(max_pos: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize(
    ("num_tokens", "heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        (1, 4, 4, 64, 8, torch.float32),
        (6, 6, 2, 128, 16, torch.float16),
        (9, 4, 1, 64, 32, torch.bfloat16),
    ],
)
def test_rope_write_kv_matches_reference(
    device: str, num_tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(num_tokens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)

    q = rand(num_tokens, heads, head_dim)
    k, v = rand(num_tokens, kv_heads, head_dim), rand(num_tokens, kv_heads, head_dim)
    cache_shape = (5, block_size, kv_heads, head_dim)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    cos, sin = (t.to(device) for t in _tables(300, head_dim, dtype))
    positions = torch.randint(0, 300, (num_tokens,), generator=gen).to(device)
    slots = torch.randperm(5 * block_size, generator=gen)[:num_tokens].to(device)
    if num_tokens > 1:
        slots[0] = -1
    ref_k, ref_v = reference_write_kv(
        reference_rope(k, positions, cos, sin), v, k_cache, v_cache, slots
    )
    ref_q = reference_rope(q, positions, cos, sin)

    q_out = rope_write_kv(q, k, v, k_cache, v_cache, slots, positions, cos, sin)

    torch.testing.assert_close(q_out, ref_q, **TOLERANCES[dtype])
    torch.testing.assert_close(k_cache, ref_k, **TOLERANCES[dtype])
    assert torch.equal(v_cache, ref_v)


def test_reference_rope_matches_the_engine_rotary_embedding() -> None:
    from engine.model.config import LlamaConfig
    from engine.model.rope import RotaryEmbedding

    cfg = LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64, rope_theta=10000.0)  # fmt: skip
    rope = RotaryEmbedding(cfg, 64, torch.float32, "cpu")
    x = torch.randn(5, 2, 32)
    positions = torch.tensor([0, 3, 17, 63, 9])
    torch.testing.assert_close(
        reference_rope(x, positions, rope.cos, rope.sin), rope.apply(x, positions)
    )
