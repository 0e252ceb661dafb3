"""Row-quantized int8 linears: a row's output never depends on the other rows, and both
ways to the int32 sums (``torch._int_mm``, exact float32 chunks) give the same outputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = __import__("torch")

from proxy.semantic.rowquant import (  # noqa: E402
    EXACT_CHUNK,
    int8_products_native,
    quantize_linears,
)


def _layer(seed: int, int_mm: bool, k: int = 64, n: int = 48) -> tuple[object, object]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n)
    quantized = quantize_linears(torch.nn.Sequential(torch.nn.Linear(k, n)), int_mm=int_mm)
    quantized[0].__init__(linear, int_mm)  # the same weights, quantized
    return linear, quantized


@pytest.mark.parametrize("int_mm", [True, False])
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 40), st.floats(0.01, 100.0))
def test_a_row_gives_the_same_output_alone_and_in_any_batch(
    int_mm: bool, seed: int, others: int, loudness: float
) -> None:
    _, quantized = _layer(seed, int_mm)
    gen = torch.Generator().manual_seed(seed + 1)
    row = torch.randn(1, 64, generator=gen)
    batch = torch.cat([torch.randn(others, 64, generator=gen) * loudness, row])
    with torch.inference_mode():
        alone = quantized(row)
        inside = quantized(batch)[-1:]
    assert torch.equal(alone, inside)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from([64, EXACT_CHUNK, EXACT_CHUNK + 1, 1536, 2 * EXACT_CHUNK + 7]),
    st.integers(1, 24),
    st.sampled_from(["normal", "extreme", "spiky"]),
)
def test_float_chunks_give_int_mms_outputs_bit_for_bit(
    seed: int, k: int, rows: int, kind: str
) -> None:
    """Every partial sum of a chunk stays below 2^24, even where every input and weight
    is +-127 (the worst case; a single float32 matmul over 1,536 inputs would round there)."""
    linear, by_int_mm = _layer(seed, True, k=k, n=32)
    _, by_floats = _layer(seed, False, k=k, n=32)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    if kind == "extreme":  # every input and weight quantizes to +-127, the signs aligned:
        x = torch.sign(x) + (x == 0)  # sums of k x 127 x 127 (> 2^24 past EXACT_CHUNK)
        signs = torch.sign(torch.randn(32, 1, generator=gen)) + 0.5
        with torch.no_grad():
            linear.weight.copy_(torch.sign(signs) * x[torch.arange(32) % rows])
        by_int_mm[0].__init__(linear, True)
        by_floats[0].__init__(linear, False)
    elif kind == "spiky":  # one loud input per row: the rest quantize to small values
        x[:, 0] = 1e4
    with torch.inference_mode():
        assert torch.equal(by_int_mm(x), by_floats(x))


def test_close_to_the_float_layer() -> None:
    for int_mm in (True, False):
        linear, quantized = _layer(3, int_mm)
        x = torch.randn(16, 5, 64)
        with torch.inference_mode():
            exact, approx = linear(x), quantized(x)
        assert approx.shape == exact.shape
        err = (approx - exact).abs().max() / exact.abs().max()
        assert float(err) < 0.03


def test_int_mm_only_where_the_cpu_has_int8_dot_products() -> None:
    assert int8_products_native(frozenset({"avx2", "fma"})) is False
    assert int8_products_native(frozenset({"avx2", "avx512f"})) is False
    for flag in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert int8_products_native(frozenset({"avx2", flag})) is True
    assert int8_products_native(frozenset()) is False


def test_the_layers_of_a_module_share_one_choice() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4)))
    quantize_linears(model)
    assert model[0].int_mm == model[1][0].int_mm == int8_products_native()
