"""What only the AVX2 decode kernel (engine.kernels.cpu_decode_avx2) has to show: bit-for-bit
batch and thread invariance, its softmax at large scores, the shapes it is built for (its
reference parity runs with numba's, test_cpu_decode_attention.py); skips where this machine
cannot build it (no AVX2/FMA, no compiler)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import native_build
from engine.kernels.cpu_decode_attention import (
    CpuDecodeKernels,
    cpu_paged_decode_attention,
    decode_rows_attention,
    plan_decode_rows,
)
from engine.kernels.cpu_decode_avx2 import Avx2Decode, avx2_decode_here
from engine.kernels.reference import reference_paged_decode
from tests.engine.kernels.kernel_batches import TOLERANCES, build_paged_batch


@pytest.fixture(scope="module")
def kernels(avx2_decode: Avx2Decode) -> CpuDecodeKernels:
    return CpuDecodeKernels(avx2=avx2_decode)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_eight_query_heads_per_kv_head(kernels: CpuDecodeKernels, cache_dtype: torch.dtype) -> None:
    """The largest group it is built for (the shared parity cases in
    test_cpu_decode_attention.py stop at 4)."""
    b = build_paged_batch([1, 1], [13, 9], 8, 1, 32, 16, torch.float32, "cpu")
    k, v = b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    args = (b.block_tables, b.seq_lens, 32**-0.5)
    out = cpu_paged_decode_attention(b.q, k, v, *args, kernels=kernels)
    ref = reference_paged_decode(b.q, k.float(), v.float(), *args)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_depends_on_neither_its_batch_nor_the_threads(
    kernels: CpuDecodeKernels, cache_dtype: torch.dtype
) -> None:
    b = build_paged_batch([1] * 5, [61, 30, 1, 17, 200], 9, 3, 64, 16, torch.float32, "cpu")
    k, v = b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    args = (b.q, k, v, b.block_tables, b.seq_lens, 0.125)
    one = cpu_paged_decode_attention(*args, kernels=kernels, num_threads=1)
    two = cpu_paged_decode_attention(*args, kernels=kernels, num_threads=2)
    assert torch.equal(one, two)
    alone = torch.full_like(b.q, 7.0)  # row 4 alone, through the planned-rows entry
    rows = plan_decode_rows(5, 9, k.shape[0], k.shape[1], b.block_tables, b.seq_lens,
                            torch.tensor([4]), torch.tensor([4]))  # fmt: skip
    decode_rows_attention(rows, b.q, k, v, 0.125, alone, kernels=kernels)
    assert torch.equal(alone[4], one[4])
    assert bool((alone[:4] == 7.0).all())  # only the planned row written


def test_large_scores_do_not_overflow_the_softmax(kernels: CpuDecodeKernels) -> None:
    """Scores of +-1e4 (a far-off query): exp only ever sees score - max <= 0."""
    b = build_paged_batch([1, 1], [40, 9], 4, 2, 16, 16, torch.float32, "cpu", seed=9)
    q = b.q * 3000.0
    out = cpu_paged_decode_attention(q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 1.0,
                                     kernels=kernels)  # fmt: skip
    ref = reference_paged_decode(q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 1.0)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def test_shapes_it_is_not_built_for_go_to_numba(avx2_decode: Avx2Decode) -> None:
    avx2 = avx2_decode
    assert avx2.supports(3, 64) and avx2.supports(8, 128) and avx2.supports(1, 8)
    assert not avx2.supports(9, 64) and not avx2.supports(2, 48) and not avx2.supports(0, 64)
    b = build_paged_batch([1], [5], 9, 1, 16, 4, torch.float32, "cpu")  # group 9: numba
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 0.25)
    out = cpu_paged_decode_attention(*args, kernels=CpuDecodeKernels(avx2=avx2))
    torch.testing.assert_close(out, reference_paged_decode(*args), **TOLERANCES[torch.float32])
    rows = plan_decode_rows(1, 9, b.k_cache.shape[0], 4, b.block_tables, b.seq_lens,
                            torch.tensor([0]), torch.tensor([0]))  # fmt: skip
    with pytest.raises(ValueError, match="not built for 9 query heads"):
        avx2.run(b.q, b.k_cache, b.v_cache, 0.25, torch.empty_like(b.q),
                 (rows.block_tables, rows.seq_lens, rows.q_rows, rows.seq_ids), 1)  # fmt: skip


def test_no_avx2_means_no_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert native_build.unavailable_reason(frozenset({"sse2"}), native_build.AVX2_CPU_FLAGS)
    monkeypatch.setattr(native_build, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    found, why_not = avx2_decode_here(tmp_path)
    assert found is None and why_not is not None and "avx2" in why_not
