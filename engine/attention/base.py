"""The attention-backend interface: how the model runner asks for paged attention.

Layout, shared by every backend (one cache pair per layer)::

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

    batch of S sequences, flattened query tokens (prefill chunks and decodes mixed):
    q      : [total_q, num_heads, head_dim]
    k, v   : [total_q, num_kv_heads, head_dim]     (the new tokens' K/V, already RoPE'd)
    query_start_loc : [S + 1] int32   cumulative query lengths (seq i owns q[qsl[i]:qsl[i+1]])
    seq_lens        : [S] int32       context length after this step (cached + new tokens)
    block_tables    : [S, max_blocks] int32, padded with 0 past each sequence's blocks
    slot_mapping    : [total_q] int64 where each new token's K/V is written

Query token j of sequence i sits at absolute position
``seq_lens[i] - (qsl[i+1] - qsl[i]) + j`` and attends causally to positions <= it.
Backends first :meth:`write_kv`, then :meth:`forward` reads the cache only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Python-side copies, so backends need no device sync to loop or plan. In a step
    # replayed as a CUDA graph (engine.decode_graphs) max_seq_len and seq_lens_cpu are
    # upper bounds (the model's context length): only the Triton backend runs there.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """Paged attention over one layer's KV cache."""

    name: str

    def prepare(self, num_heads: int, k_cache: torch.Tensor) -> None:
        """Compile or load what :meth:`forward` needs for ``num_heads`` query heads over
        caches like ``k_cache`` (called once, when the engine is built, so that no
        request waits for it)."""
        ...

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the new tokens' K/V at ``slot_mapping`` (in place)."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q`` over each sequence's cached context: [total_q, H, D]."""
        ...
