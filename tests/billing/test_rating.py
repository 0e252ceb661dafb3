from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.models import ServedBy
from billing.money import pico_to_usd
from billing.rating import Charge, PriceQuote, Usage, apply_fraction, rate

MAX_TOKENS = 2_000_000
MAX_PICO_PER_TOKEN = 10**10

PRICE = PriceQuote(
    input_pico=150_000, cached_input_pico=75_000, output_pico=600_000, semantic_hit_ppm=100_000
)


@st.composite
def prices(draw: st.DrawFn) -> PriceQuote:
    input_pico = draw(st.integers(0, MAX_PICO_PER_TOKEN))
    return PriceQuote(
        input_pico=input_pico,
        cached_input_pico=draw(st.integers(0, input_pico)),
        output_pico=draw(st.integers(0, MAX_PICO_PER_TOKEN)),
        semantic_hit_ppm=draw(st.integers(0, 10**6)),
    )


@st.composite
def usages(draw: st.DrawFn) -> Usage:
    prompt = draw(st.integers(0, MAX_TOKENS))
    return Usage(
        prompt_tokens=prompt,
        cached_tokens=draw(st.integers(0, prompt)),
        completion_tokens=draw(st.integers(0, MAX_TOKENS)),
        served_by=draw(st.sampled_from(ServedBy)),
    )


def _parts(charge: Charge) -> list[int]:
    return [
        charge.uncached_input_pico,
        charge.cached_input_pico,
        charge.output_pico,
        charge.semantic_hit_pico,
    ]


def test_engine_request_bills_each_kind_at_its_price() -> None:
    charge = rate(Usage(100, 40, 20, ServedBy.ENGINE), PRICE)
    assert charge.uncached_input_pico == 60 * 150_000
    assert charge.cached_input_pico == 40 * 75_000
    assert charge.output_pico == 20 * 600_000
    assert charge.billed_pico == 24_000_000
    assert charge.list_pico == 100 * 150_000 + 20 * 600_000 == 27_000_000
    assert charge.savings_pico == 3_000_000
    assert pico_to_usd(charge.billed_pico) == pico_to_usd(24_000_000)


def test_semantic_hit_bills_the_fraction_of_the_full_uncached_price() -> None:
    charge = rate(Usage(100, 40, 20, ServedBy.SEMANTIC), PRICE)
    assert charge.list_pico == 27_000_000
    assert charge.billed_pico == charge.semantic_hit_pico == 2_700_000
    assert charge.uncached_input_pico == charge.cached_input_pico == charge.output_pico == 0


@pytest.mark.parametrize(
    ("amount", "ppm", "expected"),
    [(1, 500_000, 0), (3, 500_000, 2), (5, 500_000, 2), (7, 500_000, 4), (10, 333_333, 3),
     (0, 123_456, 0), (999, 10**6, 999), (999, 0, 0)],
)
def test_fraction_rounds_half_to_even(amount: int, ppm: int, expected: int) -> None:
    assert apply_fraction(amount, ppm) == expected


@given(st.integers(0, 10**22), st.integers(0, 10**6))
def test_fraction_matches_an_exact_rational_reference(amount: int, ppm: int) -> None:
    assert apply_fraction(amount, ppm) == round(Fraction(amount * ppm, 10**6))


@given(usages(), prices())
def test_amounts_are_never_negative_and_parts_sum_exactly(usage: Usage, price: PriceQuote) -> None:
    charge = rate(usage, price)
    assert all(part >= 0 for part in _parts(charge))
    assert charge.billed_pico >= 0 and charge.list_pico >= 0
    assert sum(_parts(charge)) == charge.billed_pico


@given(usages(), prices())
def test_billed_never_exceeds_list_price(usage: Usage, price: PriceQuote) -> None:
    charge = rate(usage, price)
    assert charge.billed_pico <= charge.list_pico
    assert charge.list_pico == (
        usage.prompt_tokens * price.input_pico + usage.completion_tokens * price.output_pico
    )


@given(usages(), prices())
def test_semantic_hit_costs_at_most_the_list_price(usage: Usage, price: PriceQuote) -> None:
    hit = Usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                ServedBy.SEMANTIC)
    charge = rate(hit, price)
    assert 0 <= charge.semantic_hit_pico <= charge.list_pico


@given(st.lists(st.tuples(usages(), prices()), max_size=40))
def test_invoice_style_totals_equal_the_sum_of_lines(items: list[tuple[Usage, PriceQuote]]) -> None:
    charges = [rate(usage, price) for usage, price in items]
    lines = {
        "uncached_input": sum(c.uncached_input_pico for c in charges),
        "cached_input": sum(c.cached_input_pico for c in charges),
        "output": sum(c.output_pico for c in charges),
        "semantic_hit": sum(c.semantic_hit_pico for c in charges),
    }
    total = sum(c.billed_pico for c in charges)
    assert sum(lines.values()) == total
    assert sum((pico_to_usd(v) for v in lines.values()), pico_to_usd(0)) == pico_to_usd(total)


@given(st.integers(0, 1000), st.integers(1, 1000), st.sampled_from(ServedBy))
def test_cached_beyond_prompt_is_rejected(prompt: int, extra: int, served: ServedBy) -> None:
    with pytest.raises(ValueError, match="exceed"):
        rate(Usage(prompt, prompt + extra, 0, served), PRICE)


@pytest.mark.parametrize(
    "usage",
    [Usage(-1, 0, 0, ServedBy.ENGINE), Usage(5, -1, 0, ServedBy.ENGINE),
     Usage(5, 0, -3, ServedBy.SEMANTIC), Usage(True, 0, 0, ServedBy.ENGINE)],
)
def test_negative_or_non_integer_counts_are_rejected(usage: Usage) -> None:
    with pytest.raises(ValueError):
        rate(usage, PRICE)


@pytest.mark.parametrize(
    "price",
    [PriceQuote(-1, 0, 0, 0), PriceQuote(0, -1, 0, 0), PriceQuote(0, 0, -1, 0),
     PriceQuote(0, 0, 0, -1), PriceQuote(0, 0, 0, 10**6 + 1)],
)
def test_impossible_prices_are_rejected(price: PriceQuote) -> None:
    with pytest.raises(ValueError):
        rate(Usage(1, 0, 1, ServedBy.ENGINE), price)
