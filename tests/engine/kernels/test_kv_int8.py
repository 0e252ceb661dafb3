"""The int8 KV row format (engine.kernels.kv_int8): each value within half a step of
the row's scale, the scale in the row's last 4 bytes, zero rows exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.kv_int8 import (
    SCALE_BYTES,
    dequantize_rows,
    head_dim_of,
    quantize_rows,
    row_width,
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    head_dim=st.sampled_from([2, 16, 64, 72]),
    magnitude=st.sampled_from([1e-6, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_round_trip_error_is_within_half_a_step(
    rows: int, head_dim: int, magnitude: float, seed: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 3, head_dim, generator=gen) * magnitude).to(dtype)
    q = quantize_rows(x)
    assert q.dtype == torch.int8 and q.shape == (rows, 3, row_width(head_dim))
    assert int(q[..., :-SCALE_BYTES].abs().max()) <= 127
    back = dequantize_rows(q)
    amax = x.float().abs().amax(-1, keepdim=True)
    assert bool(((back - x.float()).abs() <= amax / 254 * 1.0001 + 1e-30).all())
    # the largest value of each row is hit exactly up to float rounding of the scale
    top = x.float().abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, top).abs(), amax, rtol=1e-6, atol=0)


def test_a_zero_row_is_zeros_with_scale_zero() -> None:
    q = quantize_rows(torch.zeros(2, 64))
    assert not q.any()
    assert not dequantize_rows(q).any()


def test_head_dim_of_an_int8_cache_leaves_out_the_scale() -> None:
    assert head_dim_of(torch.zeros(1, 16, 3, row_width(64), dtype=torch.int8)) == 64
    assert head_dim_of(torch.zeros(1, 16, 3, 64, dtype=torch.bfloat16)) == 64


def test_dequantize_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="int8"):
        dequantize_rows(torch.zeros(1, 68))
