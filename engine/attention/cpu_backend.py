"""Paged attention for CPU engines: decode rows through the numba kernel of
:mod:`engine.kernels.cpu_decode_attention` (K/V read from the block pool in place),
everything else as in :class:`engine.attention.torch_backend.TorchAttentionBackend`
(KV write, prefill chunks; and decode too for a cache that is neither float32 nor
bfloat16, which the kernel does not handle). A bfloat16 model's decode queries are
widened to float32 for the kernel and its outputs rounded back.

The torch path copies every decode row's context out of the pool at every layer and
step before attending to it; on a 64-request batch that copy and the attention after
it were ~45% of a decode step (profile of bench/engine_throughput.py).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.decode_groups import DEFAULT_GROUP_COST
from engine.attention.torch_backend import PREFILL_TILE, TorchAttentionBackend
from engine.kernels.cpu_decode_attention import (
    CACHE_DTYPES,
    CpuDecodeKernels,
    cpu_paged_decode_attention,
)


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode attention in the CPU paged kernel (float32 and
    bfloat16 caches)."""

    name = "cpu"

    def __init__(
        self,
        group_cost: int = DEFAULT_GROUP_COST,
        prefill_tile: int = PREFILL_TILE,
        fused_bf16_prefill: bool | None = None,
    ) -> None:
        """Arguments as for the torch backend (they govern its prefill, and decode for
        caches the kernel does not take)."""
        super().__init__(group_cost, prefill_tile, fused_bf16_prefill)
        self._kernels = CpuDecodeKernels()
        # This step's decode rows (q rows, sequence ids), built at the first layer and
        # reused by the others (same metadata object).
        self._step_rows: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    @property
    def kernels(self) -> CpuDecodeKernels:
        """The compiled decode kernels this backend runs."""
        return self._kernels

    def prepare(self, num_heads: int, k_cache: torch.Tensor) -> None:
        """Compile (first time on a machine, seconds) or load from numba's disk cache
        the decode kernels for this shape, by running them once on a one-token context."""
        if k_cache.dtype not in CACHE_DTYPES:
            return
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        cache = torch.zeros((1, block_size, num_kv_heads, head_dim), dtype=k_cache.dtype)
        cpu_paged_decode_attention(
            torch.zeros((1, num_heads, head_dim)), cache, cache.clone(),
            torch.zeros((1, 1), dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0,
            kernels=self._kernels,
        )  # fmt: skip

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
        if k_cache.dtype not in CACHE_DTYPES or q.dtype not in CACHE_DTYPES:
            super()._decode_rows(q, k_cache, v_cache, meta, qsl, scale, out)
            return
        if self._step_rows is None or self._step_rows[0] is not meta:
            decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
            self._step_rows = (
                meta,
                torch.tensor([qsl[i] for i in decodes], dtype=torch.int64),
                torch.tensor(decodes, dtype=torch.int64),
            )
        _, q_rows, seq_ids = self._step_rows
        if not q_rows.numel():
            return
        if q.dtype == torch.float32:
            cpu_paged_decode_attention(
                q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                q_rows=q_rows, seq_ids=seq_ids, out=out, kernels=self._kernels,
            )  # fmt: skip
            return
        rows = torch.arange(q_rows.numel(), dtype=torch.int64)  # the decode rows alone
        q32 = q.index_select(0, q_rows).float()
        out32 = cpu_paged_decode_attention(
            q32, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
            q_rows=rows, seq_ids=seq_ids, kernels=self._kernels,
        )  # fmt: skip
        out.index_copy_(0, q_rows, out32.to(out.dtype))
