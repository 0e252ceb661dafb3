"""Row-quantized int8 linears: a row's output never depends on the other rows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

torch = __import__("torch")

from proxy.semantic.rowquant import quantize_linears  # noqa: E402


def _layer(seed: int) -> tuple[object, object]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(64, 48)
    quantized = quantize_linears(torch.nn.Sequential(torch.nn.Linear(64, 48)))
    quantized[0].__init__(linear)  # the same weights, quantized
    return linear, quantized


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 40), st.floats(0.01, 100.0))
def test_a_row_gives_the_same_output_alone_and_in_any_batch(
    seed: int, others: int, loudness: float
) -> None:
    _, quantized = _layer(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    row = torch.randn(1, 64, generator=gen)
    batch = torch.cat([torch.randn(others, 64, generator=gen) * loudness, row])
    with torch.inference_mode():
        alone = quantized(row)
        inside = quantized(batch)[-1:]
    assert torch.equal(alone, inside)


def test_close_to_the_float_layer() -> None:
    linear, quantized = _layer(3)
    x = torch.randn(16, 5, 64)
    with torch.inference_mode():
        exact, approx = linear(x), quantized(x)
    assert approx.shape == exact.shape
    err = (approx - exact).abs().max() / exact.abs().max()
    assert float(err) < 0.03
