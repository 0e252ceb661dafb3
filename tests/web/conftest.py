"""Web fixtures: a migrated database, its session factory and test settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from kvtoll.settings import Settings, load_settings
from tests.web.webseed import ADMIN_TOKEN


@pytest.fixture
def settings() -> Settings:
    return load_settings(admin_token=ADMIN_TOKEN, secret="web-test-secret", dev_mode=False)


@pytest.fixture
def web_factory(db_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated database on SQLite, then on PostgreSQL."""
    upgrade(db_url)
    engine = make_engine(db_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def sqlite_web_factory(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated SQLite database only (browser tests, many-example tests)."""
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield session_factory(engine)
    engine.dispose()
