from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError, StatementError
from sqlalchemy.orm import Session, sessionmaker

from billing.db import SQLITE_BUSY_TIMEOUT_MS, make_engine, session_factory
from billing.models import Base, Tenant


def test_sqlite_connections_use_wal_foreign_keys_and_busy_timeout(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == SQLITE_BUSY_TIMEOUT_MS
    finally:
        engine.dispose()


def test_in_memory_sqlite_is_one_database_for_every_session() -> None:
    engine = make_engine("sqlite://")
    try:
        Base.metadata.create_all(engine)
        factory = session_factory(engine)
        with factory.begin() as session:
            session.add(Tenant(name="acme", created_at=datetime.now(UTC)))
        with factory() as session:
            assert session.scalars(select(Tenant.name)).all() == ["acme"]
    finally:
        engine.dispose()


@pytest.mark.parametrize("migrated_url", ["postgres"], indirect=True)
def test_postgres_engine_pings_before_use(migrated_url: str) -> None:
    engine = make_engine(migrated_url)
    try:
        assert engine.pool._pre_ping
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


def test_times_come_back_aware_utc_and_naive_times_are_refused(
    factory: sessionmaker[Session],
) -> None:
    schema_factory = factory
    moment = datetime(2026, 5, 1, 12, 30, 15, 123456, tzinfo=timezone(timedelta(hours=-5)))
    with schema_factory.begin() as session:
        session.add(Tenant(name="acme", created_at=moment))
    with schema_factory() as session:
        stored = session.scalars(select(Tenant.created_at)).one()
        assert stored == moment and stored.tzinfo == UTC
        assert stored.hour == 17
    with pytest.raises(StatementError, match="naive"), schema_factory.begin() as session:
        session.add(Tenant(name="naive", created_at=datetime(2026, 5, 1)))
    with pytest.raises(IntegrityError), schema_factory.begin() as session:
        session.add(Tenant(name="acme", created_at=moment))
