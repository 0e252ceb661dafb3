"""Price book: per-model prices with an effective-from time; history is never rewritten.

A price change inserts a new row; :func:`price_in_force` picks, for a model and an
instant, the row with the latest ``effective_from`` not after that instant. Ledger
rows keep the ``price_id`` they were rated with. Services flush; the caller commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing.errors import Conflict, InvalidInput
from billing.models import Price
from billing.money import parse_fraction_ppm, parse_price_per_1m

MAX_MODEL_LENGTH = 128
PriceInput = str | Decimal | int


def _check_model(model: str) -> str:
    model = model.strip()
    if not model or len(model) > MAX_MODEL_LENGTH or not model.isprintable():
        raise InvalidInput(f"model must be 1-{MAX_MODEL_LENGTH} printable characters")
    return model


def _aware(moment: datetime, what: str) -> datetime:
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise InvalidInput(f"{what} must include a time zone (e.g. 2026-01-01T00:00:00Z)")
    return moment.astimezone(UTC)


def set_price(
    session: Session,
    model: str,
    input: PriceInput,
    cached_input: PriceInput,
    output: PriceInput,
    semantic_fraction: PriceInput,
    effective_from: datetime | None = None,
) -> Price:
    """Add a price for ``model`` (USD per 1M tokens) taking effect at ``effective_from``.

    Raises :class:`InvalidInput` for a bad amount, a fraction outside [0, 1], a
    cached price above the input price or a naive time, and :class:`Conflict` if the
    model already has a price taking effect at that exact instant.
    """
    model = _check_model(model)
    row = Price(
        model=model,
        input_pico=parse_price_per_1m(input, "input price"),
        cached_input_pico=parse_price_per_1m(cached_input, "cached input price"),
        output_pico=parse_price_per_1m(output, "output price"),
        semantic_hit_ppm=parse_fraction_ppm(semantic_fraction, "semantic fraction"),
        effective_from=_aware(effective_from or datetime.now(UTC), "effective_from"),
        created_at=datetime.now(UTC),
    )
    if row.cached_input_pico > row.input_pico:
        raise InvalidInput("cached input price must not exceed the input price")
    clash = select(Price.id).where(
        Price.model == model, Price.effective_from == row.effective_from
    )
    if session.scalar(clash) is not None:
        raise Conflict(f"model {model!r} already has a price effective {row.effective_from}")
    session.add(row)
    try:
        session.flush()
    except IntegrityError as exc:
        raise Conflict(f"model {model!r} already has a price at that time") from exc
    return row


def list_prices(session: Session, model: str | None = None) -> Sequence[Price]:
    """Every price row (history included), by model then effective time."""
    query = select(Price).order_by(Price.model, Price.effective_from)
    if model is not None:
        query = query.where(Price.model == model)
    return session.scalars(query).all()


def price_in_force(session: Session, model: str, at: datetime) -> Price | None:
    """The price of ``model`` at instant ``at`` (``None`` if none was in force yet)."""
    query = (
        select(Price)
        .where(Price.model == model, Price.effective_from <= _aware(at, "at"))
        .order_by(Price.effective_from.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def current_prices(session: Session, at: datetime | None = None) -> Sequence[Price]:
    """For each model, the price in force at ``at`` (default: now)."""
    moment = _aware(at or datetime.now(UTC), "at")
    models = session.scalars(select(Price.model).distinct().order_by(Price.model)).all()
    found = (price_in_force(session, model, moment) for model in models)
    return [price for price in found if price is not None]
