"""The fused native small ops (residual add + RMSNorm, RoPE + K/V write, SiLU * up) vs
the eager torch code they replace: equal bit for bit, float32 and bfloat16 (they sum
and exponentiate in torch's own order and algorithm); and their refusals. Skipped
where neither native build (AVX-512, AVX2) can be made (or no C++ compiler: the model then
runs the eager ops)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.kernels import native_build
from engine.kernels.cpu_fused import (
    PARALLEL_ROWS,
    FusedKernels,
    add_rmsnorm,
    argmax_rows,
    load_fused_kernels,
    plan_rope,
    rope_write_kv,
    row_threads,
    silu_mul,
)
from engine.kernels.cpu_fused import unavailable_reason as cpu_fused_unavailable
from engine.kernels.kv_int8 import dequantize_rows, quantize_rows, row_width
from engine.model.config import LlamaConfig
from engine.model.llama import RMSNorm
from engine.model.rope import RotaryEmbedding, rotate

WHY_NOT = cpu_fused_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernels: {WHY_NOT}")
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, PARALLEL_ROWS + 37]  # one, a few, and enough to split over the threads


@pytest.fixture(scope="module")
def fused() -> FusedKernels:
    return load_fused_kernels(native_build.default_cache_dir())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [64, 100, 576, 2048])  # tails, and cascade levels at 2048
def test_add_rmsnorm_matches_eager_residual_add_and_norm(
    fused: FusedKernels, dtype: torch.dtype, rows: int, width: int
) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    h = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    norm = RMSNorm(width, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
        want_h = h + x
        want = norm(want_h)
        want_first = norm(h)
    got_h, out = h.clone(), torch.full_like(h, float("nan"))
    add_rmsnorm(fused, x, got_h, norm.weight.detach(), norm.eps, out)
    assert torch.equal(got_h, want_h)  # the residual add is one rounding, as torch's
    assert torch.equal(out, want)
    first, out_first = h.clone(), torch.full_like(h, float("nan"))
    add_rmsnorm(fused, None, first, norm.weight.detach(), norm.eps, out_first)
    assert torch.equal(first, h)
    assert torch.equal(out_first, want_first)


HEADS, KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 16, 16


def _rope(head_dim: int, dtype: torch.dtype) -> RotaryEmbedding:
    cfg = LlamaConfig(vocab_size=8, hidden_size=HEADS * head_dim, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      rope_theta=100000.0)  # fmt: skip
    return RotaryEmbedding(cfg, 512, dtype, "cpu")


@dataclass(frozen=True)
class RopeCase:
    """Random qkv rows, their positions and slots, zeroed caches of ``width`` per head,
    and the eager results: the rotated q and k heads, and v."""

    qkv: torch.Tensor
    rope: RotaryEmbedding
    positions: torch.Tensor
    slots: torch.Tensor
    caches: list[torch.Tensor]
    qk: torch.Tensor  # [rows, HEADS + KV_HEADS, head_dim] rotated
    v: torch.Tensor  # [rows, KV_HEADS, head_dim]


def _rope_case(rows: int, head_dim: int, dtype: torch.dtype, seed: int, scale: float,
               cache_dtype: torch.dtype, width: int) -> RopeCase:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (HEADS + 2 * KV_HEADS) * head_dim, generator=gen) * scale).to(dtype)
    if cache_dtype == torch.int8:  # a zero v head
        qkv[0, (HEADS + KV_HEADS) * head_dim : (HEADS + KV_HEADS + 1) * head_dim] = 0
    rope = _rope(head_dim, dtype)
    positions = torch.randint(0, 512, (rows,), generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:rows]
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, width, dtype=cache_dtype)
              for _ in range(2)]  # fmt: skip
    qk = rotate(qkv[:, : (HEADS + KV_HEADS) * head_dim].view(rows, HEADS + KV_HEADS, head_dim),
                *rope.tables(positions))  # fmt: skip
    v = qkv[:, (HEADS + KV_HEADS) * head_dim :].view(rows, KV_HEADS, head_dim)
    return RopeCase(qkv, rope, positions, slots, caches, qk, v)


def _untouched_elsewhere(flat_k: torch.Tensor, flat_v: torch.Tensor, slots: torch.Tensor) -> bool:
    others = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    others[slots] = False
    return not flat_k[others].any() and not flat_v[others].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_write_kv_is_bit_identical_to_eager_rotate_and_cache_write(
    fused: FusedKernels, dtype: torch.dtype, rows: int, head_dim: int
) -> None:
    c = _rope_case(rows, head_dim, dtype, rows * head_dim, 1.0, dtype, head_dim)
    got = c.qkv.clone()
    rope_write_kv(fused, got, HEADS, plan_rope(c.positions, c.slots), c.rope.cos, c.rope.sin,
                  *c.caches)  # fmt: skip
    assert torch.equal(got[:, : HEADS * head_dim].view(rows, HEADS, head_dim), c.qk[:, :HEADS])
    assert torch.equal(got[:, HEADS * head_dim :], c.qkv[:, HEADS * head_dim :])  # k, v untouched
    flat_k, flat_v = (cache.view(-1, KV_HEADS, head_dim) for cache in c.caches)
    assert torch.equal(flat_k[c.slots], c.qk[:, HEADS:])
    assert torch.equal(flat_v[c.slots], c.v)
    assert _untouched_elsewhere(flat_k, flat_v, c.slots)  # no other slot written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [16, 64, 72])
def test_rope_write_kv_int8_is_bit_identical_to_the_torch_quantizer(
    fused: FusedKernels, dtype: torch.dtype, rows: int, head_dim: int
) -> None:
    """int8 caches: the rotated k and the v of each row quantized per head exactly as
    :func:`engine.kernels.kv_int8.quantize_rows` does (values and scale bytes); q is
    rotated as for the other caches. An all-zero head gets scale 0 and zeros."""
    width = row_width(head_dim)
    c = _rope_case(rows, head_dim, dtype, rows * head_dim + 1, 4.0, torch.int8, width)
    got = c.qkv.clone()
    rope_write_kv(fused, got, HEADS, plan_rope(c.positions, c.slots), c.rope.cos, c.rope.sin,
                  *c.caches)  # fmt: skip
    assert torch.equal(got[:, : HEADS * head_dim].view(rows, HEADS, head_dim), c.qk[:, :HEADS])
    flat_k, flat_v = (cache.view(-1, KV_HEADS, width) for cache in c.caches)
    assert torch.equal(flat_k[c.slots], quantize_rows(c.qk[:, HEADS:]))
    assert torch.equal(flat_v[c.slots], quantize_rows(c.v))
    assert not dequantize_rows(flat_v[c.slots[:1]])[0, 0].any()
    assert _untouched_elsewhere(flat_k, flat_v, c.slots)
    err = (dequantize_rows(flat_v[c.slots]) - c.v.float()).abs()
    assert bool((err <= c.v.float().abs().amax(-1, keepdim=True) / 254 * 1.0001).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
# 200: a scalar tail after 192 (both builds); 208: after 192 on AVX-512, none on AVX2
# (float32), whose vector code runs in steps of 16
@pytest.mark.parametrize("width", [200, 208])
def test_silu_mul_matches_eager_silu_times_up(
    fused: FusedKernels, dtype: torch.dtype, rows: int, width: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, 1e-3])  # exp's ends, and near zero
    gate, up = gate_up.split(width, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(silu_mul(fused, gate_up), want)


def test_bad_arguments_are_refused(fused: FusedKernels) -> None:
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="dtype"):
        add_rmsnorm(fused, None, x.half(), torch.ones(64).half(), 1e-5, x.half())
    with pytest.raises(ValueError, match="contiguous"):
        add_rmsnorm(fused, None, torch.zeros(64, 4).t(), torch.ones(64), 1e-5, x)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm(fused, None, x, torch.ones(32), 1e-5, x.clone())
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(fused, torch.zeros(4, 7))
    rope = _rope(16, torch.float32)
    caches = [torch.zeros(2, 4, 3, 16) for _ in range(2)]
    qkv = torch.zeros(2, 15 * 16)
    with pytest.raises(ValueError, match="past"):  # position 600 is past the 512-row tables
        rope_write_kv(fused, qkv, 9, plan_rope(torch.tensor([0, 600]), torch.tensor([0, 1])),
                      rope.cos, rope.sin, *caches)  # fmt: skip
    with pytest.raises(ValueError, match="past"):  # 2 blocks of 4 tokens: slots 0..7
        rope_write_kv(fused, qkv, 9, plan_rope(torch.tensor([0, 1]), torch.tensor([0, 8])),
                      rope.cos, rope.sin, *caches)  # fmt: skip
    with pytest.raises(ValueError, match="negative"):
        plan_rope(torch.tensor([0, -1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="int64"):
        plan_rope(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]))


def _run_all_ops(fused: FusedKernels, threads: int) -> list[torch.Tensor]:
    """Every op over PARALLEL_ROWS + 37 bfloat16 rows with torch at ``threads`` threads."""
    rows, width = PARALLEL_ROWS + 37, 576
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    x = torch.randn(rows, width, generator=gen).bfloat16()
    weight = torch.randn(width, generator=gen).bfloat16()
    gate_up = (torch.randn(rows, 2 * 200, generator=gen) * 4).bfloat16()
    c = _rope_case(rows, 64, torch.bfloat16, rows * 64, 1.0, torch.bfloat16, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert row_threads(rows) == threads and row_threads(PARALLEL_ROWS - 1) == 1
        assert row_threads(PARALLEL_ROWS) == min(2, threads)  # one thread per 8 rows
        out = torch.empty_like(h)
        add_rmsnorm(fused, x, h, weight, 1e-5, out)
        rope_write_kv(fused, c.qkv, HEADS, plan_rope(c.positions, c.slots), c.rope.cos,
                      c.rope.sin, *c.caches)  # fmt: skip
        return [h, out, c.qkv, *c.caches, silu_mul(fused, gate_up)]
    finally:
        torch.set_num_threads(before)


def test_rows_split_over_threads_give_the_one_thread_values(fused: FusedKernels) -> None:
    """A call of many rows splits them over torch's threads (3: runs of unequal rows); the
    results equal one thread's bit for bit."""
    alone, split = _run_all_ops(fused, 1), _run_all_ops(fused, 3)
    for a, b in zip(alone, split, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("rows", "width"), [(1, 1), (3, 15), (7, 16), (64, 49152), (20, 1000)])
def test_argmax_rows_gives_torchs_max_indices(fused: FusedKernels, rows: int, width: int) -> None:
    """Random rows (one thread and, from 16 rows, split over threads) with ties planted
    across lanes and in the tail: the first index of each row's largest value, as
    ``max(dim=-1).indices``."""
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn((rows, width), generator=gen)
    if width > 17:
        x[::2, width - 1] = x[::2, 3] = 99.0  # a tie: lane 3 before the tail's last element
        x[1::3, 17] = x[1::3, 1] = 50.0  # lanes 1 of two vectors
    assert torch.equal(argmax_rows(fused, x), x.max(dim=-1).indices)
    wide = torch.randn((rows, width + 5), generator=gen)
    assert torch.equal(argmax_rows(fused, wide[:, :width]), wide[:, :width].max(dim=-1).indices)


def test_argmax_rows_takes_nan_and_inf_as_torch_does(fused: FusedKernels) -> None:
    x = torch.randn(6, 37)
    x[0, 5] = x[0, 9] = float("nan")  # the first NaN wins
    x[1] = float("-inf")  # nothing above -inf: the first element
    x[2, 30] = float("nan")  # a NaN in the tail beats a larger value before it
    x[2, 4] = 1e30
    x[3] = float("inf")
    x[4, 20] = float("inf")
    x[5] = 7.0  # all equal: the first
    assert torch.equal(argmax_rows(fused, x), x.max(dim=-1).indices)
    assert argmax_rows(fused, x).tolist() == [5, 0, 30, 0, 20, 0]
    with pytest.raises(ValueError):
        argmax_rows(fused, x.bfloat16())
    with pytest.raises(ValueError):
        argmax_rows(fused, x.t())  # rows not contiguous
