"""Rating: a pure function from one request's usage and the price in force to money.

Algorithm (all integers, picodollars; prices are picodollars per token)::

    list      = prompt * input + completion * output          (no cache at all)
    engine    : uncached_input = (prompt - cached) * input
                cached_input   = cached * cached_input
                output         = completion * output
                billed         = uncached_input + cached_input + output
    semantic  : semantic_hit   = round_half_even(list * semantic_hit_ppm / 1e6)
                billed         = semantic_hit            (cached tokens are ignored)

Parameters: ``input``, ``cached_input``, ``output`` (pico/token, >= 0) and
``semantic_hit_ppm`` (0..1e6) from the :class:`~billing.models.Price` row.

Rounding rule: the only non-integer step is the semantic fraction; it is rounded
once, half-to-even, to a whole picodollar. Every charge therefore equals the exact
sum of its parts, and invoice totals equal the exact sum of their lines. With
``cached_input <= input`` (enforced by :mod:`billing.pricing`) and a fraction
<= 1, ``billed <= list`` always. Rating does not look at the request status: the
caller reports the tokens that were actually processed.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Protocol

from billing.models import ServedBy
from billing.money import PPM


class PriceTerms(Protocol):
    """What rating needs of a price; :class:`billing.models.Price` satisfies it."""

    @property
    def input_pico(self) -> int: ...
    @property
    def cached_input_pico(self) -> int: ...
    @property
    def output_pico(self) -> int: ...
    @property
    def semantic_hit_ppm(self) -> int: ...


@dataclass(frozen=True)
class PriceQuote:
    """A price detached from the database (tests, previews)."""

    input_pico: int
    cached_input_pico: int
    output_pico: int
    semantic_hit_ppm: int


@dataclass(frozen=True)
class Usage:
    """Token counts of one request, as OpenAI reports them (cached is part of prompt)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    served_by: ServedBy


@dataclass(frozen=True)
class Charge:
    """Money for one request, in picodollars; ``billed`` is the exact sum of the parts."""

    billed_pico: int
    list_pico: int
    uncached_input_pico: int = 0
    cached_input_pico: int = 0
    output_pico: int = 0
    semantic_hit_pico: int = 0

    @property
    def savings_pico(self) -> int:
        """What the caches saved against the list price."""
        return self.list_pico - self.billed_pico


ZERO_CHARGE = Charge(billed_pico=0, list_pico=0)


def validate_usage(usage: Usage) -> None:
    """Raise ``ValueError`` for negative counts or cached tokens beyond the prompt."""
    counts = (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"token counts must be non-negative integers, got {counts}")
    if usage.cached_tokens > usage.prompt_tokens:
        raise ValueError(
            f"cached_tokens ({usage.cached_tokens}) exceed prompt_tokens ({usage.prompt_tokens})"
        )


def _validate_price(price: PriceTerms) -> None:
    per_token = (price.input_pico, price.cached_input_pico, price.output_pico)
    if any(p < 0 for p in per_token):
        raise ValueError(f"price per token must not be negative, got {per_token}")
    if not 0 <= price.semantic_hit_ppm <= PPM:
        raise ValueError(f"semantic_hit_ppm must be in [0, {PPM}], got {price.semantic_hit_ppm}")


def apply_fraction(amount_pico: int, ppm: int) -> int:
    """``amount * ppm / 1e6`` rounded half-to-even to a whole picodollar."""
    exact = Decimal(amount_pico) * Decimal(ppm) / Decimal(PPM)
    return int(exact.to_integral_value(rounding=ROUND_HALF_EVEN))


def rate(usage: Usage, price: PriceTerms) -> Charge:
    """Rate one request; raises ``ValueError`` for impossible usage or prices."""
    validate_usage(usage)
    _validate_price(price)
    list_pico = usage.prompt_tokens * price.input_pico + usage.completion_tokens * price.output_pico
    if usage.served_by == ServedBy.SEMANTIC:
        hit = apply_fraction(list_pico, price.semantic_hit_ppm)
        return Charge(billed_pico=hit, list_pico=list_pico, semantic_hit_pico=hit)
    uncached = (usage.prompt_tokens - usage.cached_tokens) * price.input_pico
    cached = usage.cached_tokens * price.cached_input_pico
    output = usage.completion_tokens * price.output_pico
    return Charge(
        billed_pico=uncached + cached + output,
        list_pico=list_pico,
        uncached_input_pico=uncached,
        cached_input_pico=cached,
        output_pico=output,
    )
