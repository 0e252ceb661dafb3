"""KV-write kernel vs the pure-torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_write import write_kv
from engine.kernels.reference import reference_write_kv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [(1, 1, 64, 8, F32), (7, 3, 128, 16, F16), (12, 2, 64, 32, BF16), (5, 8, 128, 8, F32)],
)
def test_write_kv_matches_reference(
    device: str, num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = 6
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    new_shape = (num_tokens, num_kv_heads, head_dim)
    k = torch.randn(new_shape, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(new_shape, generator=gen).to(dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if num_tokens > 2:
        slots[1] = -1  # a padding token: written nowhere
    slots = slots.to(device)
    ref_k, ref_v = reference_write_kv(k, v, k_cache, v_cache, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


def test_write_kv_from_strided_views(device: str) -> None:
    """k and v as views of one fused projection output."""
    kv = torch.randn(4, 2, 2, 64, device=device)
    k, v = kv[:, 0], kv[:, 1]
    k_cache = torch.zeros(2, 8, 2, 64, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([15, 0, 9, 3], dtype=torch.int32, device=device)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 7], k[0]) and torch.equal(v_cache[0, 0], v[1])
    assert torch.equal(k_cache[1, 1], k[2]) and torch.equal(v_cache[0, 3], v[3])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 4


def test_write_kv_rejects_bad_shapes(device: str) -> None:
    k_cache = torch.zeros(2, 8, 2, 64, device=device)
    k = torch.zeros(3, 4, 64, device=device)
    with pytest.raises(ValueError, match="must be"):
        write_kv(k, k, k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.long, device=device))
    k = torch.zeros(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, k_cache, k_cache.clone(), torch.zeros(2, dtype=torch.long, device=device))
