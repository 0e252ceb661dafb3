"""AttentionMetadata for hand-made batches in the attention backend tests."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata


def metadata(
    shapes: list[tuple[int, int]], tables: list[list[int]], slots: list[int] | None = None
) -> AttentionMetadata:
    """One row per sequence: ``shapes`` its (cached, new) tokens, ``tables`` its blocks
    (padded with block 0); ``slots`` where the new tokens' K/V go (default all 0: for
    tests that write K/V into the caches themselves)."""
    qlens = tuple(n for _, n in shapes)
    slens = tuple(c + n for c, n in shapes)
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots if slots is not None else [0] * sum(qlens),
                                  dtype=torch.int64),
        max_query_len=max(qlens),
        max_seq_len=max(slens),
        query_lens_cpu=qlens,
        seq_lens_cpu=slens,
    )
