"""The torch paged backend (and the CPU backend built on it) against dense causal
attention on contiguous K/V."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import native_build
from tests.engine.attention.metadata import metadata

H, HKV, D, BS = 4, 2, 16, 4


class NumbaCpuBackend(CpuAttentionBackend):
    """The CPU backend on its numba decode kernel (native kernels off)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, native=False, **kwargs)  # type: ignore[arg-type]


class NativeCpuBackend(CpuAttentionBackend):
    """The CPU backend with decode and prefill in the native kernels."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, native=True, native_prefill=True, **kwargs)  # type: ignore[arg-type]


class ShortNativeCpuBackend(CpuAttentionBackend):
    """The CPU backend with prefill in torch but for chunks of up to 6 query rows."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, native=True, native_prefill=False,  # type: ignore[arg-type]
                         native_prefill_max_q=6, **kwargs)  # fmt: skip


NATIVE_WHY_NOT = native_build.unavailable_reason()
NEEDS_NATIVE = pytest.mark.skipif(NATIVE_WHY_NOT is not None,
                                  reason=f"native kernels: {NATIVE_WHY_NOT}")  # fmt: skip
BACKENDS = [
    TorchAttentionBackend,
    NumbaCpuBackend,
    pytest.param(NativeCpuBackend, marks=NEEDS_NATIVE),
    pytest.param(ShortNativeCpuBackend, marks=NEEDS_NATIVE),
]


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float
) -> torch.Tensor:
    """Naive softmax attention: q [n, H, D] at positions offset.., k/v [L, HKV, D]."""
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(offset, offset + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# decode: a group per length / one group; prefill: 3-row query tiles / one tile.
# torch: float32 decodes through SDPA, bfloat16 through the block-diagonal matmuls;
# float32 prefill through SDPA (with a shifted mask over a cached prefix), bfloat16 in
# tiles or (fused) through SDPA too. cpu: float32 and bfloat16 decodes in the numba
# kernel, the rest as torch; or decodes and prefill chunks in the native kernels; or
# decodes and the 6-row chunk there, the 7-row one in torch (one step, both ways).
@pytest.mark.parametrize("backend_type", BACKENDS)
@pytest.mark.parametrize(
    ("dtype", "fused"), [(torch.float32, None), (torch.bfloat16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize(("group_cost", "tile"), [(0, 3), (64, 128)])
def test_mixed_prefill_chunks_and_decodes_match_dense(
    group_cost: int,
    tile: int,
    dtype: torch.dtype,
    fused: bool | None,
    backend_type: type[TorchAttentionBackend],
) -> None:
    gen = torch.Generator().manual_seed(0)
    backend = backend_type(group_cost, tile, fused)
    # (cached tokens, new tokens) per sequence: fresh prefill, chunk over a prefix, decodes
    shapes = [(0, 7), (5, 6), (9, 1), (3, 1), (16, 1), (2, 1)]
    num_blocks = 40
    k_cache = torch.zeros(num_blocks, BS, HKV, D, dtype=dtype)
    v_cache = torch.zeros(num_blocks, BS, HKV, D, dtype=dtype)
    backend.prepare(H, k_cache)  # as an engine does before its first step
    free = list(torch.randperm(num_blocks, generator=gen).tolist())
    full_k, full_v, tables = [], [], []
    for cached, new in shapes:
        n_blocks = -(-(cached + new) // BS)
        tables.append([free.pop() for _ in range(n_blocks)])
        full_k.append(torch.randn(cached + new, HKV, D, generator=gen).to(dtype))
        full_v.append(torch.randn(cached + new, HKV, D, generator=gen).to(dtype))
    # the cached part is already in the cache
    for (cached, _), table, k, v in zip(shapes, tables, full_k, full_v, strict=True):
        for p in range(cached):
            k_cache[table[p // BS], p % BS] = k[p]
            v_cache[table[p // BS], p % BS] = v[p]
    q_parts: list[torch.Tensor] = []
    new_k: list[torch.Tensor] = []
    new_v: list[torch.Tensor] = []
    slots: list[int] = []
    for (cached, new), table, k, v in zip(shapes, tables, full_k, full_v, strict=True):
        q_parts.append(torch.randn(new, H, D, generator=gen).to(dtype))
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        slots.extend(table[p // BS] * BS + p % BS for p in range(cached, cached + new))
    meta = metadata(shapes, tables, slots)
    qsl = meta.query_start_loc.tolist()
    q = torch.cat(q_parts)
    backend.write_kv(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta.slot_mapping)
    out = backend.forward(q, k_cache, v_cache, meta, D**-0.5)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 probabilities and output
    for i, (cached, _) in enumerate(shapes):
        ref = _dense(q_parts[i].float(), full_k[i].float(), full_v[i].float(), cached, D**-0.5)
        got = out[qsl[i] : qsl[i + 1]].float()
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("fused", [False, True])
def test_bfloat16_prefill_runs_sdpa_in_bf16_only_when_fused(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where bf16 is not native the fused kernel runs in float32 over widened rows (its
    mask in float32 too) and the output comes back in bfloat16."""
    calls: list[tuple[torch.dtype | None, torch.dtype | None]] = []
    real = TorchAttentionBackend._prefill_sdpa

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        mask, compute = args[5], args[7]
        assert isinstance(compute, torch.dtype)
        calls.append((compute, mask.dtype if isinstance(mask, torch.Tensor) else None))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchAttentionBackend, "_prefill_sdpa", staticmethod(counted))
    backend = TorchAttentionBackend(fused_bf16_prefill=fused)
    cache = torch.zeros(4, BS, HKV, D, dtype=torch.bfloat16)
    meta = metadata([(0, 5)], [[0, 1]], list(range(5)))
    q = torch.randn(5, H, D).to(torch.bfloat16)
    out = backend.forward(q, cache, cache.clone(), meta, D**-0.5)
    assert out.dtype == torch.bfloat16
    want = torch.bfloat16 if fused else torch.float32
    assert calls == [(want, None)]
    # a chunk after cached tokens: its additive mask is in the kernel's dtype
    calls.clear()
    backend = TorchAttentionBackend(fused_bf16_prefill=fused)
    after = dataclasses.replace(
        meta, query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        slot_mapping=torch.arange(2, 5, dtype=torch.int64), max_query_len=3,
        query_lens_cpu=(3,),
    )  # fmt: skip
    backend.forward(q[:3], cache, cache.clone(), after, D**-0.5)
    assert calls == [(want, want)]


def _layer(
    shapes: list[tuple[int, int]], tables: list[list[int]], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One layer's caches holding each sequence's K/V (cached and new), its queries
    and the dense reference outputs per sequence."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(40, BS, HKV, D, dtype=dtype)
    v_cache = torch.zeros(40, BS, HKV, D, dtype=dtype)
    qs, refs = [], []
    for (cached, new), table in zip(shapes, tables, strict=True):
        k = torch.randn(cached + new, HKV, D, generator=gen).to(dtype)
        v = torch.randn(cached + new, HKV, D, generator=gen).to(dtype)
        for p in range(cached + new):
            k_cache[table[p // BS], p % BS] = k[p]
            v_cache[table[p // BS], p % BS] = v[p]
        qs.append(torch.randn(new, H, D, generator=gen).to(dtype))
        refs.append(_dense(qs[-1].float(), k.float(), v.float(), cached, D**-0.5))
    return torch.cat(qs), k_cache, v_cache, refs


@pytest.mark.parametrize("backend_type", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_plan_serves_every_layer_and_the_next_step_plans_anew(
    backend_type: type[TorchAttentionBackend], dtype: torch.dtype
) -> None:
    """Backends plan a step's rows, masks and scratch at its first layer and reuse them
    for the others (same metadata): each layer still reads its own caches and queries,
    and a new step (new metadata, here decodes only) is planned again."""
    backend = backend_type(fused_bf16_prefill=True)
    backend.prepare(H, torch.zeros(1, BS, HKV, D, dtype=dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    steps = [
        ([(0, 6), (5, 3), (9, 1), (2, 1)], [[1, 2], [3, 4], [5, 6, 7], [8]]),
        ([(10, 1), (3, 1), (17, 1)], [[9, 10, 11], [12], [13, 14, 15, 16, 17]]),
    ]
    for shapes, tables in steps:
        meta = metadata(shapes, tables)
        qsl = meta.query_start_loc.tolist()
        for seed in (1, 2):  # two layers of one step
            q, k_cache, v_cache, refs = _layer(shapes, tables, dtype, seed)
            out = backend.forward(q, k_cache, v_cache, meta, D**-0.5)
            for i, ref in enumerate(refs):
                got = out[qsl[i] : qsl[i + 1]].float()
                torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
