"""Paged attention in plain torch: the CPU path and the reference for other backends.

K/V are gathered through each sequence's block table (layout in
:mod:`engine.attention.base`), then attention runs as explicit matmuls:

* decode rows (query length 1) are split into groups of similar context length
  (:mod:`engine.attention.decode_groups`, planned once per step and reused by every
  layer); each group is one batched attention (torch's fused SDPA kernel in float32,
  block-diagonal matmuls in bfloat16), keys padded to the group's longest context and
  masked by ``seq_lens``;
* prefill chunks run one sequence at a time with a causal mask shifted by the number
  of tokens already in the cache (``seq_len - query_len``): torch's fused SDPA in
  float32, and in bfloat16 where the hardware computes in bf16 natively (elsewhere in
  float32 over the widened rows: torch emulates bf16 matmuls there, ~20x slower);
  query tiles of explicit matmuls for a cache of another dtype than the queries'.

Query heads are grouped per KV head (GQA: query head ``h`` reads KV head
``h // (H / Hkv)``) and attention is two matmuls around a float32 softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.decode_groups import DEFAULT_GROUP_COST, group_by_length
from engine.dtype_choice import native_bf16
from engine.kernels.kv_int8 import quantize_rows


@dataclass(frozen=True)
class _DecodeGroup:
    """Decode rows of similar context length, with everything every layer reuses."""

    q_idx: torch.Tensor  # [b] rows of q / out
    block_ids: torch.Tensor  # [b * num_blocks] flattened block tables
    pad: torch.Tensor  # [b, 1, width] True past each row's context
    keep: torch.Tensor  # [b, 1, 1, width] its negation (an SDPA attention mask)
    size: int
    width: int  # num_blocks * block_size


@dataclass(frozen=True)
class _PrefillChunk:
    """One sequence's prefill chunk in a step, with what every layer reuses."""

    start: int  # its rows of q / out: [start, end)
    end: int
    table: torch.Tensor  # [num_blocks] int64 block ids of its context
    seq_len: int
    offset: int  # tokens cached before this chunk
    # The SDPA path's additive mask [Q, L] in q's dtype (0 where visible, -inf after each
    # query's position) for a chunk after cached tokens; None for offset 0 (causal).
    # Built once per step: per layer, building it and SDPA converting a boolean one
    # were 4 small ops (~1 ms of a 24-token step over 1,024 cached tokens).
    mask: torch.Tensor | None


PREFILL_TILE = 128  # query rows per prefill attention tile


class TorchAttentionBackend:
    """Reference paged attention backend (any device torch supports)."""

    name = "torch"

    def __init__(
        self,
        group_cost: int = DEFAULT_GROUP_COST,
        prefill_tile: int = PREFILL_TILE,
        fused_bf16_prefill: bool | None = None,
    ) -> None:
        """``fused_bf16_prefill``: bfloat16 prefill through SDPA rather than tiles;
        default: where :func:`engine.dtype_choice.native_bf16` holds (CUDA, or a CPU
        with bf16 instructions)."""
        self.group_cost = group_cost  # see engine.attention.decode_groups
        self.prefill_tile = prefill_tile
        self._fused_bf16_prefill = fused_bf16_prefill
        # The decode plan of the step being run: built at the first layer, reused by
        # the others (same metadata object).
        self._plan: tuple[AttentionMetadata, int, list[_DecodeGroup]] | None = None
        # Likewise the prefill chunks (metadata, block size, q dtype, chunks).
        self._prefill: (
            tuple[AttentionMetadata, int, torch.dtype, list[_PrefillChunk]] | None
        ) = None

    def prepare(self, num_heads: int, k_cache: torch.Tensor) -> None:
        """Nothing to compile: plain torch ops."""

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the new tokens' K/V at ``slot_mapping`` (in place); into int8 caches
        each row quantized with its scale (:mod:`engine.kernels.kv_int8`, bit-identical
        to the fused native writer)."""
        if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)}"
            )
        num_blocks, block_size, num_kv_heads, width = k_cache.shape
        flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, width)
        flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, width)
        flat_k.index_copy_(0, slot_mapping, _cache_rows(k, k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, _cache_rows(v, v_cache.dtype))

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
        self._decode_rows(q, k_cache, v_cache, meta, qsl, scale, out)
        for c in self._prefill_plan(meta, qsl, k_cache.shape[1], q):
            self._prefill_into(q[c.start : c.end], k_cache, v_cache, c, scale,
                               out[c.start : c.end])  # fmt: skip
        return out

    def _prefill_into(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: _PrefillChunk,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One prefill chunk's attention written into ``out``, its rows of the step's
        output (a backend whose kernel writes there itself overrides this)."""
        out.copy_(self._prefill_one(q, k_cache, v_cache, chunk, scale))

    def _prefill_plan(
        self, meta: AttentionMetadata, qsl: list[int], block_size: int, q: torch.Tensor
    ) -> list[_PrefillChunk]:
        plan = self._prefill
        if plan is not None and plan[0] is meta and plan[1] == block_size and plan[2] == q.dtype:
            return plan[3]
        chunks: list[_PrefillChunk] = []
        for i, n in enumerate(meta.query_lens_cpu):
            if n <= 1:
                continue
            seq_len = meta.seq_lens_cpu[i]
            table = meta.block_tables[i, : -(-seq_len // block_size)].long()
            mask = None
            if seq_len > n:  # query j sits at position offset + j and sees keys 0 .. offset + j
                k_pos = torch.arange(seq_len, device=q.device)
                hidden = k_pos.unsqueeze(0) > k_pos[seq_len - n :].unsqueeze(1)  # [Q, L]
                mask = torch.zeros(hidden.shape, dtype=self._sdpa_dtype(q), device=q.device)
                mask.masked_fill_(hidden, float("-inf"))
            chunks.append(_PrefillChunk(qsl[i], qsl[i + 1], table, seq_len, seq_len - n, mask))
        self._prefill = (meta, block_size, q.dtype, chunks)
        return chunks

    def _decode_rows(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        qsl: list[int],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of every decode row (query length 1), written into ``out``."""
        for group in self._decode_plan(meta, qsl, k_cache.shape[1], q.device):
            if q.dtype == torch.float32:
                self._decode_sdpa(q, k_cache, v_cache, group, scale, out)
            else:
                self._decode(q, k_cache, v_cache, group, scale, out)

    def _decode_plan(
        self, meta: AttentionMetadata, qsl: list[int], block_size: int, device: torch.device
    ) -> list[_DecodeGroup]:
        if self._plan is not None and self._plan[0] is meta and self._plan[1] == block_size:
            return self._plan[2]
        rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        nbs = [-(-meta.seq_lens_cpu[i] // block_size) for i in rows]
        groups: list[_DecodeGroup] = []
        for members in group_by_length(rows, nbs, self.group_cost):
            nb = max(-(-meta.seq_lens_cpu[i] // block_size) for i in members)
            idx = torch.tensor(members, dtype=torch.long, device=device)
            ids = meta.block_tables.index_select(0, idx)[:, :nb].reshape(-1).long()
            lens = torch.tensor([meta.seq_lens_cpu[i] for i in members], device=device)
            pad = torch.arange(nb * block_size, device=device).unsqueeze(0) >= lens.unsqueeze(1)
            q_idx = torch.tensor([qsl[i] for i in members], dtype=torch.long, device=device)
            groups.append(
                _DecodeGroup(
                    q_idx, ids, pad.unsqueeze(1), ~pad[:, None, None], len(members), nb * block_size
                )
            )
        self._plan = (meta, block_size, groups)
        return groups

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

    @classmethod
    def _group_kv(cls, cache: torch.Tensor, g: _DecodeGroup) -> torch.Tensor:
        """The group's contexts gathered as one contiguous ``[B, W, Hkv, D]`` tensor."""
        return cls._rows(cache, g.block_ids).view(g.size, g.width, *cache.shape[2:])

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        g: _DecodeGroup,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One group of decode rows at once, without transposing the gathered K/V.

        K/V stay in their gathered ``[B, W, Hkv * D]`` layout. Each query head is
        placed in its KV head's slot of a block-diagonal ``[B, H, Hkv * D]`` matrix
        (zeros elsewhere), so one matmul ``Q K^T`` gives every head's scores
        ``[B, H, W]`` (this orientation ran ~1.6x faster than ``K Q^T`` plus a
        transpose on CPU); the diagonal blocks of ``P @ V`` are the outputs. Hkv
        times the (tiny) FLOPs, no copies of K/V.
        """
        _, _, hkv, d = k_cache.shape
        b, h = g.size, q.shape[1]
        k = self._group_kv(k_cache, g).flatten(2).to(q.dtype)  # [B, W, Hkv*D]
        v = self._group_kv(v_cache, g).flatten(2).to(q.dtype)
        qb = q.index_select(0, g.q_idx).view(b, hkv, 1, h // hkv, d)
        eye = torch.eye(hkv, dtype=q.dtype, device=q.device).view(1, hkv, hkv, 1, 1)
        q_diag = (qb * eye).transpose(2, 3).reshape(b, h, hkv * d)  # [B, H, Hkv*D]
        scores = torch.bmm(q_diag, k.transpose(1, 2))  # [B, H, W]
        scores = scores.to(torch.float32).mul_(scale)
        probs = scores.masked_fill_(g.pad, float("-inf")).softmax(-1).to(v.dtype)
        o = torch.bmm(probs, v)  # [B, H, Hkv*D]
        o = torch.diagonal(o.view(b, hkv, h // hkv, hkv, d), dim1=1, dim2=3)  # [B, G, D, Hkv]
        out.index_copy_(0, g.q_idx, o.permute(0, 3, 1, 2).reshape(b, h, d))

    def _decode_sdpa(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        g: _DecodeGroup,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """:meth:`_decode` through torch's fused CPU attention kernel (float32).

        The gathered K/V are passed as strided ``[B, Hkv, W, D]`` views (no transposed
        copies) with GQA left to the kernel. In float32 on CPU it ran 1.0-1.8x faster
        than the block-diagonal matmuls (more so at long contexts); in bfloat16 it was
        ~10x slower, so bfloat16 keeps :meth:`_decode`.
        """
        b, h, d = g.size, q.shape[1], q.shape[2]
        k = self._group_kv(k_cache, g).transpose(1, 2)  # [B, Hkv, W, D] view
        v = self._group_kv(v_cache, g).transpose(1, 2)
        qb = q.index_select(0, g.q_idx).view(b, h, 1, d)
        o = torch.nn.functional.scaled_dot_product_attention(
            qb, k, v, attn_mask=g.keep, scale=scale, enable_gqa=k.shape[1] != h
        )
        out.index_copy_(0, g.q_idx, o.view(b, h, d))

    def _prefill_one(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: _PrefillChunk,
        scale: float,
    ) -> torch.Tensor:
        """One sequence's prefill chunk.

        float32: torch's fused (flash) CPU attention with GQA in the kernel and, when
        part of the context was cached before this chunk, a boolean mask shifted by
        that many tokens (~1.7x faster than the tiles below, measured at 64-640 tokens).
        bfloat16 the same where bf16 is native: on a Xeon with AMX, 3.4-7x faster than
        the tiles (24-512 queries over 128-1,048 keys); on a Zen 4 EPYC with
        ``avx512_bf16`` (no AMX) 1.1-1.9x (the same shapes). Otherwise in tiles of
        ``prefill_tile`` query rows: tile ``[a, b)`` attends only to keys up to its last
        position, so the fully masked upper triangle is never computed, and each tile's
        float32 scores stay in cache (one [H, 512, 512] score tensor does not: ~3x
        slower). bfloat16 where bf16 is *not* native: the fused kernel in float32 over
        the gathered rows widened (exactly) and the output rounded back once. There
        torch's bf16 matmuls are emulated: on an AVX2-only EPYC one 128-query tile's
        ``Q K^T`` over 1,048 keys took 59 ms in bfloat16 against 2.7 ms in float32, and a
        1,048-token prompt's first token 26 s through the tiles (SmolLM2-135M, 30
        layers); the widened fused kernel takes 16 ms for one layer's whole prompt.
        The tiles remain for a cache of another dtype than the queries'.
        """
        seq_len, offset, table = chunk.seq_len, chunk.offset, chunk.table
        q_len, num_heads, head_dim = q.shape
        if k_cache.dtype == q.dtype and q.dtype in (torch.float32, torch.bfloat16):
            return self._prefill_sdpa(q, k_cache, v_cache, table, seq_len, chunk.mask, scale,
                                      self._sdpa_dtype(q))  # fmt: skip
        k = self._gather(k_cache, table, seq_len).to(q.dtype).unsqueeze(1)  # [Hkv, 1, L, D]
        v = self._gather(v_cache, table, seq_len).to(q.dtype).unsqueeze(1)
        hkv = k.shape[0]
        qh = q.transpose(0, 1).reshape(hkv, num_heads // hkv, q_len, head_dim)  # [Hkv, G, Q, D]
        k_pos = torch.arange(seq_len, device=q.device)
        out = torch.empty_like(q)
        for a in range(0, q_len, self.prefill_tile):
            b = min(a + self.prefill_tile, q_len)
            n = offset + b  # keys visible to the tile's last query
            future = k_pos[:n].unsqueeze(0) > k_pos[offset + a : n].unsqueeze(1)  # [b-a, n]
            o = _attend(qh[:, :, a:b], k[:, :, :n], v[:, :, :n], future, scale)
            out[a:b] = o.reshape(num_heads, b - a, head_dim).transpose(0, 1)
        return out

    def _fused_bf16(self, q: torch.Tensor) -> bool:
        if self._fused_bf16_prefill is None:  # decided at the first bf16 prefill
            self._fused_bf16_prefill = native_bf16(q.device.type)
        return self._fused_bf16_prefill

    def _sdpa_dtype(self, q: torch.Tensor) -> torch.dtype:
        """The dtype a prefill chunk's fused attention (and its mask) computes in:
        ``q``'s, except float32 for bfloat16 queries where bf16 is not native."""
        if q.dtype == torch.bfloat16 and not self._fused_bf16(q):
            return torch.float32
        return q.dtype

    @classmethod
    def _prefill_sdpa(
        cls,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: torch.Tensor,
        seq_len: int,
        mask: torch.Tensor | None,
        scale: float,
        compute: torch.dtype | None = None,
    ) -> torch.Tensor:
        """:meth:`_prefill_one` through ``scaled_dot_product_attention``; ``mask``: the
        chunk's additive mask (in ``compute``), None for a chunk with nothing cached
        before it (causal). ``compute``: the dtype the kernel runs in (default ``q``'s);
        another one widens the gathered rows to it and rounds the output back."""
        q_len = q.shape[0]
        compute = q.dtype if compute is None else compute
        # [1, Hkv, L, D] strided views of the gathered rows: SDPA takes them as they are
        # (bit-identical to contiguous copies, and ~15% faster for 24 queries over 1,048
        # keys without the transposing copy).
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        k = cls._rows(k_cache, table)[:seq_len].view(1, seq_len, hkv, d).transpose(1, 2)
        v = cls._rows(v_cache, table)[:seq_len].view(1, seq_len, hkv, d).transpose(1, 2)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if compute != q.dtype:
            qh, k, v = qh.to(compute), k.to(compute), v.to(compute)
        gqa = k.shape[1] != q.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        return o[0].transpose(0, 1).reshape(q_len, q.shape[1], q.shape[2]).to(q.dtype)


def _cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New K or V rows as a cache of ``dtype`` stores them."""
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked -> -inf) v with a float32 softmax.

    q [..., G, Q, D] against k, v [..., 1 or G, L, D] (GQA by broadcasting); explicit
    matmuls beat ``scaled_dot_product_attention`` on CPU for these shapes (bf16 ~10x).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    scores = scores.masked_fill_(masked, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
