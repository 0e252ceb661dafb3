"""Paged attention in plain torch: the CPU path and the reference for other backends.

K/V are gathered through each sequence's block table (layout in
:mod:`engine.attention.base`), then attention runs through
``torch.nn.functional.scaled_dot_product_attention``:

* decode rows (query length 1) are batched into one grouped matmul, keys padded to the
  longest context and masked by ``seq_lens``;
* prefill chunks run one sequence at a time with a causal mask shifted by the number
  of tokens already in the cache (``seq_len - query_len``).

Query heads are grouped per KV head (GQA: query head ``h`` reads KV head
``h // (H / Hkv)``) and attention is two matmuls around a float32 softmax.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata


class TorchAttentionBackend:
    """Reference paged attention backend (any device torch supports)."""

    name = "torch"

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the new tokens' K/V at ``slot_mapping`` (in place)."""
        if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)}"
            )
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q`` over each sequence's cached context: [total_q, H, D]."""
        out = torch.empty_like(q)
        qsl = [0]
        for n in meta.query_lens_cpu:
            qsl.append(qsl[-1] + n)
        decode_rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decode_rows:
            self._decode(q, k_cache, v_cache, meta, scale, decode_rows, qsl, out)
        for i, n in enumerate(meta.query_lens_cpu):
            if n > 1:
                out[qsl[i] : qsl[i + 1]] = self._prefill_one(
                    q[qsl[i] : qsl[i + 1]], k_cache, v_cache, meta, i, scale
                )
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[..., nb] block ids -> [..., nb * block_size, Hkv, D] contiguous context."""
        g = cache[block_ids]
        return g.reshape(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rows: list[int],
        qsl: list[int],
        out: torch.Tensor,
    ) -> None:
        block_size = k_cache.shape[1]
        lens = [meta.seq_lens_cpu[i] for i in rows]
        max_len = max(lens)
        num_blocks = -(-max_len // block_size)
        row_idx = torch.tensor(rows, dtype=torch.long, device=q.device)
        tables = meta.block_tables.index_select(0, row_idx)[:, :num_blocks].long()
        k = self._gather(k_cache, tables)[:, :max_len].transpose(1, 2)  # [B, Hkv, L, D]
        v = self._gather(v_cache, tables)[:, :max_len].transpose(1, 2)
        q_idx = torch.tensor([qsl[i] for i in rows], dtype=torch.long, device=q.device)
        b, hkv = len(rows), k.shape[1]
        qb = q.index_select(0, q_idx).view(b, hkv, -1, q.shape[-1])  # [B, Hkv, G, D]
        pos = torch.arange(max_len, device=q.device)
        pad = pos.unsqueeze(0) >= torch.tensor(lens, device=q.device).unsqueeze(1)  # [B, L]
        o = _attend(qb, k.to(q.dtype), v.to(q.dtype), pad[:, None, None, :], scale)
        out.index_copy_(0, q_idx, o.reshape(b, -1, q.shape[-1]))

    def _prefill_one(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
    ) -> torch.Tensor:
        block_size = k_cache.shape[1]
        seq_len = meta.seq_lens_cpu[i]
        q_len, num_heads, head_dim = q.shape
        num_blocks = -(-seq_len // block_size)
        table = meta.block_tables[i, :num_blocks].long()
        k = self._gather(k_cache, table)[:seq_len].transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
        v = self._gather(v_cache, table)[:seq_len].transpose(0, 1).to(q.dtype)
        hkv = k.shape[0]
        qh = q.transpose(0, 1).reshape(hkv, num_heads // hkv, q_len, head_dim)  # [Hkv, G, Q, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        future = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [Q, L]
        o = _attend(qh, k.unsqueeze(1), v.unsqueeze(1), future, scale)  # [Hkv, G, Q, D]
        return o.reshape(num_heads, q_len, head_dim).transpose(0, 1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked -> -inf) v with a float32 softmax.

    q [..., G, Q, D] against k, v [..., 1 or G, L, D] (GQA by broadcasting); explicit
    matmuls beat ``scaled_dot_product_attention`` on CPU for these shapes (bf16 ~10x).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
