"""Every price row in memory, detached from the session, for rating outside the ledger.

The gateway's budget checks estimate and settle request costs with
:func:`billing.rating.rate` against this book, reloaded periodically (prices are only
ever added, so a reload sees every change), never per request.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import Price
from billing.rating import PriceQuote


@dataclass(frozen=True)
class PriceBook:
    """Prices per model, oldest ``effective_from`` first."""

    starts: Mapping[str, tuple[datetime, ...]] = field(default_factory=dict)
    quotes: Mapping[str, tuple[PriceQuote, ...]] = field(default_factory=dict)

    @classmethod
    def load(cls, session: Session) -> PriceBook:
        """The whole price table (one query)."""
        starts: dict[str, list[datetime]] = {}
        quotes: dict[str, list[PriceQuote]] = {}
        for p in session.scalars(select(Price).order_by(Price.model, Price.effective_from)):
            starts.setdefault(p.model, []).append(p.effective_from)
            quotes.setdefault(p.model, []).append(PriceQuote(
                p.input_pico, p.cached_input_pico, p.output_pico, p.semantic_hit_ppm))
        return cls({m: tuple(s) for m, s in starts.items()},
                   {m: tuple(q) for m, q in quotes.items()})

    def in_force(self, model: str, at: datetime) -> PriceQuote | None:
        """The price of ``model`` with the latest ``effective_from`` at or before ``at``."""
        starts = self.starts.get(model)
        if not starts:
            return None
        i = bisect.bisect_right(starts, at)
        return self.quotes[model][i - 1] if i else None
