"""Billing fixtures: a migrated database (SQLite and PostgreSQL) and its session factory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade


@pytest.fixture
def migrated_url(db_url: str) -> str:
    """``db_url`` (SQLite, then PostgreSQL) upgraded to the head revision."""
    upgrade(db_url)
    return db_url


@pytest.fixture
def factory(migrated_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(migrated_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def sqlite_factory(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated SQLite database only, for property tests that run many examples."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield session_factory(engine)
    engine.dispose()
