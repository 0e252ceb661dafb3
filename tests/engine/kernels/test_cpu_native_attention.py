"""The native AVX-512 CPU attention kernels vs the pure-torch reference, their build
cache and their refusals. Skipped where they cannot be built (no AVX-512 or no C++
compiler: the CPU backend then runs the numba kernels, tested on their own)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import native_build
from engine.kernels.cpu_decode_attention import plan_decode_rows
from engine.kernels.cpu_native_attention import (
    FEW_ITEMS_PER_THREAD,
    QUERY_TILE,
    NativeKernels,
    balanced_query_tile,
    load_native_kernels,
    native_decode_rows,
    native_extend,
    plan_extend,
    supports,
)
from engine.kernels.kv_int8 import dequantize_rows, quantize_rows
from engine.kernels.reference import reference_paged_attention, reference_paged_decode
from tests.engine.kernels.kernel_batches import TOLERANCES, PagedBatch, build_paged_batch

WHY_NOT = native_build.unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernels: {WHY_NOT}")


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    return load_native_kernels(native_build.default_cache_dir())


@pytest.fixture(scope="module")
def amx_native(native: NativeKernels) -> NativeKernels:
    """The kernels where prefill can run on the AMX tiles (the CPU and the kernel give
    this process AMX-BF16), else the test skips."""
    if not native.extend_amx:
        pytest.skip("no AMX-BF16 tiles for this process")
    return native


# seq_lens (1, multiples of 16 and not, of the block size and not), heads, KV heads,
# head_dim, block size: every head_dim built, groups 1-8.
DECODE_CASES = [
    ([1], 4, 4, 64, 8),
    ([1, 19, 40], 6, 2, 64, 16),
    ([33, 8, 1], 4, 2, 16, 16),  # the tiny test model's shape
    ([5, 16, 17, 64], 8, 1, 32, 8),
    ([70, 3, 129], 9, 3, 64, 16),  # SmolLM2-135M's shape
    ([100, 1, 47], 8, 2, 128, 32),
    ([2048, 31], 9, 3, 64, 16),  # long context
    ([40, 13, 61], 9, 3, 64, 12),  # tiles that straddle blocks at every offset
]


def _caches(
    batch: PagedBatch, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's caches in ``cache_dtype`` (int8: quantized rows with their scales),
    and the float32 values they hold (the reference's input)."""
    if cache_dtype == torch.int8:
        k, v = quantize_rows(batch.k_cache), quantize_rows(batch.v_cache)
        return k, v, dequantize_rows(k), dequantize_rows(v)
    k, v = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    return k, v, k.float(), v.float()


def _decode(native: NativeKernels, batch: PagedBatch, k: torch.Tensor, v: torch.Tensor,
            threads: int | None = None, bf16_products: bool = True,
            int8_products: bool = False) -> torch.Tensor:  # fmt: skip
    n = batch.q.shape[0]
    rows = plan_decode_rows(n, batch.q.shape[1], k.shape[0], k.shape[1], batch.block_tables,
                            batch.seq_lens, torch.arange(n), torch.arange(n),
                            scratch=False)  # fmt: skip
    out = torch.full_like(batch.q, float("nan"))
    native_decode_rows(native, rows, batch.q, k, v, batch.q.shape[2] ** -0.5, out, threads,
                       bf16_products=bf16_products, int8_products=int8_products)  # fmt: skip
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("seq_lens, num_heads, num_kv_heads, head_dim, block_size", DECODE_CASES)
def test_decode_matches_reference(
    native: NativeKernels,
    cache_dtype: torch.dtype,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """A bfloat16 cache is widened exactly and an int8 cache dequantized as it is read,
    so float32 tolerances against the values each holds hold for all three."""
    batch = build_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size,
        torch.float32, "cpu",
    )  # fmt: skip
    k, v, k_ref, v_ref = _caches(batch, cache_dtype)
    out = _decode(native, batch, k, v)
    ref = reference_paged_decode(batch.q, k_ref, v_ref, batch.block_tables,
                                 batch.seq_lens, head_dim**-0.5)  # fmt: skip
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


# Per sequence (query rows, context): a whole prompt, chunks after a cached prefix,
# single rows, contexts that are not multiples of the 16-key tile or the block size.
EXTEND_CASES = [
    ([1], [1], 4, 4, 64, 8),
    ([5, 3, 40], [5, 17, 40], 6, 2, 64, 16),
    ([33, 7], [100, 7], 4, 2, 16, 16),  # the tiny test model's shape
    ([24, 17], [1048, 17], 9, 3, 64, 16),  # a 1,024-token prefix hit on SmolLM2-135M
    ([16, 31], [48, 31], 8, 1, 32, 8),
    ([9, 20], [30, 20], 8, 2, 128, 32),
]


# The bfloat16 dot-product path (bfloat16 cache and queries): products exact, P rounded to
# bfloat16 for P.V (a relative 2^-9 per probability), sums in float32.
BF16_PRODUCTS = {"atol": 1e-2, "rtol": 1e-2}


def _reference(batch: PagedBatch, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference prefill of ``batch``'s chunks over float32 caches ``k`` and ``v``."""
    return reference_paged_attention(batch.q, k, v, batch.query_start_loc, batch.seq_lens,
                                     batch.block_tables, scale)  # fmt: skip


def _bf16_queries(batch: PagedBatch) -> PagedBatch:
    """``batch`` with its queries rounded to bfloat16 values (a bfloat16 model's)."""
    return dataclasses.replace(batch, q=batch.q.to(torch.bfloat16).float())


def _extend_each(native: NativeKernels, batch: PagedBatch, k: torch.Tensor, v: torch.Tensor,
                 query_tile: int | None, bf16_products: bool = True,
                 amx: bool = False) -> torch.Tensor:  # fmt: skip
    """Every sequence's chunk of ``batch`` through the native extend kernel, one call
    each, as [T, H, D] (NaN where a call wrote nothing)."""
    out = torch.full_like(batch.q, float("nan"))
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens_cpu):
        lo, hi = starts[seq], starts[seq + 1]
        chunk = plan_extend(batch.block_tables[seq], seq_len, hi - lo, k.shape[0], k.shape[1])
        part = torch.empty_like(batch.q[lo:hi])
        native_extend(native, chunk, batch.q[lo:hi].contiguous(), k, v,
                      batch.q.shape[2] ** -0.5, part, query_tile=query_tile,
                      bf16_products=bf16_products, amx=amx)  # fmt: skip
        out[lo:hi] = part
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("query_tile", [1, 16, None])
@pytest.mark.parametrize(
    "query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size", EXTEND_CASES
)
def test_extend_matches_reference(
    native: NativeKernels,
    cache_dtype: torch.dtype,
    query_tile: int | None,
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """Each sequence's chunk attends causally to its cached prefix and to itself; the
    query tile (the rows one work item holds) changes nothing but the speed."""
    batch = build_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                              block_size, torch.float32, "cpu", seed=3)  # fmt: skip
    k, v, k_ref, v_ref = _caches(batch, cache_dtype)
    scale = head_dim**-0.5
    ref = _reference(batch, k_ref, v_ref, scale)
    out = _extend_each(native, batch, k, v, query_tile)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("query_tile", [1, 16, None])
@pytest.mark.parametrize(
    "query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size", EXTEND_CASES
)
def test_bf16_queries_over_a_bf16_cache_match_reference(
    native: NativeKernels,
    query_tile: int | None,
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """A bfloat16 model's prefill: on bfloat16 dot products where the CPU has them
    (within their rounding of P), and on float32 products when asked (exact widening:
    float32 tolerances)."""
    batch = _bf16_queries(build_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads,
                                            head_dim, block_size, torch.float32, "cpu",
                                            seed=5))  # fmt: skip
    k, v, k_ref, v_ref = _caches(batch, torch.bfloat16)
    ref = _reference(batch, k_ref, v_ref, head_dim**-0.5)
    fast = _extend_each(native, batch, k, v, query_tile)
    exact = _extend_each(native, batch, k, v, query_tile, bf16_products=False)
    torch.testing.assert_close(fast, ref, **BF16_PRODUCTS)
    torch.testing.assert_close(exact, ref, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    "query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size",
    [*EXTEND_CASES,
     ([272, 64], [272, 1088], 9, 3, 64, 16),  # a prompt; 64 rows after a 1,024-token hit
     ([100, 33], [100, 233], 6, 2, 32, 8),  # rows and keys past whole 16-row / 32-key tiles
     ([48], [48], 16, 2, 64, 16)],  # eight query heads per KV head
)  # fmt: skip
def test_amx_prefill_matches_reference(
    amx_native: NativeKernels,
    cache_dtype: torch.dtype,
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """A bfloat16 model's prefill on the AMX tiles (head_dim 32 and 64; other sizes keep
    the vectors) over a bfloat16 cache, or an int8 one (rows dequantized to bfloat16), is
    the reference over the values the cache holds within the bfloat16 paths' rounding."""
    batch = _bf16_queries(build_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads,
                                            head_dim, block_size, torch.float32, "cpu",
                                            seed=9))  # fmt: skip
    k, v, k_ref, v_ref = _caches(batch, cache_dtype)
    ref = _reference(batch, k_ref, v_ref, head_dim**-0.5)
    torch.testing.assert_close(_extend_each(amx_native, batch, k, v, None, amx=True), ref,
                               **BF16_PRODUCTS)  # fmt: skip


def test_amx_is_taken_only_where_it_runs(amx_native: NativeKernels) -> None:
    """Asked for the tiles, a bfloat16 model's chunk over a bfloat16 or int8 cache takes
    them (not the vectors' values, bit for bit); queries with float32 bits below
    bfloat16's, a float32 cache and head_dim 128 keep the vectors' path exactly."""
    batch = build_paged_batch([24, 40], [1048, 40], 9, 3, 64, 16, torch.float32, "cpu", seed=6)
    k, v, _, _ = _caches(batch, torch.bfloat16)
    rounded = _bf16_queries(batch)
    tiles = _extend_each(amx_native, rounded, k, v, None, amx=True)
    assert not torch.equal(tiles, _extend_each(amx_native, rounded, k, v, None))
    k8, v8, _, _ = _caches(batch, torch.int8)
    assert not torch.equal(_extend_each(amx_native, rounded, k8, v8, None, amx=True),
                           _extend_each(amx_native, rounded, k8, v8, None))  # fmt: skip
    assert torch.equal(_extend_each(amx_native, batch, k, v, None, amx=True),
                       _extend_each(amx_native, batch, k, v, None))  # fmt: skip
    k32, v32, _, _ = _caches(rounded, torch.float32)
    assert torch.equal(_extend_each(amx_native, rounded, k32, v32, None, amx=True),
                       _extend_each(amx_native, rounded, k32, v32, None))  # fmt: skip
    wide = _bf16_queries(build_paged_batch([9], [30], 8, 2, 128, 32, torch.float32, "cpu",
                                           seed=7))  # fmt: skip
    kw, vw, _, _ = _caches(wide, torch.bfloat16)
    assert torch.equal(_extend_each(amx_native, wide, kw, vw, None, amx=True),
                       _extend_each(amx_native, wide, kw, vw, None))  # fmt: skip


def test_bf16_products_are_taken_only_for_bf16_queries(native: NativeKernels) -> None:
    """Where the library has the dot-product path, a bfloat16 model's queries take it
    (P rounded: not the float32 path's values); where it has none, asking for it changes
    nothing. Queries with float32 bits below bfloat16's keep the float32 path bit for bit
    either way (their products would not be exact)."""
    batch = build_paged_batch([24], [1048], 9, 3, 64, 16, torch.float32, "cpu", seed=6)
    k, v, _, _ = _caches(batch, torch.bfloat16)
    rounded = _bf16_queries(batch)
    fast = _extend_each(native, rounded, k, v, None)
    exact = _extend_each(native, rounded, k, v, None, bf16_products=False)
    assert torch.equal(fast, exact) is not native.bf16_products
    float_q = _extend_each(native, batch, k, v, None)
    assert torch.equal(float_q, _extend_each(native, batch, k, v, None, bf16_products=False))


@pytest.mark.parametrize("seq_lens, num_heads, num_kv_heads, head_dim, block_size", DECODE_CASES)
def test_bf16_decode_rows_over_a_bf16_cache_match_reference(
    native: NativeKernels,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """A bfloat16 model's decode rows: on bfloat16 dot products where the CPU has them
    (head_dim a multiple of 32; odd tiles pair their last key with nothing), within
    their rounding of P; on float32 products when asked, within float32 tolerances."""
    batch = _bf16_queries(build_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size,
        torch.float32, "cpu", seed=9,
    ))  # fmt: skip
    k, v, k_ref, v_ref = _caches(batch, torch.bfloat16)
    ref = reference_paged_decode(batch.q, k_ref, v_ref, batch.block_tables,
                                 batch.seq_lens, head_dim**-0.5)  # fmt: skip
    fast = _decode(native, batch, k, v, bf16_products=True)
    exact = _decode(native, batch, k, v, bf16_products=False)
    torch.testing.assert_close(fast, ref, **BF16_PRODUCTS)
    torch.testing.assert_close(exact, ref, **TOLERANCES[torch.float32])


def test_bf16_decode_products_are_taken_only_for_bf16_queries(native: NativeKernels) -> None:
    """As for prefill: a bfloat16 model's decode rows take the dot-product path where the
    library has it (P rounded: not the float32 path's values) and a head_dim it covers;
    float32 queries keep the float32 path bit for bit."""
    batch = build_paged_batch([1, 1], [300, 77], 9, 3, 64, 16, torch.float32, "cpu", seed=10)
    k, v, _, _ = _caches(batch, torch.bfloat16)
    rounded = _bf16_queries(batch)
    fast = _decode(native, rounded, k, v, bf16_products=True)
    exact = _decode(native, rounded, k, v, bf16_products=False)
    assert torch.equal(fast, exact) is not native.bf16_products
    float_q = _decode(native, batch, k, v, bf16_products=True)
    assert torch.equal(float_q, _decode(native, batch, k, v, bf16_products=False))


@pytest.mark.parametrize("seq_lens, num_heads, num_kv_heads, head_dim, block_size", DECODE_CASES)
def test_int8_decode_rows_on_integer_products_match_reference(
    native: NativeKernels,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """Over an int8 cache, decode rows on VNNI integer products (the query and each
    tile's P x V-scale quantized to int16, products and tile sums exact in int32) stay
    within float32 tolerances of the reference over the dequantized values, as the
    float32 path does; a bfloat16 model's rows (bfloat16 q and out) too."""
    batch = build_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size,
        torch.float32, "cpu", seed=11,
    )  # fmt: skip
    k, v, k_ref, v_ref = _caches(batch, torch.int8)
    ref = reference_paged_decode(batch.q, k_ref, v_ref, batch.block_tables,
                                 batch.seq_lens, head_dim**-0.5)  # fmt: skip
    for products in (True, False):
        out = _decode(native, batch, k, v, int8_products=products)
        torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    bf16 = _bf16_queries(batch)
    ref16 = reference_paged_decode(bf16.q, k_ref, v_ref, batch.block_tables,
                                   batch.seq_lens, head_dim**-0.5)  # fmt: skip
    q16 = dataclasses.replace(bf16, q=bf16.q.to(torch.bfloat16))  # out follows q's dtype
    out16 = _decode(native, q16, k, v, int8_products=True)
    torch.testing.assert_close(out16.float(), ref16, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [64, 16])
def test_int8_decode_products_are_taken_where_the_library_has_them(
    native: NativeKernels, head_dim: int
) -> None:
    """Asked for integer products, decode over an int8 cache takes them where the
    library was built with AVX512-VNNI and the head_dim is whole 32-value slices (the
    sums are not the float32 path's, bit for bit); elsewhere it runs the float32 path.
    A bfloat16 cache ignores the flag."""
    batch = build_paged_batch([1, 1], [300, 77], 9, 3, head_dim, 16, torch.float32, "cpu",
                              seed=12)  # fmt: skip
    k, v, _, _ = _caches(batch, torch.int8)
    fast = _decode(native, batch, k, v, int8_products=True)
    exact = _decode(native, batch, k, v, int8_products=False)
    assert torch.equal(fast, exact) is not (native.int8_products and head_dim % 32 == 0)
    k16, v16, _, _ = _caches(batch, torch.bfloat16)
    assert torch.equal(_decode(native, batch, k16, v16, bf16_products=False, int8_products=True),
                       _decode(native, batch, k16, v16, bf16_products=False))


def _in_a_wider_row(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` [T, H, D] in ``dtype`` as the model hands it over: the first H x D columns of
    a wider row (the stacked q/k/v projection), so its token rows are not adjacent."""
    t, h, d = q.shape
    wide = torch.full((t, h * d + 3 * d), float("nan"), dtype=dtype)
    wide[:, : h * d] = q.reshape(t, h * d).to(dtype)
    return wide[:, : h * d].view(t, h, d)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("bf16_products", [True, False])
def test_bf16_q_and_out_in_place_equal_float32_copies(
    native: NativeKernels, cache_dtype: torch.dtype, bf16_products: bool
) -> None:
    """A bfloat16 model's q read in place (a view into a wider row) and its out written
    in bfloat16 give, bit for bit, what float32 copies of q gave, rounded as torch rounds;
    prefill chunks and decode rows."""
    batch = _bf16_queries(build_paged_batch([24, 1, 5, 1], [1048, 40, 5, 17], 9, 3, 64, 16,
                                            torch.float32, "cpu", seed=8))  # fmt: skip
    k, v, _, _ = _caches(batch, cache_dtype)
    q16 = _in_a_wider_row(batch.q, torch.bfloat16)
    starts = batch.query_start_loc.tolist()
    want = torch.empty_like(batch.q)
    got = torch.full_like(q16, float("nan"))
    for seq, seq_len in enumerate(batch.seq_lens_cpu):
        lo, hi = starts[seq], starts[seq + 1]
        chunk = plan_extend(batch.block_tables[seq], seq_len, hi - lo, k.shape[0], k.shape[1])
        native_extend(native, chunk, batch.q[lo:hi].contiguous(), k, v, 0.125, want[lo:hi],
                      bf16_products=bf16_products)  # fmt: skip
        native_extend(native, chunk, q16[lo:hi], k, v, 0.125, got[lo:hi],
                      bf16_products=bf16_products)  # fmt: skip
    assert torch.equal(got, want.to(torch.bfloat16))
    rows = torch.tensor([1, 27, 28], dtype=torch.int64)  # rows of q that are decodes
    plan = plan_decode_rows(batch.q.shape[0], 9, k.shape[0], 16, batch.block_tables,
                            batch.seq_lens, rows, torch.tensor([0, 1, 3]),
                            scratch=False)  # fmt: skip
    want, got = torch.zeros_like(batch.q), torch.zeros_like(q16)
    native_decode_rows(native, plan, batch.q, k, v, 0.125, want)
    native_decode_rows(native, plan, q16, k, v, 0.125, got)
    assert torch.equal(got, want.to(torch.bfloat16))
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # rows not planned: untouched


def test_threads_do_not_change_the_result(native: NativeKernels) -> None:
    batch = build_paged_batch([1] * 5, [61, 30, 1, 17, 200], 9, 3, 64, 16, torch.float32, "cpu")
    one = _decode(native, batch, batch.k_cache, batch.v_cache, threads=1)
    two = _decode(native, batch, batch.k_cache, batch.v_cache, threads=2)
    torch.testing.assert_close(one, two, atol=0, rtol=0)


ONE_RUNTIME_SCRIPT = """
import torch
from engine.kernels import native_build
from engine.kernels.cpu_decode_attention import plan_decode_rows
from engine.kernels.cpu_native_attention import load_native_kernels, native_decode_rows
from tests.engine.kernels.kernel_batches import build_paged_batch
torch.set_num_threads(2)
b = build_paged_batch([1] * 3, [40, 7, 90], 9, 3, 64, 16, torch.float32, "cpu")
k, v = b.k_cache.to(torch.bfloat16), b.v_cache.to(torch.bfloat16)
rows = plan_decode_rows(3, 9, k.shape[0], 16, b.block_tables, b.seq_lens, torch.arange(3),
                        torch.arange(3), scratch=False)
native_decode_rows(load_native_kernels(native_build.default_cache_dir()), rows, b.q, k, v,
                   0.125, torch.empty_like(b.q), 2)
torch.ones(512, 512) @ torch.ones(512, 512)
import json
print(json.dumps(sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "libgomp" in ln})))
"""


def test_attention_runs_on_torchs_openmp_runtime() -> None:
    """The launchers' threads are torch's: after a decode launch and a torch matmul, one
    libgomp is mapped, torch's own (a second runtime's idle threads would spin on the
    same cores)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", ONE_RUNTIME_SCRIPT], capture_output=True,
                          text=True, cwd=root, check=True, timeout=300)  # fmt: skip
    mapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(mapped) == 1 and Path(torch.__file__).parent.as_posix() in mapped[0], mapped


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_prefill_threads_do_not_change_the_result(
    native: NativeKernels, cache_dtype: torch.dtype
) -> None:
    batch = _bf16_queries(build_paged_batch([37], [150], 9, 3, 64, 16, torch.float32, "cpu"))
    k, v, _, _ = _caches(batch, cache_dtype)
    outs = []
    for threads in (1, 2):
        chunk = plan_extend(batch.block_tables[0], 150, 37, k.shape[0], 16)
        out = torch.full_like(batch.q, float("nan"))
        native_extend(native, chunk, batch.q, k, v, 0.125, out, threads)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_extreme_scores_stay_finite(native: NativeKernels, cache_dtype: torch.dtype) -> None:
    """Scores hundreds apart: the running max keeps every exp in range, as the
    reference's softmax does (bfloat16: on the dot-product path where there is one)."""
    batch = _bf16_queries(build_paged_batch([20], [50], 4, 2, 64, 16, torch.float32, "cpu",
                                            seed=4))  # fmt: skip
    k, v = (batch.k_cache * 30.0).to(cache_dtype), batch.v_cache.to(cache_dtype)
    chunk = plan_extend(batch.block_tables[0], 50, 20, k.shape[0], 16)
    out = torch.empty_like(batch.q)
    native_extend(native, chunk, batch.q, k, v, 0.125, out)
    ref = _reference(batch, k.float(), v.float(), 0.125)
    assert bool(torch.isfinite(out).all())
    tolerance = BF16_PRODUCTS if cache_dtype == torch.bfloat16 else TOLERANCES[torch.float32]
    torch.testing.assert_close(out, ref, **tolerance)


def test_unsupported_layouts_are_refused(native: NativeKernels) -> None:
    assert supports(9, 3, 64) and supports(8, 1, 128) and supports(4, 2, 16)
    assert not supports(9, 3, 8) and not supports(9, 1, 64) and not supports(6, 4, 64)
    batch = build_paged_batch([1], [9], 4, 2, 8, 8, torch.float32, "cpu")  # head_dim 8
    with pytest.raises(ValueError, match="head_dim 8"):
        _decode(native, batch, batch.k_cache, batch.v_cache)


def test_bad_chunks_and_tensors_are_refused(native: NativeKernels) -> None:
    batch = build_paged_batch([4], [20], 4, 2, 16, 8, torch.float32, "cpu")
    table, blocks = batch.block_tables[0], batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="query rows ending"):
        plan_extend(table, 20, 21, blocks, 8)
    with pytest.raises(ValueError, match="need >= 3 int32"):
        plan_extend(table.long(), 20, 4, blocks, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        plan_extend(table.clone().fill_(blocks), 20, 4, blocks, 8)
    chunk = plan_extend(table, 20, 4, blocks, 8)
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError, match="not the ones this chunk was planned for"):
        native_extend(native, chunk, batch.q[:3].contiguous(), batch.k_cache, batch.v_cache,
                      0.25, out[:3].contiguous())  # fmt: skip
    with pytest.raises(ValueError, match="q: need a float32 or bfloat16"):
        native_extend(native, chunk, batch.q.double(), batch.k_cache, batch.v_cache, 0.25, out)
    with pytest.raises(ValueError, match="q: need a float32 or bfloat16"):  # heads not rows
        native_extend(native, chunk, batch.q.transpose(0, 1).contiguous().transpose(0, 1),
                      batch.k_cache, batch.v_cache, 0.25, out)  # fmt: skip
    with pytest.raises(ValueError, match="out overlaps q"):
        native_extend(native, chunk, batch.q, batch.k_cache, batch.v_cache, 0.25, batch.q)
    shared = torch.zeros(8 * 64)  # out from q's last row, head 1 on
    q_in, out_in = shared[: 4 * 64].view(4, 4, 16), shared[3 * 64 + 16 :][: 4 * 64].view(4, 4, 16)
    with pytest.raises(ValueError, match="out overlaps q"):
        native_extend(native, chunk, q_in, batch.k_cache, batch.v_cache, 0.25, out_in)
    with pytest.raises(ValueError, match="out: need a float32 or bfloat16"):  # rows overlap
        native_extend(native, chunk, batch.q, batch.k_cache, batch.v_cache, 0.25,
                      out.flatten()[: out[0].numel() + 3].as_strided(out.shape, (3, 16, 1)))
    for tile in (0, 65):
        with pytest.raises(ValueError, match="query_tile must be in"):
            native_extend(native, chunk, batch.q, batch.k_cache, batch.v_cache, 0.25, out,
                          query_tile=tile)  # fmt: skip


def test_rows_planned_with_scratch_or_without_serve_their_kernel() -> None:
    batch = build_paged_batch([1], [9], 4, 2, 16, 8, torch.float32, "cpu")
    args = (1, 4, batch.k_cache.shape[0], 8, batch.block_tables, batch.seq_lens,
            torch.arange(1), torch.arange(1))  # fmt: skip
    assert plan_decode_rows(*args).scores.shape == (1, 4, 9)
    assert plan_decode_rows(*args, scratch=False).scores.numel() == 0


def test_library_is_built_once_per_source_and_machine(tmp_path: Path) -> None:
    """A second build finds the first one's file; the name carries the source's hash.
    On a one-function source with the real flags: compiling the kernels themselves into
    a fresh directory cost the suite ~28 s, and every test that loads them builds them."""
    if (reason := native_build.unavailable_reason()) is not None:
        pytest.skip(reason)
    source = tmp_path / "src" / "cpu_attention.cpp"
    source.parent.mkdir()
    source.write_text('extern "C" int kvt_probe() { return 1; }\n')
    cache = tmp_path / "cache"
    first = native_build.build(cache, source)
    stamp = first.stat().st_mtime_ns
    assert native_build.build(cache, source) == first
    assert first.stat().st_mtime_ns == stamp
    assert first.name.startswith("cpu_attention-") and first.suffix == ".so"
    lock = first.with_suffix(".lock")  # concurrent builders' turns (the next test)
    assert sorted(cache.iterdir()) == [lock, first]  # no temporary left behind
    source.write_text('extern "C" int kvt_probe() { return 2; }\n')
    second = native_build.build(cache, source)  # another source: another file
    assert second != first and {p.name for p in cache.glob("*.so")} == {first.name, second.name}


def test_concurrent_builders_compile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes starting at once on a fresh cache (two test workers, a gateway's
    workers) take turns: one compiles, the others load its file. The compiler here logs
    each compile and takes a second, so unlocked builders would overlap. The source needs
    no CPU flags: this runs wherever a compiler does."""
    if (real := native_build.compiler()) is None:
        pytest.skip("no C++ compiler")
    log = tmp_path / "compiles.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo x >> {log}; sleep 1;; esac\n'
                   f'exec {real} "$@"\n')  # fmt: skip
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    source = tmp_path / "probe.cpp"
    source.write_text('extern "C" int kvt_probe() { return 1; }\n')
    cache, none = tmp_path / "cache", frozenset[str]()
    with ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: native_build.build(cache, source, required=none), range(3)))
    assert len(set(built)) == 1 and built[0].exists()
    assert log.read_text().count("x") == 1


def test_a_failed_build_says_what_the_compiler_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_build, "CXX_FLAGS", (*native_build.CXX_FLAGS, "-fno-such-flag"))
    with pytest.raises(RuntimeError, match="no-such-flag"):
        native_build.build(tmp_path)
    assert list(tmp_path.glob("*.so*")) == []  # nothing half-written left to load later


def test_why_it_cannot_build_is_said() -> None:
    assert "avx512f" in (native_build.unavailable_reason(frozenset({"avx2"})) or "")


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 70)), min_size=1, max_size=3),
    layout=st.sampled_from([(4, 2, 16), (9, 3, 64), (8, 1, 32), (2, 2, 128), (16, 2, 16)]),
    block_size=st.sampled_from([8, 16, 32]),
    cache_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
    query_tile=st.integers(1, 20),
    bf16_queries=st.booleans(),
    amx=st.booleans(),
)
def test_any_chunks_match_reference(
    native: NativeKernels,
    chunks: list[tuple[int, int]],
    layout: tuple[int, int, int],
    block_size: int,
    cache_dtype: torch.dtype,
    query_tile: int,
    bf16_queries: bool,
    amx: bool,
) -> None:
    """Random chunks (query rows, tokens cached before them) over scattered blocks: every
    tile and block boundary, every remainder of the row groups (and of the 16-row lane
    groups of the bfloat16 dot-product path, of the AMX path's 16-row and 32-key tiles
    where asked and present), as prefill chunks and, for their last rows, as decode rows."""
    num_heads, num_kv_heads, head_dim = layout
    query_lens = [q for q, _ in chunks]
    seq_lens = [q + c for q, c in chunks]
    batch = build_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                              block_size, torch.float32, "cpu", seed=sum(seq_lens))  # fmt: skip
    if bf16_queries:
        batch = _bf16_queries(batch)
    k, v, k_ref, v_ref = _caches(batch, cache_dtype)
    scale = head_dim**-0.5
    ref = _reference(batch, k_ref, v_ref, scale)
    out = _extend_each(native, batch, k, v, query_tile, amx=amx)
    products = bf16_queries and cache_dtype == torch.bfloat16
    tiles = amx and bf16_queries and cache_dtype == torch.int8  # int8 rows to bfloat16
    torch.testing.assert_close(out, ref, **(BF16_PRODUCTS if products or tiles else
                                            TOLERANCES[torch.float32]))  # fmt: skip
    rows = batch.query_start_loc[1:].long() - 1  # each chunk's last row
    plan = plan_decode_rows(batch.q.shape[0], num_heads, k.shape[0], block_size,
                            batch.block_tables, batch.seq_lens, rows,
                            torch.arange(len(chunks)), scratch=False)  # fmt: skip
    out = torch.zeros_like(batch.q)
    native_decode_rows(native, plan, batch.q, k, v, scale, out)
    torch.testing.assert_close(out[rows], ref[rows], **(BF16_PRODUCTS if products else
                                                        TOLERANCES[torch.float32]))  # fmt: skip


@given(q_len=st.integers(1, 600), num_kv_heads=st.integers(1, 8), threads=st.integers(1, 8))
def test_balanced_query_tile_evens_out_few_items(q_len: int, num_kv_heads: int,
                                                 threads: int) -> None:  # fmt: skip
    """At most QUERY_TILE rows an item, every row covered, and where the default tiles
    make few items, a count of items every thread gets the same number of (unless
    the chunk has too few rows to split that far)."""
    tile = balanced_query_tile(q_len, num_kv_heads, threads)
    assert 1 <= tile <= QUERY_TILE
    default = -(-q_len // QUERY_TILE)

    def even(size: int) -> bool:
        return (-(-q_len // size) * num_kv_heads) % threads == 0

    if default * num_kv_heads >= FEW_ITEMS_PER_THREAD * threads:
        assert tile == -(-q_len // default)
    elif any(even(-(-q_len // n)) for n in range(default, q_len + 1)):
        assert even(tile)
        # the fewest tiles (of as equal sizes as may be) that do
        fewest = next(n for n in range(default, q_len + 1) if even(-(-q_len // n)))
        assert tile == -(-q_len // fewest)
    else:
        assert tile == -(-q_len // default)


def test_balanced_query_tile_on_smollm2_chunks() -> None:
    assert [balanced_query_tile(n, 3, 2) for n in (1, 8, 16, 24, 64, 512)] == [1, 4, 8, 12, 16, 16]
