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
    def _rows(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The blocks ``block_ids`` [n] as one contiguous [n * block_size, Hkv * D] tensor.

        ``index_select`` over a 2-D view (one row per block) runs at copy speed on
        CPU; over the 4-D cache it is ~6x slower.
        """
        num_blocks, block_size, hkv, d = cache.shape
        rows = cache.view(num_blocks, block_size * hkv * d).index_select(0, block_ids)
        return rows.view(-1, hkv * d)

    @classmethod
    def _gather(cls, cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """[nb] block ids -> contiguous [Hkv, length, D] context."""
        hkv, d = cache.shape[2], cache.shape[3]
        ctx = cls._rows(cache, block_ids)[:length].view(length, hkv, d)
        return ctx.transpose(0, 1).contiguous()

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
        """All decode rows at once, without transposing the gathered K/V.

        K/V stay in their gathered ``[B, L, Hkv * D]`` layout. Each query head is
        placed in its KV head's slot of a block-diagonal ``[B, H, Hkv * D]`` matrix
        (zeros elsewhere), so one matmul gives every head's scores; the diagonal
        blocks of ``P @ V`` are the outputs. Hkv times the (tiny) FLOPs, no copies.
        """
        _, block_size, hkv, d = k_cache.shape
        lens = [meta.seq_lens_cpu[i] for i in rows]
        num_blocks = -(-max(lens) // block_size)
        width = num_blocks * block_size  # whole blocks: contiguous K/V, padding masked
        b, h = len(rows), q.shape[1]
        row_idx = torch.tensor(rows, dtype=torch.long, device=q.device)
        ids = meta.block_tables.index_select(0, row_idx)[:, :num_blocks].reshape(-1).long()
        k = self._rows(k_cache, ids).view(b, width, hkv * d).to(q.dtype)
        v = self._rows(v_cache, ids).view(b, width, hkv * d).to(q.dtype)
        q_idx = torch.tensor([qsl[i] for i in rows], dtype=torch.long, device=q.device)
        qb = q.index_select(0, q_idx).view(b, hkv, 1, h // hkv, d)
        eye = torch.eye(hkv, dtype=q.dtype, device=q.device).view(1, hkv, hkv, 1, 1)
        q_diag = (qb * eye).transpose(2, 3).reshape(b, h, hkv * d)  # [B, H, Hkv*D]
        pos = torch.arange(width, device=q.device)
        pad = pos.unsqueeze(0) >= torch.tensor(lens, device=q.device).unsqueeze(1)  # [B, W]
        o = _attend(q_diag, k, v, pad[:, None, :], scale).view(b, hkv, h // hkv, hkv, d)
        o = torch.diagonal(o, dim1=1, dim2=3).permute(0, 3, 1, 2)  # [B, Hkv, G, D]
        out.index_copy_(0, q_idx, o.reshape(b, h, d))

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
        k = self._gather(k_cache, table, seq_len).to(q.dtype)  # [Hkv, L, D]
        v = self._gather(v_cache, table, seq_len).to(q.dtype)
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
