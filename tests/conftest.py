"""Shared fixtures: real PostgreSQL and Redis when configured, SQLite otherwise.

``KVTOLL_TEST_DATABASE_URL`` / ``KVTOLL_TEST_REDIS_URL`` name the services (CI sets
them from ``../shared/tools/ensure-services.sh``). Without them the tests that need a
service skip with a reason; with ``KVTOLL_REQUIRE_SERVICES=1`` they fail instead.
Each PostgreSQL test gets its own fresh database; each Redis test its own key prefix.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url


def _service_url(var: str, what: str) -> str:
    url = os.environ.get(var, "").strip()
    if not url:
        message = f"{what} not configured: set {var} (see .ci/run) to run this test"
        if os.environ.get("KVTOLL_REQUIRE_SERVICES") == "1":
            pytest.fail(f"KVTOLL_REQUIRE_SERVICES=1 but {message}")
        pytest.skip(message)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'kvtoll.db'}"


@pytest.fixture
def postgres_base_url() -> str:
    """The configured PostgreSQL server's URL (for code that makes its own databases)."""
    return _service_url("KVTOLL_TEST_DATABASE_URL", "PostgreSQL")


@pytest.fixture
def postgres_url(postgres_base_url: str) -> Iterator[str]:
    """URL of a new, empty PostgreSQL database, dropped after the test."""
    base = make_url(postgres_base_url)
    name = f"kvtoll_t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        admin.dispose()
        pytest.fail(f"PostgreSQL at {base.render_as_string()} is not usable: {exc}")
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Run a test once on SQLite and once on the real PostgreSQL."""
    name = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(name))


@pytest.fixture(scope="session")
def redis_url() -> str:
    return _service_url("KVTOLL_TEST_REDIS_URL", "Redis")


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A unique key prefix; every key under it is deleted after the test."""
    import redis

    prefix = f"kvtoll-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
