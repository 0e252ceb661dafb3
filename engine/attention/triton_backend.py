"""Paged attention through the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``).

``write_kv`` runs the KV-write kernel; ``forward`` runs the split-K decode kernel when
every sequence brings exactly one query token, and the extend kernel otherwise (it
handles prefill chunks and decodes mixed in one launch).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.kernels import decode_attention, extend_attention, kv_write
from engine.kernels.launch import runs_interpreted


class TritonAttentionBackend:
    """Attention backend over the Triton kernels of :mod:`engine.kernels`."""

    name = "triton"

    def __init__(self, decode_num_splits: int | None = None) -> None:
        """``decode_num_splits`` fixes the split-K count (default: a heuristic per step)."""
        self._decode_num_splits = decode_num_splits

    def prepare(self, num_heads: int, k_cache: torch.Tensor) -> None:
        """Nothing ahead of time: Triton compiles each kernel at its first launch and
        caches it on disk."""

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the new tokens' K/V at ``slot_mapping`` (in place)."""
        kv_write.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q`` over each sequence's cached context: [total_q, H, D]."""
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            return decode_attention.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
                num_splits=self._decode_num_splits,
            )
        return extend_attention.extend_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            max_query_len=meta.max_query_len,
        )


def kernels_run_on_cpu() -> bool:
    """Whether the kernels were built by the Triton interpreter (accept CPU tensors)."""
    kernels = (
        decode_attention._decode_split_kernel,
        extend_attention._extend_kernel,
        kv_write._kv_write_kernel,
    )
    return all(runs_interpreted(kernel) for kernel in kernels)
