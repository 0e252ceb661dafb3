"""Copies whole blocks out of and into the runner's KV cache tensors.

Layout: the runner keeps one (K, V) pair per layer, each ``[num_blocks, block,
heads, dim]``; a gathered batch of ``n`` blocks is ``[n, layers, 2, block, heads,
dim]`` (the codec's per-block layout with a leading block axis).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class BlockIO:
    """Gather / scatter blocks by id across every layer."""

    def __init__(self, kv_caches: KVPairs) -> None:
        if not kv_caches:
            raise ValueError("no KV cache layers")
        self._caches = kv_caches
        k0 = kv_caches[0][0]
        self.device = k0.device
        self.dtype = k0.dtype
        self.shape = (len(kv_caches), k0.shape[1], k0.shape[2], k0.shape[3])

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A new tensor ``[n, layers, 2, block, heads, dim]`` on the cache's device."""
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return torch.stack(
            [torch.stack((k.index_select(0, idx), v.index_select(0, idx)), 1)
             for k, v in self._caches],
            1,
        )  # fmt: skip

    def write(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the blocks with ``data`` (``[n, layers, 2, block, heads, dim]``)."""
        if tuple(data.shape[1:]) != (self.shape[0], 2, *self.shape[1:]) or len(block_ids) != len(
            data
        ):
            raise ValueError(f"blocks of shape {tuple(data.shape)} do not fit {self.shape}")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        data = data.to(device=self.device, dtype=self.dtype)
        for layer, (k, v) in enumerate(self._caches):
            k.index_copy_(0, idx, data[:, layer, 0])
            v.index_copy_(0, idx, data[:, layer, 1])
