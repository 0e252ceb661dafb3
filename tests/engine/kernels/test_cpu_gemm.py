"""The native bfloat16 linear kernel: products as a float32 reference rounds them, every
panel and row tail, batch-invariant rows, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu_fused import FusedKernels, silu_mul
from engine.kernels.cpu_gemm import NativeGemm, NativeInt8Gemm


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).to(torch.bfloat16),
            torch.randn(n, k, generator=gen).to(torch.bfloat16))  # fmt: skip


# n: whole 48-column panels, and 1 or 2 vectors left over; m: whole 8-row blocks and tails
@pytest.mark.parametrize("n", [16, 32, 48, 96, 112, 976])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64])
def test_products_match_a_float32_reference(native_gemm: NativeGemm, m: int, n: int) -> None:
    k = 72
    x, w = _case(m, n, k)
    out = native_gemm.linear(x, native_gemm.pack(w), n, threads=2)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # exact products, float32 sums in another order, one rounding to bfloat16
    assert torch.allclose(out.float(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max().item())
    assert (out != ref.to(torch.bfloat16)).float().mean() < 0.01  # an order's last bit, rarely


def test_a_rows_result_does_not_depend_on_its_batch(native_gemm: NativeGemm) -> None:
    x, w = _case(37, 144, 576, seed=1)
    packed = native_gemm.pack(w)
    whole = native_gemm.linear(x, packed, 144, threads=2)
    for i in (0, 7, 8, 36):
        alone = native_gemm.linear(x[i : i + 1], packed, 144, threads=1)
        assert torch.equal(alone, whole[i : i + 1])
    assert torch.equal(native_gemm.linear(x[5:20], packed, 144, threads=2), whole[5:20])


def test_strided_rows_and_empty_calls(native_gemm: NativeGemm) -> None:
    x, w = _case(6, 48, 64, seed=2)
    wide = torch.zeros(6, 100, dtype=torch.bfloat16)
    wide[:, 10:74] = x
    packed = native_gemm.pack(w)
    strided = native_gemm.linear(wide[:, 10:74], packed, 48, 2)
    assert torch.equal(strided, native_gemm.linear(x, packed, 48, 2))
    assert native_gemm.linear(x[:0], packed, 48, 2).shape == (0, 48)


def test_bad_shapes_and_dtypes_are_refused(native_gemm: NativeGemm) -> None:
    x, w = _case(2, 48, 64)
    with pytest.raises(ValueError, match="cannot pack"):
        native_gemm.pack(w[:40])  # n not a multiple of 16
    with pytest.raises(ValueError, match="cannot pack"):
        native_gemm.pack(w[:, :63])  # odd k
    with pytest.raises(ValueError, match="cannot pack"):
        native_gemm.pack(w.float())
    packed = native_gemm.pack(w)
    with pytest.raises(ValueError, match="bfloat16"):
        native_gemm.linear(x.float(), packed, 48, 2)
    with pytest.raises(ValueError, match="packed weight holds"):
        native_gemm.linear(x, packed, 32, 2)
    with pytest.raises(ValueError, match="unit column stride"):
        native_gemm.linear(x.t().contiguous().t(), packed, 48, 2)


# The int8 kernel (AVX512-VNNI): inputs quantized per row inside the call.


def _int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: per-channel weights and per-row inputs rounded
    half to even to [-127, 127], exact integer sums, then sum x (weight scale x row scale)
    in float32, rounded to bfloat16."""
    wf, xf = w.float(), x.float()
    w_scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    wq = torch.round(wf / w_scale[:, None]).clamp(-127, 127)
    amax = xf.abs().amax(dim=1)
    # 127 / max in float32, correctly rounded (torch's float32 division may be a last bit off)
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    xq = torch.round(xf * inv[:, None]).clamp(-127, 127)
    sums = (xq.double() @ wq.double().T).float()  # exact: integers far below 2**24
    row_scale = (amax.double() / 127.0).float()
    return (sums * (w_scale[None, :] * row_scale[:, None])).to(torch.bfloat16)


@pytest.mark.parametrize("n", [16, 32, 48, 96, 112, 976])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64])
def test_int8_products_are_the_reference_bit_for_bit(
    int8_gemm: NativeInt8Gemm, m: int, n: int
) -> None:
    k = 80
    x, w = _case(m, n, k, seed=m + n)
    x[0, 3] = 0.0  # and a zero row below, where there is one
    if m > 2:
        x[2] = 0.0
    out = int8_gemm.linear(x, int8_gemm.quantize(w), threads=2)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert torch.equal(out, _int8_reference(x, w))
    if m > 2:
        assert not out[2].any()


def test_int8_products_are_close_to_the_float_ones(int8_gemm: NativeInt8Gemm) -> None:
    x, w = _case(64, 960, 576, seed=3)
    out = int8_gemm.linear(x, int8_gemm.quantize(w), threads=2).float()
    ref = torch.nn.functional.linear(x.float(), w.float())
    error = ((out - ref).norm() / ref.norm()).item()
    assert error < 0.02, f"relative error {error:.4f}"


def test_an_int8_rows_result_does_not_depend_on_its_batch(int8_gemm: NativeInt8Gemm) -> None:
    x, w = _case(37, 144, 576, seed=1)
    x[9] *= 100.0  # a row with a far larger range: per-tensor scales would hurt the others
    weight = int8_gemm.quantize(w)
    whole = int8_gemm.linear(x, weight, threads=2)
    for i in (0, 7, 8, 36):
        assert torch.equal(int8_gemm.linear(x[i : i + 1], weight, threads=1), whole[i : i + 1])
    assert torch.equal(int8_gemm.linear(x[5:20], weight, threads=2), whole[5:20])


def test_int8_strided_rows_and_empty_calls(int8_gemm: NativeInt8Gemm) -> None:
    x, w = _case(6, 48, 64, seed=2)
    wide = torch.zeros(6, 100, dtype=torch.bfloat16)
    wide[:, 10:74] = x
    weight = int8_gemm.quantize(w)
    assert torch.equal(int8_gemm.linear(wide[:, 10:74], weight, 2), int8_gemm.linear(x, weight, 2))
    assert int8_gemm.linear(x[:0], weight, 2).shape == (0, 48)


def test_int8_bad_shapes_and_dtypes_are_refused(int8_gemm: NativeInt8Gemm) -> None:
    x, w = _case(2, 48, 64)
    with pytest.raises(ValueError, match="cannot quantize"):
        int8_gemm.quantize(w[:40])  # n not a multiple of 16
    with pytest.raises(ValueError, match="cannot quantize"):
        int8_gemm.quantize(w[:, :60])  # k not a multiple of 16
    with pytest.raises(ValueError, match="cannot quantize"):
        int8_gemm.quantize(w.to(torch.int32))
    weight = int8_gemm.quantize(w)
    with pytest.raises(ValueError, match="bfloat16"):
        int8_gemm.linear(x.float(), weight, 2)
    with pytest.raises(ValueError, match="the weight 64"):
        int8_gemm.linear(x[:, :32], weight, 2)
    with pytest.raises(ValueError, match="unit column stride"):
        int8_gemm.linear(x.t().contiguous().t(), weight, 2)


# Paired layouts (a gate and an up projection stacked): the same products, and SiLU * up
# in the epilogue exactly as the fused silu_mul computes it from the product.


@pytest.mark.parametrize("m", [1, 5, 12, 13, 64])
@pytest.mark.parametrize("n", [128, 384])
def test_paired_bf16_products_and_silu(
    native_gemm: NativeGemm, fused_kernels: FusedKernels, m: int, n: int
) -> None:
    x, w = _case(m, n, 96, seed=m * n)
    plain = native_gemm.linear(x, native_gemm.pack(w), n, threads=2)
    paired = native_gemm.pack(w, paired=True)
    assert torch.equal(native_gemm.linear(x, paired, n, threads=2, paired=True), plain)
    got = native_gemm.silu_mul(x, paired, n, threads=2)
    assert got.shape == (m, n // 2)
    assert torch.equal(got, silu_mul(fused_kernels, plain))


@pytest.mark.parametrize("m", [1, 5, 12, 13, 64])
@pytest.mark.parametrize("n", [128, 384])
def test_paired_int8_products_and_silu(
    int8_gemm: NativeInt8Gemm, fused_kernels: FusedKernels, m: int, n: int
) -> None:
    x, w = _case(m, n, 96, seed=m * n + 1)
    plain = int8_gemm.linear(x, int8_gemm.quantize(w), threads=2)
    paired = int8_gemm.quantize(w, paired=True)
    assert torch.equal(int8_gemm.linear(x, paired, threads=2), plain)
    assert torch.equal(int8_gemm.silu_mul(x, paired, threads=2), silu_mul(fused_kernels, plain))


def test_paired_layouts_refuse_what_they_cannot_hold(
    native_gemm: NativeGemm, int8_gemm: NativeInt8Gemm
) -> None:
    x, w = _case(2, 192, 64)  # 96 SiLU columns: not a multiple of 64
    assert native_gemm.supports(w) and not native_gemm.supports(w, paired=True)
    with pytest.raises(ValueError, match="n % 128 == 0"):
        native_gemm.pack(w, paired=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        int8_gemm.quantize(w, paired=True)
    with pytest.raises(ValueError, match="paired=True"):
        int8_gemm.silu_mul(x, int8_gemm.quantize(w), threads=2)


# The AMX path (where the CPU and the kernel give this process the tiles): the same packed
# panels, 16-row blocks with a tile configuration for the last partial one.


@pytest.fixture(scope="module")
def amx_gemm(native_gemm: NativeGemm) -> NativeGemm:
    if not native_gemm.amx:
        pytest.skip("no AMX tiles for this process here")
    return native_gemm


@pytest.mark.parametrize("m", [1, 15, 16, 17, 40, 64, 300])  # 300: two row chunks
@pytest.mark.parametrize("n", [16, 32, 48, 112, 976])
def test_amx_products_match_the_vectors(amx_gemm: NativeGemm, m: int, n: int) -> None:
    k = 96  # three 32-input steps
    x, w = _case(m, n, k, seed=m + n)
    packed = amx_gemm.pack(w)
    out = amx_gemm.linear(x, packed, n, threads=2)
    vectors = amx_gemm.on_vectors().linear(x, packed, n, threads=2)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert torch.allclose(out.float(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max().item())
    assert (out != vectors).float().mean() < 0.01  # the tiles' summing, in a last bit


@pytest.mark.parametrize("k", [576, 1536])  # 18 and 48 tile steps: 12 a pass, a tail
def test_amx_rows_are_batch_invariant_across_blocks(amx_gemm: NativeGemm, k: int) -> None:
    """A row alone (one block: every step in one pass) equals its row among 300 (256-row
    chunks of 16-row blocks, partial tails, the steps in passes of AMX_K_STEPS with the
    sums stored and reloaded between) bit for bit."""
    x, w = _case(300, 144, k, seed=3)
    packed = amx_gemm.pack(w)
    whole = amx_gemm.linear(x, packed, 144, threads=2)
    for i in (*range(40), 255, 256, 257, 299):
        assert torch.equal(amx_gemm.linear(x[i : i + 1], packed, 144, threads=1), whole[i : i + 1])
    assert torch.equal(amx_gemm.linear(x[3:30], packed, 144, threads=2), whole[3:30])
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert torch.allclose(whole.float(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max().item())


def test_amx_paired_silu_and_a_k_the_tiles_do_not_take(
    amx_gemm: NativeGemm, fused_kernels: FusedKernels
) -> None:
    x, w = _case(21, 256, 64, seed=4)
    plain = amx_gemm.linear(x, amx_gemm.pack(w), 256, threads=2)
    paired = amx_gemm.pack(w, paired=True)
    assert torch.equal(amx_gemm.linear(x, paired, 256, threads=2, paired=True), plain)
    assert torch.equal(amx_gemm.silu_mul(x, paired, 256, threads=2), silu_mul(fused_kernels, plain))
    x, w = _case(5, 48, 72, seed=5)  # k = 72: not a multiple of 32, runs on the vectors
    packed = amx_gemm.pack(w)
    assert torch.equal(amx_gemm.linear(x, packed, 48, 2),
                       amx_gemm.on_vectors().linear(x, packed, 48, 2))  # fmt: skip


@pytest.fixture(scope="module")
def amx_int8_gemm(int8_gemm: NativeInt8Gemm) -> NativeInt8Gemm:
    if not int8_gemm.amx:
        pytest.skip("no AMX int8 tiles for this process here")
    return int8_gemm


@pytest.mark.parametrize("m", [1, 15, 17, 40, 300])  # 300: two row chunks
@pytest.mark.parametrize("n", [16, 48, 112, 384])
def test_amx_int8_products_equal_the_vectors_bit_for_bit(
    amx_int8_gemm: NativeInt8Gemm, m: int, n: int
) -> None:
    x, w = _case(m, n, 128, seed=m * n + 2)  # two 64-input tile steps
    vectors = amx_int8_gemm.on_vectors()
    weight = amx_int8_gemm.quantize(w)
    assert torch.equal(amx_int8_gemm.linear(x, weight, threads=2),
                       vectors.linear(x, weight, threads=2))  # fmt: skip
    if n % 128 == 0:
        paired = amx_int8_gemm.quantize(w, paired=True)
        assert torch.equal(amx_int8_gemm.silu_mul(x, paired, threads=2),
                           vectors.silu_mul(x, paired, threads=2))  # fmt: skip
    x, w = _case(m, n, 1536, seed=m * n + 3)  # 24 tile steps: two passes over the blocks
    weight = amx_int8_gemm.quantize(w)
    assert torch.equal(amx_int8_gemm.linear(x, weight, threads=2),
                       vectors.linear(x, weight, threads=2))  # fmt: skip
    x, w = _case(m, n, 80, seed=m + n)  # k = 80: not a multiple of 64, on the vectors
    weight = amx_int8_gemm.quantize(w)
    assert torch.equal(amx_int8_gemm.linear(x, weight, threads=2),
                       vectors.linear(x, weight, threads=2))  # fmt: skip
