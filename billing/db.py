"""Engine and session factories for SQLite (embedded default) and PostgreSQL.

SQLite connections get WAL journaling (readers never block the writer), foreign
keys on and a busy timeout so concurrent writers wait (a bounded time) instead of
failing. PostgreSQL connections are checked before use (``pool_pre_ping``) and never
wait without bound (:class:`DbTimeouts`): a connect timeout, TCP keepalives and a
TCP user timeout (a server whose packets are dropped is given up on), a pool
checkout timeout and, where the caller asks for one (the gateway does), a
server-side statement timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from billing.errors import InvalidInput

SQLITE_BUSY_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class DbTimeouts:
    """How long a database call may wait; ``statement_timeout_ms`` None: no limit (the
    default for the CLI and migrations, whose statements may run long)."""

    connect_timeout_s: float = 5.0
    statement_timeout_ms: int | None = None
    sqlite_busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS
    pool_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.pool_timeout_s <= 0:
            raise ValueError("database timeouts must be positive")
        if self.sqlite_busy_timeout_ms < 0 or (self.statement_timeout_ms or 0) < 0:
            raise ValueError("database timeouts must not be negative")

    def postgres_connect_args(self) -> dict[str, Any]:
        """libpq parameters: connect timeout (whole seconds, at least 1), keepalives that
        give a silent peer up after about the connect timeout, the same bound on unacked
        data (``tcp_user_timeout``), and the statement timeout if set."""
        seconds = max(1, round(self.connect_timeout_s))
        args: dict[str, Any] = {
            "connect_timeout": seconds, "keepalives": 1, "keepalives_idle": seconds,
            "keepalives_interval": 1, "keepalives_count": 3,
            "tcp_user_timeout": int(self.connect_timeout_s * 1000),
        }
        if self.statement_timeout_ms:
            args["options"] = f"-c statement_timeout={self.statement_timeout_ms}"
        return args


def _is_memory_sqlite(database: str | None) -> bool:
    return not database or database == ":memory:" or "mode=memory" in database


def _on_sqlite_connect(dbapi_conn: Any, _record: Any, *, memory: bool, busy_ms: int) -> None:
    cursor = dbapi_conn.cursor()
    try:
        if not memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def make_engine(url: str, *, echo: bool = False, timeouts: DbTimeouts | None = None) -> Engine:
    """Build the engine for ``url``; call once per process and pass it down.
    :class:`InvalidInput` (one line) for a URL that is unparsable or names a database
    whose driver is not installed."""
    timeouts = timeouts or DbTimeouts()
    try:
        parsed = make_url(url)
        if parsed.get_backend_name() == "postgresql":
            return create_engine(parsed, pool_pre_ping=True, echo=echo,
                                 pool_timeout=timeouts.pool_timeout_s,
                                 connect_args=timeouts.postgres_connect_args())
        if parsed.get_backend_name() != "sqlite":
            return create_engine(parsed, pool_pre_ping=True, echo=echo)
    except (ArgumentError, ImportError) as exc:
        raise InvalidInput(f"cannot use the database URL (KVTOLL_DATABASE_URL): {exc}") from None
    memory = _is_memory_sqlite(parsed.database)
    busy_ms = timeouts.sqlite_busy_timeout_ms
    kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False,
                                               "timeout": busy_ms / 1000}, "echo": echo}
    if memory:
        kwargs["poolclass"] = StaticPool  # one shared connection, else each sees an empty db
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, record: Any) -> None:
        _on_sqlite_connect(dbapi_conn, record, memory=memory, busy_ms=busy_ms)

    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to ``engine``; objects stay readable after commit."""
    return sessionmaker(engine, expire_on_commit=False)
