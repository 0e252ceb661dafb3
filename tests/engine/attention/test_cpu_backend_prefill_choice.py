"""Where the CPU backend runs a prefill chunk: the native kernel for short chunks even
where torch won the start-up race for longer ones; and whether decode and prefill over a
bfloat16 cache run on bfloat16 dot products (the races' timing stubbed where the
choice they lead to is the subject; the outputs themselves are checked against dense
attention in test_engine_torch_backend.py and the kernels' own tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import engine.attention.cpu_backend as cpu_backend
from engine.attention.cpu_backend import (
    PREFILL_PROBE,
    SHORT_PREFILL_PROBES,
    SHORT_PROBE_CACHED,
    CpuAttentionBackend,
)
from engine.kernels import native_build
from tests.engine.attention.metadata import metadata

H, HKV, D, BS = 4, 2, 16, 4

pytestmark = pytest.mark.skipif(
    native_build.unavailable_reason() is not None, reason="needs the native CPU kernels"
)


def _race(wins: Callable[[int, int], bool], asked: list[tuple[int, int]]) -> object:
    def race(self: CpuAttentionBackend, num_heads: int, k_cache: torch.Tensor,
             q_len: int, cached: int) -> bool:  # fmt: skip
        asked.append((q_len, cached))
        return wins(q_len, cached)

    return race


@pytest.mark.parametrize(
    ("native_up_to", "limit"),
    [(0, 0), *((q, q) for q in SHORT_PREFILL_PROBES), (10_000, SHORT_PREFILL_PROBES[-1])],
)
def test_prepare_keeps_the_longest_short_probe_the_native_kernel_won(
    monkeypatch: pytest.MonkeyPatch, native_up_to: int, limit: int
) -> None:
    asked: list[tuple[int, int]] = []
    wins = _race(lambda q, c: (q, c) != PREFILL_PROBE and q <= native_up_to, asked)
    monkeypatch.setattr(CpuAttentionBackend, "_native_wins", wins)
    backend = CpuAttentionBackend()
    backend.prepare(H, torch.zeros(8, BS, HKV, D, dtype=torch.bfloat16))
    assert not backend.native_prefill and backend.native_prefill_max_q == limit
    assert asked[0] == PREFILL_PROBE
    assert all(c == SHORT_PROBE_CACHED for _, c in asked[1:])
    won = [q for q in SHORT_PREFILL_PROBES if q <= limit]
    lost = [q for q in SHORT_PREFILL_PROBES if q > limit][:1]
    assert [q for q, _ in asked[1:]] == won + lost  # shortest first, to the first loss


def test_a_probe_lost_ends_the_race_even_if_a_longer_one_would_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []
    short, middle = SHORT_PREFILL_PROBES[0], SHORT_PREFILL_PROBES[1]
    wins = _race(lambda q, c: (q, c) != PREFILL_PROBE and q != middle, asked)
    monkeypatch.setattr(CpuAttentionBackend, "_native_wins", wins)
    backend = CpuAttentionBackend()
    backend.prepare(H, torch.zeros(8, BS, HKV, D, dtype=torch.bfloat16))
    assert backend.native_prefill_max_q == short
    assert [q for q, _ in asked[1:]] == [short, middle]


def test_no_short_race_where_prefill_is_native_chosen_or_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(CpuAttentionBackend, "_native_wins", _race(lambda q, c: True, asked))
    cache = torch.zeros(8, BS, HKV, D, dtype=torch.bfloat16)
    won = CpuAttentionBackend()
    won.prepare(H, cache)  # native won the long probe: every chunk runs natively
    assert won.native_prefill and won.native_prefill_max_q == 0 and asked == [PREFILL_PROBE]
    off = CpuAttentionBackend(native_prefill=False)
    off.prepare(H, cache)
    given = CpuAttentionBackend(native_prefill=False, native_prefill_max_q=12)
    given.prepare(H, cache)
    raced = CpuAttentionBackend(native_prefill_max_q=5)
    monkeypatch.setattr(CpuAttentionBackend, "_native_wins", _race(lambda q, c: False, asked))
    raced.prepare(H, cache)
    assert (off.native_prefill_max_q, given.native_prefill_max_q) == (0, 12)
    assert raced.native_prefill_max_q == 5 and asked == [PREFILL_PROBE, PREFILL_PROBE]


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="native_prefill_max_q"):
        CpuAttentionBackend(native_prefill_max_q=-1)


def test_chunks_up_to_the_limit_run_natively_the_rest_in_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = cpu_backend.native_extend

    def spied(native: object, plan: object, q: torch.Tensor, *rest: object, **kw: bool) -> None:
        calls.append(q.shape[0])
        real(native, plan, q, *rest, **kw)  # type: ignore[arg-type]

    backend = CpuAttentionBackend(native_prefill=False, native_prefill_max_q=6)
    cache = torch.zeros(8, BS, HKV, D, dtype=torch.bfloat16)
    backend.prepare(H, cache)
    monkeypatch.setattr(cpu_backend, "native_extend", spied)
    # (cached, new): a long chunk, a short one, a decode
    meta = metadata([(0, 7), (2, 6), (1, 1)], [[0, 1], [2, 3], [4]])
    q = torch.randn(14, H, D).to(torch.bfloat16)
    backend.forward(q, cache, cache.clone(), meta, D**-0.5)
    assert calls == [6]


def _stub_products(monkeypatch: pytest.MonkeyPatch, decode: bool, extend: bool,
                   asked: list[str]) -> None:  # fmt: skip
    def decode_win(native: object, num_heads: int, k_cache: torch.Tensor) -> bool:
        asked.append("decode")
        return decode

    def extend_win(native: object, num_heads: int, k_cache: torch.Tensor) -> bool:
        asked.append("extend")
        return extend

    monkeypatch.setattr(cpu_backend, "decode_products_win", decode_win)
    monkeypatch.setattr(cpu_backend, "extend_products_win", extend_win)


@pytest.mark.parametrize(("decode", "extend"), [(True, False), (False, True)])
def test_the_products_race_decides_what_the_kernels_are_asked(
    monkeypatch: pytest.MonkeyPatch, decode: bool, extend: bool
) -> None:
    """Over a bfloat16 cache, where the library has the bfloat16 dot-product paths, the
    start-up race's winners are what every decode and prefill launch asks for (and the
    native-vs-torch prefill race runs the chosen prefill path); over a float32 cache
    there is no race and no products."""
    asked: list[str] = []
    _stub_products(monkeypatch, decode, extend, asked)
    calls: list[tuple[str, bool]] = []
    real_decode, real_extend = cpu_backend.native_decode_rows, cpu_backend.native_extend

    def spy_decode(*args: object, bf16_products: bool = True, **kw: object) -> None:
        calls.append(("decode", bf16_products))
        real_decode(*args, bf16_products=bf16_products, **kw)  # type: ignore[arg-type]

    def spy_extend(*args: object, bf16_products: bool = True, **kw: object) -> None:
        calls.append(("extend", bf16_products))
        real_extend(*args, bf16_products=bf16_products, **kw)  # type: ignore[arg-type]

    float32 = CpuAttentionBackend(native_prefill=True)
    float32.prepare(H, torch.zeros(8, BS, HKV, D))
    assert float32.bf16_products == (False, False) and asked == []
    backend = CpuAttentionBackend(native_prefill=True)
    cache = torch.zeros(8, BS, HKV, D, dtype=torch.bfloat16)
    backend.prepare(H, cache)
    assert backend.native is not None
    if not backend.native.bf16_products:  # no AVX512-BF16 here: nothing to race
        assert backend.bf16_products == (False, False) and asked == []
        return
    assert backend.bf16_products == (decode, extend) and asked == ["decode", "extend"]
    monkeypatch.setattr(cpu_backend, "native_decode_rows", spy_decode)
    monkeypatch.setattr(cpu_backend, "native_extend", spy_extend)
    meta = metadata([(0, 5), (2, 1)], [[0, 1], [2]])  # a prefill chunk and a decode
    backend.forward(torch.randn(6, H, D).to(torch.bfloat16), cache, cache.clone(), meta, 0.25)
    assert sorted(calls) == [("decode", decode), ("extend", extend)]


def test_the_products_race_runs_both_paths_on_the_models_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unstubbed, on SmolLM2's shape: both races time both paths and say so."""
    backend = CpuAttentionBackend()
    with caplog.at_level("INFO", logger="engine.attention"):
        backend.prepare(9, torch.zeros(8, 16, 3, 64, dtype=torch.bfloat16))
    assert backend.native is not None
    probes = [r.getMessage() for r in caplog.records if "bfloat16-products probe" in r.getMessage()]
    if not backend.native.bf16_products:
        assert probes == [] and backend.bf16_products == (False, False)
        return
    assert len(probes) == 2 and all("products" in p and "float32" in p for p in probes)
    assert f"decode {backend.bf16_products[0]}, prefill {backend.bf16_products[1]}" in caplog.text


@pytest.mark.parametrize("tiles_win", [True, False])
def test_the_amx_race_decides_whether_prefill_runs_on_the_tiles(
    monkeypatch: pytest.MonkeyPatch, tiles_win: bool
) -> None:
    """Where the library and the process have the AMX tiles, a bfloat16 or int8 cache of a
    head size they take (64 here) races them against the vector path the products race
    chose; every native prefill launch then asks for the winner. Elsewhere (no tiles, a
    float32 cache, head_dim 16) there is no race and no tiles."""
    asked: list[bool] = []

    def amx_win(native: object, num_heads: int, k_cache: torch.Tensor, products: bool) -> bool:
        asked.append(products)
        return tiles_win

    monkeypatch.setattr(cpu_backend, "extend_amx_wins", amx_win)
    small = CpuAttentionBackend(native_prefill=True)
    small.prepare(H, torch.zeros(8, BS, HKV, D, dtype=torch.bfloat16))
    assert not small.extend_amx
    backend = CpuAttentionBackend(native_prefill=True)
    cache = torch.zeros(8, 16, 3, 64, dtype=torch.bfloat16)
    backend.prepare(9, cache)
    assert backend.native is not None
    if not (backend.native.extend_amx and backend.native.bf16_products):
        assert not backend.extend_amx and asked == []
        return
    assert asked == [backend.bf16_products[1]] and backend.extend_amx is tiles_win
    int8 = CpuAttentionBackend()
    int8.prepare(9, torch.zeros(8, 16, 3, 64 + 4, dtype=torch.int8))  # rows of D + 4 bytes
    assert len(asked) == 2 and int8.extend_amx is tiles_win
    calls: list[bool] = []
    real_extend = cpu_backend.native_extend

    def spy_extend(*args: object, amx: bool = False, **kw: object) -> None:
        calls.append(amx)
        real_extend(*args, amx=amx, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_backend, "native_extend", spy_extend)
    meta = metadata([(0, 20)], [[0, 1]])
    backend.forward(torch.randn(20, 9, 64).to(torch.bfloat16), cache, cache.clone(), meta, 0.125)
    assert calls == [tiles_win]


@pytest.mark.parametrize("decode", [True, False])
def test_over_an_int8_cache_the_decode_race_picks_integer_products(
    monkeypatch: pytest.MonkeyPatch, decode: bool
) -> None:
    """Over an int8 cache whose head_dim is whole 32-value slices, where the library has
    the VNNI integer decode path, the decode race runs (the prefill products race does
    not: it is for bfloat16 caches) and its winner is what every decode launch asks for;
    without that path there is no race and decode runs in float32."""
    asked: list[str] = []
    _stub_products(monkeypatch, decode, True, asked)
    seen: list[bool] = []
    real_decode = cpu_backend.native_decode_rows

    def spy_decode(*args: object, int8_products: bool = True, **kw: object) -> None:
        seen.append(int8_products)
        real_decode(*args, int8_products=int8_products, **kw)  # type: ignore[arg-type]

    head_dim = 32
    cache = torch.zeros(8, BS, HKV, head_dim + 4, dtype=torch.int8)
    backend = CpuAttentionBackend()
    backend.prepare(H, cache)
    assert backend.native is not None
    if not backend.native.int8_products:  # no AVX512-VNNI here: nothing to race
        assert asked == [] and backend.bf16_products == (False, False)
        return
    assert asked == ["decode"] and backend.bf16_products == (decode, False)
    monkeypatch.setattr(cpu_backend, "native_decode_rows", spy_decode)
    meta = metadata([(4, 1), (2, 1)], [[0, 1], [2]])  # two decode rows
    backend.forward(torch.randn(2, H, head_dim), cache, cache.clone(), meta, 0.25)
    assert seen == [decode]


def test_the_int8_decode_race_runs_both_paths_on_the_models_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unstubbed, over an int8 cache of SmolLM2's shape: the decode race times both
    paths and the backend says which won."""
    backend = CpuAttentionBackend()
    with caplog.at_level("INFO", logger="engine.attention"):
        backend.prepare(9, torch.zeros(8, 16, 3, 64 + 4, dtype=torch.int8))
    assert backend.native is not None
    probes = [r.getMessage() for r in caplog.records if "int8-products probe" in r.getMessage()]
    if not backend.native.int8_products:
        assert probes == [] and backend.bf16_products == (False, False)
        return
    assert len(probes) == 1 and "products" in probes[0] and "float32" in probes[0]
    assert f"decode {backend.bf16_products[0]}, prefill False" in caplog.text
