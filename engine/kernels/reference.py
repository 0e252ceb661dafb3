"""Pure-torch references for the kernels, written straight from the maths.

Independent of the kernels and of the engine's torch backend: every sequence's context
is gathered token by token from its block table, GQA heads are expanded explicitly, and
softmax(q k^T * scale + causal mask) v is computed in float64.
"""

from __future__ import annotations

import torch


def reference_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with token t's K/V at slot ``slot_mapping[t]`` (< 0: skipped)."""
    block_size = k_cache.shape[1]
    new_k, new_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        new_k[block, offset] = k[token].to(k_cache.dtype)
        new_v[block, offset] = v[token].to(v_cache.dtype)
    return new_k, new_v


def gather_context(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D]: token t is ``cache[block_table[t // B], t % B]``."""
    block_size = cache.shape[1]
    rows = [cache[block_table[t // block_size], t % block_size] for t in range(seq_len)]
    return torch.stack(rows)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] at the last n positions of k/v [L, Hkv, D]; float64 maths."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k64 = k.double().repeat_interleave(group, dim=1)  # [L, H, D]: head h reads kv head h//group
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    q_pos = torch.arange(seq_len - num_q, seq_len).unsqueeze(1)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v64)


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context: [T, H, D]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    tables = block_tables.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[seq], starts[seq + 1]
        if hi == lo:
            continue
        k = gather_context(k_cache.cpu(), tables[seq], seq_len)
        v = gather_context(v_cache.cpu(), tables[seq], seq_len)
        out[lo:hi] = _attend(q[lo:hi].cpu(), k, v, scale)
    return out.to(device=q.device, dtype=q.dtype)


def reference_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode: one query token per sequence ([S, H, D]), the last position of its context."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return reference_paged_attention(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale
    )


def reference_quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) symmetric int8: values in [-127, 127] and float32 scales."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / 127.0).clamp_min(1e-8)
    y = x32 / scale.unsqueeze(-1)
    rounded = torch.sign(y) * torch.floor(y.abs() + 0.5)  # half away from zero
    return rounded.clamp(-127, 127).to(torch.int8), scale


def reference_dequantize_int8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``values * scales`` with one scale per last-dim row."""
    return values.float() * scales.unsqueeze(-1)
