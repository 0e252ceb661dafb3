"""The native bfloat16 linear kernel: products as a float32 reference rounds them, every
panel and row tail, batch-invariant rows, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu_gemm import NativeGemm, gemm_here


@pytest.fixture(scope="module")
def gemm() -> NativeGemm:
    found = gemm_here()
    if found is None:
        pytest.skip("no AVX512-BF16 or no compiler here: the kernel is not built")
    return found


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).to(torch.bfloat16),
            torch.randn(n, k, generator=gen).to(torch.bfloat16))  # fmt: skip


# n: whole 48-column panels, and 1 or 2 vectors left over; m: whole 8-row blocks and tails
@pytest.mark.parametrize("n", [16, 32, 48, 96, 112, 976])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64])
def test_products_match_a_float32_reference(gemm: NativeGemm, m: int, n: int) -> None:
    k = 72
    x, w = _case(m, n, k)
    out = gemm.linear(x, gemm.pack(w), n, threads=2)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # exact products, float32 sums in another order, one rounding to bfloat16
    assert torch.allclose(out.float(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max().item())
    assert (out != ref.to(torch.bfloat16)).float().mean() < 0.01  # an order's last bit, rarely


def test_a_rows_result_does_not_depend_on_its_batch(gemm: NativeGemm) -> None:
    x, w = _case(37, 144, 576, seed=1)
    packed = gemm.pack(w)
    whole = gemm.linear(x, packed, 144, threads=2)
    for i in (0, 7, 8, 36):
        assert torch.equal(gemm.linear(x[i : i + 1], packed, 144, threads=1), whole[i : i + 1])
    assert torch.equal(gemm.linear(x[5:20], packed, 144, threads=2), whole[5:20])


def test_strided_rows_and_empty_calls(gemm: NativeGemm) -> None:
    x, w = _case(6, 48, 64, seed=2)
    wide = torch.zeros(6, 100, dtype=torch.bfloat16)
    wide[:, 10:74] = x
    packed = gemm.pack(w)
    assert torch.equal(gemm.linear(wide[:, 10:74], packed, 48, 2), gemm.linear(x, packed, 48, 2))
    assert gemm.linear(x[:0], packed, 48, 2).shape == (0, 48)


def test_bad_shapes_and_dtypes_are_refused(gemm: NativeGemm) -> None:
    x, w = _case(2, 48, 64)
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(w[:40])  # n not a multiple of 16
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(w[:, :63])  # odd k
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(w.float())
    packed = gemm.pack(w)
    with pytest.raises(ValueError, match="bfloat16"):
        gemm.linear(x.float(), packed, 48, 2)
    with pytest.raises(ValueError, match="packed weight holds"):
        gemm.linear(x, packed, 32, 2)
    with pytest.raises(ValueError, match="unit column stride"):
        gemm.linear(x.t().contiguous().t(), packed, 48, 2)
