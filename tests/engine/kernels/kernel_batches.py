"""Random paged batches and tolerances shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


@dataclass(frozen=True)
class PagedBatch:
    """A random batch over a paged cache whose block ids are scattered."""

    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D], the new tokens' K/V
    v_new: torch.Tensor
    k_cache: torch.Tensor  # random everywhere, new tokens' slots included
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]


def _block_tables(seq_lens: list[int], block_size: int, gen: torch.Generator) -> list[list[int]]:
    needed = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    return tables


def build_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> PagedBatch:
    """Random q, caches and block tables; query token j of seq i sits at
    ``seq_lens[i] - query_lens[i] + j``."""
    gen = torch.Generator().manual_seed(seed)
    tables = _block_tables(seq_lens, block_size, gen)
    num_blocks = sum(len(t) for t in tables) + 3
    width = max(1, *(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    slots = [
        tables[i][p // block_size] * block_size + p % block_size
        for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True))
        for p in range(s_len - q_len, s_len)
    ]
    total_q = sum(query_lens)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(
        q=rand(total_q, num_heads, head_dim),
        k_new=rand(total_q, num_kv_heads, head_dim),
        v_new=rand(total_q, num_kv_heads, head_dim),
        k_cache=rand(*cache_shape),
        v_cache=rand(*cache_shape),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
