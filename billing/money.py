"""Exact money: integer picodollars (1e-12 USD) in storage, ``Decimal`` at the edges.

Prices are quoted in USD per 1M tokens. One picodollar per token is one microdollar
per 1M tokens, so a quoted price with at most 6 decimals maps exactly to an integer
number of picodollars per token::

    "0.15" USD / 1M tokens  ->  150_000 pico / token

Fractions (the semantic-hit fraction) are stored as integer parts per million.
Nothing here uses floats; parsing refuses NaN, infinities, signs, exponents beyond
the allowed precision and values past the caps below.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from billing.errors import InvalidInput

PICO_PER_USD = 10**12
PICO_PER_TOKEN_PER_USD_PER_1M = 10**6  # pico/token for 1 USD per 1M tokens
PPM = 10**6
MAX_PRICE_USD_PER_1M = Decimal(10_000)  # caps pico/token at 1e10, far from int64 limits
PRICE_DECIMALS = 6  # a microdollar per 1M tokens
FRACTION_DECIMALS = 6  # one part per million


def _parse_decimal(text: str | Decimal | int, what: str) -> Decimal:
    if isinstance(text, bool) or not isinstance(text, str | Decimal | int):
        raise InvalidInput(f"{what} must be a decimal number, got {type(text).__name__}")
    try:
        value = Decimal(text.strip() if isinstance(text, str) else text)
    except InvalidOperation:
        raise InvalidInput(f"{what} must be a decimal number, got {text!r}") from None
    if not value.is_finite():
        raise InvalidInput(f"{what} must be a finite number, got {text!r}")
    return value


def _scaled_int(value: Decimal, scale: int, decimals: int, what: str, text: object) -> int:
    scaled = value * scale
    if scaled != scaled.to_integral_value():
        raise InvalidInput(f"{what} has more than {decimals} decimal places: {text!r}")
    return int(scaled)


def parse_price_per_1m(text: str | Decimal | int, what: str = "price") -> int:
    """Parse a USD-per-1M-tokens price into integer picodollars per token.

    Raises :class:`InvalidInput` for negative, non-numeric, non-finite values, more
    than 6 decimals, or more than ``MAX_PRICE_USD_PER_1M``.
    """
    value = _parse_decimal(text, what)
    if value.is_signed():
        raise InvalidInput(f"{what} must not be negative, got {text!r}")
    if value > MAX_PRICE_USD_PER_1M:
        raise InvalidInput(f"{what} must be at most {MAX_PRICE_USD_PER_1M} USD per 1M tokens")
    return _scaled_int(value, PICO_PER_TOKEN_PER_USD_PER_1M, PRICE_DECIMALS, what, text)


def parse_fraction_ppm(text: str | Decimal | int, what: str = "fraction") -> int:
    """Parse a fraction in [0, 1] (at most 6 decimals) into integer parts per million."""
    value = _parse_decimal(text, what)
    if value.is_signed() or value > 1:
        raise InvalidInput(f"{what} must be between 0 and 1, got {text!r}")
    return _scaled_int(value, PPM, FRACTION_DECIMALS, what, text)


def pico_to_usd(pico: int) -> Decimal:
    """Exact USD amount of ``pico`` picodollars."""
    return Decimal(pico).scaleb(-12)


def usd_to_pico(usd: Decimal | str) -> int:
    """Exact picodollars of a USD amount; raises :class:`InvalidInput` if not exact."""
    value = _parse_decimal(usd, "amount")
    return _scaled_int(value, PICO_PER_USD, 12, "amount", usd)


def exact_usd(pico: int) -> str:
    """``pico`` as an exact USD decimal string with at least two decimals."""
    text = f"{pico_to_usd(pico):.12f}".rstrip("0")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


CENT_PICO = PICO_PER_USD // 100
DISPLAY_SIGNIFICANT_DIGITS = 4


def display_usd(pico: int) -> str:
    """``pico`` for people: to the cent with thousands separators (``1,234.57``), or,
    for a non-zero amount under a cent, to 4 significant digits (``0.0001235``); rounded
    half-even. Display only: exports, APIs and tooltips carry :func:`exact_usd`."""
    amount = pico_to_usd(pico)
    if abs(pico) < CENT_PICO and pico != 0:
        exponent = amount.adjusted() - DISPLAY_SIGNIFICANT_DIGITS + 1
        rounded = amount.quantize(Decimal(1).scaleb(exponent), rounding=ROUND_HALF_EVEN)
        if abs(rounded) < Decimal("0.01"):  # else it rounded up to a whole cent
            return f"{_plain(rounded):f}"
    return f"{amount.quantize(Decimal('0.01'), rounding=ROUND_HALF_EVEN):,.2f}"


def price_per_1m_usd(pico_per_token: int) -> Decimal:
    """The USD-per-1M-tokens quote of a stored per-token price (exact, normalised)."""
    return _plain(Decimal(pico_per_token).scaleb(-6))


def ppm_to_fraction(ppm: int) -> Decimal:
    """The exact fraction of a parts-per-million value (e.g. 250000 -> 0.25)."""
    return _plain(Decimal(ppm).scaleb(-6))


def format_usd(pico: int, places: int = 6) -> str:
    """``pico`` as a USD string with ``places`` decimals, rounded half-even (display only)."""
    quantum = Decimal(1).scaleb(-places)
    return str(pico_to_usd(pico).quantize(quantum, rounding=ROUND_HALF_EVEN))


def _plain(value: Decimal) -> Decimal:
    """Drop trailing zeros without switching to exponent notation (1E+1 -> 10)."""
    normal = value.normalize()
    exponent = normal.as_tuple().exponent
    return normal.quantize(Decimal(1)) if isinstance(exponent, int) and exponent > 0 else normal
