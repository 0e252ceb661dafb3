"""engine.runner: the warm-up batches (the warm-up run itself is checked end to end,
Triton kernels included, in tests/engine/kernels/test_triton_engine_e2e.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.runner import warmup_batches


@given(
    num_tokens=st.integers(1, 4096),
    num_seqs=st.integers(1, 256),
    max_model_len=st.integers(2, 4096),
    block_size=st.sampled_from([1, 8, 16, 32]),
    num_blocks=st.integers(1, 512),
)
def test_warmup_batches_cover_a_full_step(
    num_tokens: int, num_seqs: int, max_model_len: int, block_size: int, num_blocks: int
) -> None:
    prefill, decode = warmup_batches(num_tokens, num_seqs, max_model_len, block_size, num_blocks)
    assert sum(len(s.token_ids) for s in prefill) == num_tokens
    assert len(prefill) == len(decode) >= min(num_seqs, num_tokens)
    lengths = [len(s.token_ids) for s in prefill]
    assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1
    for first, second in zip(prefill, decode, strict=True):
        assert first.start == 0 and first.needs_logits
        assert second.start == len(first.token_ids) and len(second.token_ids) == 1
        assert second.start + 1 <= max_model_len  # room for the decoded token
        assert first.block_ids == second.block_ids
        assert len(first.block_ids) * block_size >= second.start + 1
        assert all(0 <= b < num_blocks for b in first.block_ids)
        assert max(second.slots(block_size)) < num_blocks * block_size


@pytest.mark.parametrize(
    "sizes", [(0, 4, 64, 16, 8), (8, 0, 64, 16, 8), (8, 4, 1, 16, 8), (8, 4, 64, 16, 0)]
)
def test_warmup_batches_refuse_empty_sizes(sizes: tuple[int, int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="warm-up needs positive sizes"):
        warmup_batches(*sizes)
