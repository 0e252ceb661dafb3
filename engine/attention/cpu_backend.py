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

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.decode_groups import DEFAULT_GROUP_COST
from engine.attention.torch_backend import PREFILL_TILE, TorchAttentionBackend
from engine.kernels.cpu_decode_attention import (
    CACHE_DTYPES,
    CpuDecodeKernels,
    DecodeRows,
    cpu_paged_decode_attention,
    decode_rows_attention,
    plan_decode_rows,
)


@dataclass(frozen=True)
class _StepDecode:
    """One step's decode rows as every layer runs them (built at the first layer)."""

    meta: AttentionMetadata
    dtype: torch.dtype  # of q: float32 runs in place, bfloat16 through float32 copies
    rows: DecodeRows
    q_index: torch.Tensor  # [R] int64 rows of q / out that are decodes
    all_rows: bool  # every row of q is a decode (no gather or scatter needed)
    out32: torch.Tensor | None  # bfloat16: the kernel's float32 output [R, H, D]


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
        # This step's decode rows, planned (and checked) at the first layer and reused
        # by the others (same metadata object): checking the block tables, building
        # index tensors and scratch at every layer were ~20% of decode attention
        # (1.6 of 8.1 s on bench/engine_throughput.py's 64 requests).
        self._step: _StepDecode | None = None

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
        step = self._step_decode(q, k_cache, meta, qsl)
        if not step.rows.num_rows:
            return
        if q.dtype == torch.float32:
            decode_rows_attention(step.rows, q.contiguous(), k_cache, v_cache, scale, out,
                                  kernels=self._kernels)  # fmt: skip
            return
        assert step.out32 is not None
        q32 = q.float() if step.all_rows else q.index_select(0, step.q_index).float()
        decode_rows_attention(step.rows, q32, k_cache, v_cache, scale, step.out32,
                              kernels=self._kernels)  # fmt: skip
        if step.all_rows:
            out.copy_(step.out32)
        else:
            out.index_copy_(0, step.q_index, step.out32.to(out.dtype))

    def _step_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, qsl: list[int]
    ) -> _StepDecode:
        step = self._step
        if step is not None and step.meta is meta and step.dtype == q.dtype:
            return step
        decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        q_index = torch.tensor([qsl[i] for i in decodes], dtype=torch.int64)
        seq_ids = torch.tensor(decodes, dtype=torch.int64)
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        if q.dtype == torch.float32:  # the kernel reads q and writes out in place
            rows = plan_decode_rows(q.shape[0], q.shape[1], num_blocks, block_size,
                                    meta.block_tables, meta.seq_lens, q_index, seq_ids)  # fmt: skip
            out32 = None
        else:  # it reads a float32 copy of the decode rows alone
            r = len(decodes)
            own_rows = torch.arange(r, dtype=torch.int64)
            rows = plan_decode_rows(r, q.shape[1], num_blocks, block_size, meta.block_tables,
                                    meta.seq_lens, own_rows, seq_ids)  # fmt: skip
            out32 = torch.empty((r, q.shape[1], q.shape[2]), dtype=torch.float32)
        self._step = _StepDecode(
            meta, q.dtype, rows, q_index, len(decodes) == q.shape[0], out32
        )
        return self._step
