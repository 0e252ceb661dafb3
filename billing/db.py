"""Engine and session factories for SQLite (embedded default) and PostgreSQL.

SQLite connections get WAL journaling (readers never block the writer), foreign
keys on and a busy timeout so concurrent writers wait instead of failing.
PostgreSQL connections are checked before use (``pool_pre_ping``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from billing.errors import InvalidInput

SQLITE_BUSY_TIMEOUT_MS = 10_000


def _is_memory_sqlite(database: str | None) -> bool:
    return not database or database == ":memory:" or "mode=memory" in database


def _on_sqlite_connect(dbapi_conn: Any, _record: Any, *, memory: bool) -> None:
    cursor = dbapi_conn.cursor()
    try:
        if not memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """Build the engine for ``url``; call once per process and pass it down.
    :class:`InvalidInput` (one line) for a URL that is unparsable or names a database
    whose driver is not installed."""
    try:
        parsed = make_url(url)
        if parsed.get_backend_name() != "sqlite":
            return create_engine(parsed, pool_pre_ping=True, echo=echo)
    except (ArgumentError, ImportError) as exc:
        raise InvalidInput(f"cannot use the database URL (KVTOLL_DATABASE_URL): {exc}") from None
    memory = _is_memory_sqlite(parsed.database)
    kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False}, "echo": echo}
    if memory:
        kwargs["poolclass"] = StaticPool  # one shared connection, else each sees an empty db
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, record: Any) -> None:
        _on_sqlite_connect(dbapi_conn, record, memory=memory)

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to ``engine``; objects stay readable after commit."""
    return sessionmaker(engine, expire_on_commit=False)
