"""Where the CPU backend runs a prefill chunk: the native kernel for short chunks even
where torch won the start-up race for longer ones (the race's timing stubbed where the
choice it leads to is the subject; the outputs themselves are checked against dense
attention in test_engine_torch_backend.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import engine.attention.cpu_backend as cpu_backend
from engine.attention.base import AttentionMetadata
from engine.attention.cpu_backend import (
    PREFILL_PROBE,
    SHORT_PREFILL_PROBES,
    SHORT_PROBE_CACHED,
    CpuAttentionBackend,
)
from engine.kernels import native_build

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

    def spied(native: object, plan: object, q: torch.Tensor, *rest: object) -> None:
        calls.append(q.shape[0])
        real(native, plan, q, *rest)  # type: ignore[arg-type]

    backend = CpuAttentionBackend(native_prefill=False, native_prefill_max_q=6)
    cache = torch.zeros(8, BS, HKV, D, dtype=torch.bfloat16)
    backend.prepare(H, cache)
    monkeypatch.setattr(cpu_backend, "native_extend", spied)
    shapes = [(0, 7), (2, 6), (1, 1)]  # (cached, new): a long chunk, a short one, a decode
    qlens, slens = tuple(n for _, n in shapes), tuple(c + n for c, n in shapes)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 7, 13, 14], dtype=torch.int32),
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=torch.tensor([[0, 1], [2, 3], [4, 0]], dtype=torch.int32),
        slot_mapping=torch.zeros(14, dtype=torch.int64),
        max_query_len=7, max_seq_len=8, query_lens_cpu=qlens, seq_lens_cpu=slens,
    )  # fmt: skip
    q = torch.randn(14, H, D).to(torch.bfloat16)
    backend.forward(q, cache, cache.clone(), meta, D**-0.5)
    assert calls == [6]
