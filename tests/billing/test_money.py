from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.errors import InvalidInput
from billing.money import (
    display_usd,
    format_usd,
    parse_fraction_ppm,
    parse_price_per_1m,
    pico_to_usd,
    ppm_to_fraction,
    price_per_1m_usd,
    usd_to_pico,
)


@pytest.mark.parametrize(
    ("text", "pico"),
    [("0.15", 150_000), ("0", 0), ("2.5", 2_500_000), (" 1 ", 1_000_000),
     ("0.000001", 1), ("10000", 10**10), (Decimal("0.075"), 75_000), (3, 3_000_000)],
)
def test_price_parses_to_exact_picodollars_per_token(text: str, pico: int) -> None:
    assert parse_price_per_1m(text) == pico


@pytest.mark.parametrize(
    "text",
    ["-0.01", "-0", "abc", "", "NaN", "nan", "inf", "-Infinity", "0.0000001", "1e-7",
     "10000.000001", "1,5", "0x10"],
)
def test_bad_prices_are_refused(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_price_per_1m(text)


def test_non_numeric_types_are_refused() -> None:
    with pytest.raises(InvalidInput):
        parse_price_per_1m(True)
    with pytest.raises(InvalidInput):
        parse_price_per_1m(0.15)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "ppm"), [("0", 0), ("1", 1_000_000), ("0.1", 100_000), ("0.000001", 1), ("1.0", 10**6)]
)
def test_fraction_parses_to_ppm(text: str, ppm: int) -> None:
    assert parse_fraction_ppm(text) == ppm


@pytest.mark.parametrize(
    "text", ["1.5", "-0.1", "-0", "1.000001", "0.0000001", "x", "nan", "", "inf"]
)
def test_bad_fractions_are_refused(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_fraction_ppm(text)


@given(st.integers(min_value=0, max_value=10**10))
def test_price_quote_round_trips(pico: int) -> None:
    assert parse_price_per_1m(str(price_per_1m_usd(pico))) == pico


@given(st.integers(min_value=0, max_value=10**6))
def test_fraction_round_trips(ppm: int) -> None:
    assert parse_fraction_ppm(str(ppm_to_fraction(ppm))) == ppm


@given(st.integers(min_value=0, max_value=10**18))
def test_usd_conversion_is_exact(pico: int) -> None:
    assert usd_to_pico(pico_to_usd(pico)) == pico


def test_format_rounds_half_even_for_display() -> None:
    assert format_usd(1_500_000) == "0.000002"
    assert format_usd(2_500_000) == "0.000002"
    assert format_usd(12_345_678_900_000, places=2) == "12.35"
    assert price_per_1m_usd(10**7) == Decimal(10)
    assert str(price_per_1m_usd(10**7)) == "10"


@given(st.integers(min_value=-(10**24), max_value=10**24))
def test_display_usd_is_the_exact_amount_to_the_cent_or_4_significant_digits(pico: int) -> None:
    shown = display_usd(pico)
    exact = pico_to_usd(pico)
    value = Decimal(shown.replace(",", ""))
    if abs(value) >= Decimal("0.01") or pico == 0:
        assert shown.rpartition(".")[2].isdigit() and len(shown.rpartition(".")[2]) == 2
        assert abs(value - exact) <= Decimal("0.005")
    else:  # under a cent: at most 4 significant digits, within half a unit of the last
        assert 1 <= len(value.normalize().as_tuple().digits) <= 4
        assert abs(value - exact) <= abs(exact) * Decimal("0.0005") * 2


def test_display_usd_examples() -> None:
    assert [display_usd(p) for p in (0, 1, 12_345, 9_999_999_999, 123_456_789_012_345,
                                     1_234_567 * 10**12, -30 * 10**9, 1_200_000_000)] == [
        "0.00", "0.000000000001", "0.00000001234", "0.01", "123.46", "1,234,567.00", "-0.03",
        "0.0012"]
