"""Proxy fixtures: a migrated SQLite billing database, two tenants, settings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from kvtoll.settings import Settings, load_settings
from tests.proxy.helpers import ADMIN_TOKEN, Tenants, seed
from tests.proxy.tcp_proxy import TcpProxy


@pytest.fixture
def db(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def tenants(db: sessionmaker[Session]) -> Tenants:
    return seed(db)


@pytest.fixture
def settings(tmp_path: Path, sqlite_url: str) -> Settings:
    return load_settings(
        database_url=sqlite_url, admin_token=ADMIN_TOKEN, secret="test-server-secret",
        data_dir=str(tmp_path / "data"), redis_url=None,
    )


@pytest.fixture
def pg_proxy(postgres_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A TCP proxy in front of a fresh, migrated PostgreSQL database, and its URL."""
    upgrade(postgres_url)
    url = make_url(postgres_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxy.start()
    yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    proxy.stop()


@pytest.fixture
def direct(postgres_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(postgres_url)
    yield session_factory(engine)
    engine.dispose()
