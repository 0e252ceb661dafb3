"""Billing fixtures: a migrated database (SQLite and PostgreSQL) and its session factory.

PostgreSQL: one database per test session, migrated once and emptied (TRUNCATE)
before each test, so that the many small billing tests do not each pay for a
CREATE DATABASE + migration. Tests of the migrations themselves use the root
``postgres_url`` fixture (a fresh, empty database).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from billing.models import Base


@pytest.fixture(scope="session")
def _shared_postgres_url() -> Iterator[str]:
    """A migrated PostgreSQL database shared by this session's billing tests."""
    raw = os.environ.get("KVTOLL_TEST_DATABASE_URL", "").strip()
    if not raw:
        message = "PostgreSQL not configured: set KVTOLL_TEST_DATABASE_URL (see .ci/run)"
        if os.environ.get("KVTOLL_REQUIRE_SERVICES") == "1":
            pytest.fail(f"KVTOLL_REQUIRE_SERVICES=1 but {message}")
        pytest.skip(message)
    base = make_url(raw)
    name = f"kvtoll_billing_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = base.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _truncate_all(url: str) -> None:
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def migrated_url(request: pytest.FixtureRequest) -> str:
    """An empty database at the head revision: SQLite, then the real PostgreSQL."""
    if request.param == "sqlite":
        url = str(request.getfixturevalue("sqlite_url"))
        upgrade(url)
        return url
    url = str(request.getfixturevalue("_shared_postgres_url"))
    _truncate_all(url)
    return url


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
