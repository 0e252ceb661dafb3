"""The CPU paged decode kernels (numba's stages, the AVX2 kernel) vs the pure-torch
reference, and their refusals."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.kernels.cpu_decode_attention import (
    CpuDecodeKernels,
    cpu_paged_decode_attention,
    decode_rows_attention,
    plan_decode_rows,
)
from engine.kernels.reference import reference_paged_decode
from tests.engine.kernels.kernel_batches import TOLERANCES, build_paged_batch

# seq_lens (1 and non-multiples of the block size included), heads, kv heads, head_dim,
# block size. Group sizes 1-4 and head_dims 8-128.
CASES = [
    ([1], 4, 4, 64, 8),
    ([1, 19, 40], 9, 3, 64, 16),
    ([33, 8, 1], 4, 2, 16, 16),  # the tiny test model's shape
    ([5, 16, 17, 64], 6, 2, 8, 4),
    ([70, 3, 129], 9, 3, 64, 16),  # SmolLM2-135M's shape
    ([100, 1], 8, 2, 128, 32),
    ([2048, 31], 9, 3, 64, 16),  # long context
]
# numba compiles its kernels once per (group, head_dim, kv heads) and cache dtype, ~3-8 s
# each on 2 cores: it runs the float32 cases of three shapes (groups 2-4, head_dims
# 16-128) and the bfloat16 ones of SmolLM2's (the dtype changes only how a value is
# widened, not the shape-dependent code). The AVX2 kernel, built once for every shape,
# runs every case in both dtypes.
NUMBA_SHAPES = {(3, 64, 3), (2, 16, 2), (4, 128, 2)}
NUMBA_BF16_SHAPES = {(3, 64, 3)}
DECODE_CASES = [
    pytest.param(kernel, cache_dtype, *case, id=f"{kernel}-{i}-{str(cache_dtype)[6:]}")
    for kernel in ("numba", "avx2")
    for cache_dtype in (torch.float32, torch.bfloat16)
    for i, case in enumerate(CASES)
    if kernel == "avx2"
    or (case[1] // case[2], case[3], case[2])
    in (NUMBA_SHAPES if cache_dtype == torch.float32 else NUMBA_BF16_SHAPES)
]


@pytest.fixture(scope="module", params=["numba", "avx2"])
def kernels(request: pytest.FixtureRequest) -> CpuDecodeKernels:
    """numba's stages, and the AVX2 kernel (engine.kernels.cpu_decode_avx2) in their place
    where it builds here (the session's ``avx2_decode``, which skips where it does not)."""
    if request.param == "numba":
        return CpuDecodeKernels()
    return CpuDecodeKernels(avx2=request.getfixturevalue("avx2_decode"))


@pytest.mark.parametrize(
    "kernels, cache_dtype, seq_lens, num_heads, num_kv_heads, head_dim, block_size",
    DECODE_CASES, indirect=["kernels"],
)  # fmt: skip
def test_decode_matches_reference(
    kernels: CpuDecodeKernels,
    cache_dtype: torch.dtype,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    """A bfloat16 cache is read exactly (widened to float32): its result is the float32
    kernel's on the same (rounded) values to float32 rounding, not merely bfloat16-close.
    Not bit for bit: the two kernels are compiled apart with fastmath, and LLVM may sum
    a dot product in another order in each (a bf16 kernel compiled by an engine process
    and a float32 one compiled later by the test process differed by 2.4e-7, 1e-4
    relative, on 74% of the outputs; bfloat16 rounding would be ~1e-2)."""
    batch = build_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size,
        torch.float32, "cpu",
    )  # fmt: skip
    k, v = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    scale = head_dim**-0.5
    args = (batch.block_tables, batch.seq_lens, scale)
    out = cpu_paged_decode_attention(batch.q, k, v, *args, kernels=kernels)
    ref = reference_paged_decode(batch.q, k.float(), v.float(), *args)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    if cache_dtype != torch.float32:
        widened = cpu_paged_decode_attention(batch.q, k.float(), v.float(), *args,
                                             kernels=kernels)  # fmt: skip
        torch.testing.assert_close(out, widened, atol=1e-6, rtol=1e-5)


def test_only_the_chosen_rows_are_written(kernels: CpuDecodeKernels) -> None:
    """Decode rows mixed with prefill rows: q_rows pick them, seq_ids their sequences."""
    batch = build_paged_batch([1, 1, 1], [12, 30, 7], 9, 3, 64, 8, torch.float32, "cpu", seed=2)
    q = torch.randn(10, 9, 64, generator=torch.Generator().manual_seed(5))
    q[[7, 2]] = batch.q[[0, 2]]  # rows 7 and 2 are the decodes of sequences 0 and 2
    out = torch.full_like(q, 123.0)
    cpu_paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125,
        kernels=kernels, q_rows=torch.tensor([7, 2]), seq_ids=torch.tensor([0, 2]), out=out,
    )  # fmt: skip
    ref = reference_paged_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125
    )
    torch.testing.assert_close(out[[7, 2]], ref[[0, 2]], **TOLERANCES[torch.float32])
    untouched = [i for i in range(10) if i not in (7, 2)]
    assert bool((out[untouched] == 123.0).all())


def test_threads_do_not_change_the_result(kernels: CpuDecodeKernels) -> None:
    batch = build_paged_batch([1] * 5, [61, 30, 1, 17, 200], 9, 3, 64, 16, torch.float32, "cpu")
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    one = cpu_paged_decode_attention(*args, kernels=kernels, num_threads=1)
    two = cpu_paged_decode_attention(*args, kernels=kernels, num_threads=2)
    torch.testing.assert_close(one, two, atol=0, rtol=0)


Args = tuple[torch.Tensor, ...]


def _batch() -> Args:
    b = build_paged_batch([1, 1], [9, 20], 4, 2, 16, 8, torch.float32, "cpu")
    return b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0].double(), *a[1:]), "q: need a contiguous float32"),
        (lambda a: (a[0], a[1].double(), *a[2:]), "k_cache: need a contiguous"),
        (lambda a: (a[0], a[1].to(torch.bfloat16), *a[2:]), "both caches alike"),
        (lambda a: (a[0].to(torch.bfloat16), *a[1:]), "q: need a contiguous float32"),
        (lambda a: (a[0].transpose(0, 1).contiguous().transpose(0, 1), *a[1:]), "q: need"),
        (lambda a: (a[0][:, :3].contiguous(), *a[1:]), "query heads over"),
        (lambda a: (*a[:3], a[3].long(), a[4]), "block_tables: need"),
        (lambda a: (*a[:3], a[3].clone().fill_(10_000), a[4]), "block ids outside the cache"),
        (lambda a: (*a[:4], torch.tensor([9, 0], dtype=torch.int32)), "seq_lens must be"),
        (lambda a: (*a[:4], torch.tensor([9, 999], dtype=torch.int32)), "seq_lens must be"),
    ],
)
def test_bad_arguments_are_refused(
    kernels: CpuDecodeKernels, change: Callable[[Args], Args], message: str
) -> None:
    args = change(_batch())
    with pytest.raises(ValueError, match=message):
        cpu_paged_decode_attention(*args, 0.25, kernels=kernels)


def test_out_of_range_rows_are_refused(kernels: CpuDecodeKernels) -> None:
    q, k, v, tables, lens = _batch()
    with pytest.raises(ValueError, match="q_rows out of range"):
        cpu_paged_decode_attention(q, k, v, tables, lens, 0.25, kernels=kernels,
                                   q_rows=torch.tensor([0, 2]), seq_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="seq_ids out of range"):
        cpu_paged_decode_attention(q, k, v, tables, lens, 0.25, kernels=kernels,
                                   q_rows=torch.tensor([0, 1]), seq_ids=torch.tensor([0, 2]))


def test_planned_rows_serve_several_layers_and_refuse_other_shapes(
    kernels: CpuDecodeKernels,
) -> None:
    """Rows planned once (indices checked then) run against each layer's caches; a q or
    cache of another shape than planned is refused, not read out of bounds."""
    layers = [build_paged_batch([1] * 3, [12, 30, 7], 9, 3, 64, 8, torch.float32, "cpu", seed=s)
              for s in (3, 4)]  # fmt: skip
    b = layers[0]  # both layers share tables and lengths (one step)
    for other in layers[1:]:
        other.block_tables.copy_(b.block_tables)
    rows = plan_decode_rows(3, 9, b.k_cache.shape[0], b.k_cache.shape[1], b.block_tables,
                            b.seq_lens, torch.arange(3), torch.arange(3))  # fmt: skip
    for layer in layers:
        out = torch.empty_like(layer.q)
        decode_rows_attention(rows, layer.q, layer.k_cache, layer.v_cache, 0.125, out,
                              kernels=kernels)  # fmt: skip
        ref = reference_paged_decode(layer.q, layer.k_cache, layer.v_cache, b.block_tables,
                                     b.seq_lens, 0.125)  # fmt: skip
        torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="not the ones these rows were planned for"):
        decode_rows_attention(rows, b.q, b.k_cache[:-1].contiguous(), b.v_cache[:-1].contiguous(),
                              0.125, torch.empty_like(b.q), kernels=kernels)  # fmt: skip
    with pytest.raises(ValueError, match="not the ones these rows were planned for"):
        decode_rows_attention(rows, b.q[:2].contiguous(), b.k_cache, b.v_cache, 0.125,
                              torch.empty_like(b.q[:2]), kernels=kernels)  # fmt: skip
    with pytest.raises(ValueError, match="block ids outside the cache"):
        plan_decode_rows(3, 9, 2, 8, b.block_tables, b.seq_lens, torch.arange(3), torch.arange(3))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_new_kernel_set_loads_the_compiled_code_from_disk(cache_dtype: torch.dtype) -> None:
    """Every engine builds its own kernel set; the second of a shape must be a disk-cache
    hit, not another compile (a jitted helper among the closures' free variables once
    made every build compile anew, ~3 s, and add a cache entry)."""
    # SmolLM2's shape: compiled by this module already, so only the disk load is new
    batch = build_paged_batch([1, 1], [9, 20], 9, 3, 64, 16, torch.float32, "cpu", seed=11)
    k, v = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    sets = [CpuDecodeKernels(), CpuDecodeKernels()]
    for kernels in sets:
        cpu_paged_decode_attention(batch.q, k, v, batch.block_tables, batch.seq_lens, 0.2,
                                   kernels=kernels)  # fmt: skip
    for kernel in sets[1].get(3, 64, 3, cache_dtype == torch.bfloat16):
        stats = kernel.stats
        assert sum(stats.cache_misses.values()) == 0, stats
        assert sum(stats.cache_hits.values()) >= 1, stats
