"""The AVX2 int8 linear kernel: exact int32 sums of int16 inputs and int8 weights (the
reference's, bit for bit, up to the overflow bound), every panel and row tail,
batch- and thread-invariant rows, gate/up pairs with SiLU * up from the epilogue, and
clear refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels.cpu_gemm_avx2 import Avx2Int8Gemm

INT32_MAX = 2**31 - 1


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05


def _reference(x: torch.Tensor, w: torch.Tensor, qmax: int) -> torch.Tensor:
    """The kernel's arithmetic in torch: weights per row to int8, each input row to int16
    (x * (qmax / max |x|) in float32, rounded half to even, within +-qmax), int64 sums,
    then sum x (column scale x row scale), all float32."""
    wf = w.float()
    w_scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    wq = torch.round(wf / w_scale[:, None]).clamp(-127, 127).to(torch.int64)
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.tensor(float(qmax)) / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv[:, None]).clamp(-qmax, qmax).to(torch.int64)
    sums = xq @ wq.T
    assert sums.abs().max() <= INT32_MAX  # what the kernel sums in int32 fits
    row_scale = amax / float(qmax)
    return sums.to(torch.int32).float() * (w_scale[None, :] * row_scale[:, None])


# n: one and several 16-column panels; m: whole 6-row blocks and every tail
@pytest.mark.parametrize("n", [16, 32, 112, 976])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 13, 64])
def test_products_are_the_reference_bit_for_bit(
    avx2_int8_gemm: Avx2Int8Gemm, m: int, n: int
) -> None:
    k = 80
    x, w = _case(m, n, k, seed=m + n)
    x[0, 3] = 0.0  # and a zero row below, where there is one
    if m > 2:
        x[2] = 0.0
    out = avx2_int8_gemm.linear(x, avx2_int8_gemm.quantize(w), threads=2)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert torch.equal(out, _reference(x, w, avx2_int8_gemm.qmax(k)))
    if m > 2:
        assert not out[2].any()


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 20),
    panels=st.integers(1, 4),
    k16=st.integers(1, 140),  # k up to 2,240: qmax below 32,767 from k = 528
    seed=st.integers(0, 2**16),
    extreme=st.booleans(),
)
def test_sums_never_overflow_and_stay_exact(
    avx2_int8_gemm: Avx2Int8Gemm, m: int, panels: int, k16: int, seed: int, extreme: bool
) -> None:
    """Random shapes, and the worst case for the int32 sums: every input at +-max|x| and
    every weight at +-max|w| of its row, signs aligned, so every product is qmax x 127."""
    n, k = 16 * panels, 16 * k16
    x, w = _case(m, n, k, seed=seed)
    if extreme:
        signs = torch.where(
            torch.rand(k, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0
        )
        x = signs.expand(m, k) * 3.0
        w = signs.expand(n, k) * 0.5
    out = avx2_int8_gemm.linear(x, avx2_int8_gemm.quantize(w), threads=2)
    assert torch.equal(out, _reference(x, w, avx2_int8_gemm.qmax(k)))
    if extreme:
        assert torch.allclose(out, torch.full((m, n), 1.5 * k), rtol=1e-6)


def test_qmax_keeps_every_sum_within_int32(avx2_int8_gemm: Avx2Int8Gemm) -> None:
    for k in (16, 512, 528, 576, 1536, 8192, 2**20):
        q = avx2_int8_gemm.qmax(k)
        assert 1 <= q <= 32767 and k * q * 127 <= INT32_MAX
        assert q == 32767 or k * (q + 1) * 127 > INT32_MAX  # and no tighter than needed


def test_products_are_close_to_the_float_ones(avx2_int8_gemm: Avx2Int8Gemm) -> None:
    x, w = _case(64, 960, 576, seed=3)
    out = avx2_int8_gemm.linear(x, avx2_int8_gemm.quantize(w), threads=2)
    ref = torch.nn.functional.linear(x, w)
    error = ((out - ref).norm() / ref.norm()).item()
    assert error < 0.01, f"relative error {error:.4f}"


def test_a_rows_result_depends_on_neither_batch_nor_threads(avx2_int8_gemm: Avx2Int8Gemm) -> None:
    x, w = _case(37, 144, 576, seed=1)
    x[9] *= 100.0  # a row with a far larger range: per-tensor scales would hurt the others
    weight = avx2_int8_gemm.quantize(w)
    whole = avx2_int8_gemm.linear(x, weight, threads=2)
    for i in (0, 5, 6, 36):
        assert torch.equal(avx2_int8_gemm.linear(x[i : i + 1], weight, threads=1), whole[i : i + 1])
    assert torch.equal(avx2_int8_gemm.linear(x[5:20], weight, threads=2), whole[5:20])
    assert torch.equal(avx2_int8_gemm.linear(x, weight, threads=1), whole)


def test_long_calls_pass_in_chunks_of_rows(avx2_int8_gemm: Avx2Int8Gemm) -> None:
    """More rows than one pass over the panels takes (192 KB of int16 inputs)."""
    x, w = _case(700, 32, 1536, seed=4)
    out = avx2_int8_gemm.linear(x, avx2_int8_gemm.quantize(w), threads=2)
    assert torch.equal(out, _reference(x, w, avx2_int8_gemm.qmax(1536)))


def test_strided_rows_and_empty_calls(avx2_int8_gemm: Avx2Int8Gemm) -> None:
    x, w = _case(6, 48, 64, seed=2)
    wide = torch.zeros(6, 100)
    wide[:, 10:74] = x
    weight = avx2_int8_gemm.quantize(w)
    assert torch.equal(
        avx2_int8_gemm.linear(wide[:, 10:74], weight, 2), avx2_int8_gemm.linear(x, weight, 2)
    )
    assert avx2_int8_gemm.linear(x[:0], weight, 2).shape == (0, 48)


def test_bad_shapes_and_dtypes_are_refused(avx2_int8_gemm: Avx2Int8Gemm) -> None:
    x, w = _case(2, 48, 64)
    with pytest.raises(ValueError, match="cannot quantize"):
        avx2_int8_gemm.quantize(w[:40])  # n not a multiple of 16
    with pytest.raises(ValueError, match="cannot quantize"):
        avx2_int8_gemm.quantize(w[:, :40])  # k not a multiple of 16
    weight = avx2_int8_gemm.quantize(w)
    with pytest.raises(ValueError, match="float32"):
        avx2_int8_gemm.linear(x.to(torch.bfloat16), weight, 2)
    with pytest.raises(ValueError, match="unit column stride"):
        avx2_int8_gemm.linear(x.t().contiguous().t(), weight, 2)
    with pytest.raises(ValueError, match="features"):
        avx2_int8_gemm.linear(x[:, :48], weight, 2)
    with pytest.raises(ValueError, match="paired=True"):
        avx2_int8_gemm.silu_mul(x, weight, 2)  # a plain weight has no gate/up halves


@pytest.mark.parametrize("m", [1, 5, 6, 13])
@pytest.mark.parametrize("n", [32, 96, 3072])
def test_paired_products_and_silu(avx2_int8_gemm: Avx2Int8Gemm, m: int, n: int) -> None:
    """A gate/up pair packed paired: the same products as packed plain, bit for bit, and
    SiLU(gate) * up from the epilogue as torch computes it from those products, to
    float32 rounding (the kernel's exp is not torch's)."""
    x, w = _case(m, n, 96, seed=n + m)
    x[0] *= 400.0  # gates far beyond exp's range both ways
    paired, plain = avx2_int8_gemm.quantize(w, paired=True), avx2_int8_gemm.quantize(w)
    assert paired.paired and not plain.paired
    product = avx2_int8_gemm.linear(x, plain, threads=2)
    assert torch.equal(avx2_int8_gemm.linear(x, paired, threads=2), product)
    gate, up = product[:, : n // 2], product[:, n // 2 :]
    assert gate[0].abs().max() > 88.0  # e^-gate would overflow (or underflow) somewhere
    fused = avx2_int8_gemm.silu_mul(x, paired, threads=2)
    assert fused.shape == (m, n // 2) and fused.isfinite().all()
    torch.testing.assert_close(fused, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
    alone = avx2_int8_gemm.silu_mul(x[m - 1 :], paired, threads=1)
    assert torch.equal(alone, fused[m - 1 :])  # batch-invariant
