from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from billing import pricing
from billing.errors import Conflict, InvalidInput
from billing.models import Price

Factory = sessionmaker[Session]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _set(session: Session, at: datetime, input: str = "0.15") -> Price:
    return pricing.set_price(session, "smol", input, "0.075", "0.6", "0.1", effective_from=at)


def test_price_in_force_follows_history_and_never_rewrites_it(factory: Factory) -> None:
    with factory.begin() as session:
        first = _set(session, T0)
        second = _set(session, T0 + timedelta(days=31), input="0.30")
        pricing.set_price(session, "other", "1", "1", "1", "1", effective_from=T0)
    assert (first.input_pico, first.cached_input_pico, first.output_pico) == (
        150_000, 75_000, 600_000,
    )
    assert first.semantic_hit_ppm == 100_000 and second.input_pico == 300_000
    with factory() as session:
        assert pricing.price_in_force(session, "smol", T0 - timedelta(microseconds=1)) is None
        at_start = pricing.price_in_force(session, "smol", T0)
        mid = pricing.price_in_force(session, "smol", T0 + timedelta(days=30))
        later = pricing.price_in_force(session, "smol", T0 + timedelta(days=400))
        assert at_start is not None and mid is not None and later is not None
        assert at_start.id == mid.id == first.id and later.id == second.id
        assert pricing.price_in_force(session, "unknown", T0) is None
        assert [p.id for p in pricing.list_prices(session, "smol")] == [first.id, second.id]
        assert len(pricing.list_prices(session)) == 3
        current = pricing.current_prices(session, T0 + timedelta(days=40))
        assert [(p.model, p.id) for p in current] == [("other", current[0].id), ("smol", second.id)]


def test_times_in_other_zones_are_compared_as_instants(factory: Factory) -> None:
    plus_two = timezone(timedelta(hours=2))
    with factory.begin() as session:
        row = _set(session, datetime(2026, 3, 1, 2, 0, tzinfo=plus_two))  # 00:00 UTC
    assert row.effective_from == datetime(2026, 3, 1, tzinfo=UTC)
    with factory() as session:
        before = datetime(2026, 2, 28, 23, 59, tzinfo=UTC)
        assert pricing.price_in_force(session, "smol", before) is None
        found = pricing.price_in_force(session, "smol", datetime(2026, 3, 1, 1, 0, tzinfo=plus_two))
        assert found is None
        found = pricing.price_in_force(session, "smol", datetime(2026, 3, 1, 0, 0, tzinfo=UTC))
        assert found is not None and found.effective_from.tzinfo is not None


def test_same_model_and_instant_is_a_conflict(factory: Factory) -> None:
    with factory.begin() as session:
        _set(session, T0)
    with pytest.raises(Conflict), factory.begin() as session:
        _set(session, T0, input="9")
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(Price)) == 1


@pytest.mark.parametrize(
    ("input", "cached", "output", "fraction"),
    [("-1", "0", "0", "0.5"), ("abc", "0", "0", "0.5"), ("1", "0", "NaN", "0.5"),
     ("1", "0", "0", "1.5"), ("1", "0", "0", "-0.1"), ("1", "2", "0", "0.5"),
     ("0.0000001", "0", "0", "0")],
)
def test_bad_prices_write_nothing(
    sqlite_factory: Factory, input: str, cached: str, output: str, fraction: str
) -> None:
    with pytest.raises(InvalidInput), sqlite_factory.begin() as session:
        pricing.set_price(session, "smol", input, cached, output, fraction, effective_from=T0)
    with sqlite_factory() as session:
        assert session.scalar(select(func.count()).select_from(Price)) == 0


def test_naive_times_and_bad_models_are_refused(sqlite_factory: Factory) -> None:
    with sqlite_factory() as session:
        with pytest.raises(InvalidInput, match="time zone"):
            _set(session, datetime(2026, 1, 1))
        with pytest.raises(InvalidInput, match="time zone"):
            pricing.price_in_force(session, "smol", datetime(2026, 1, 1))
        with pytest.raises(InvalidInput):
            pricing.set_price(session, " ", "1", "1", "1", "1")
