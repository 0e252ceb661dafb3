"""What every billing command shares: the configured database in one transaction (a
caller's mistake or a database error becomes one ``error:`` line, exit 2), the tab-separated
table output, and parsing of times and numbers into one-line errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TypeVar

import typer
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from billing.db import make_engine, session_factory
from billing.errors import BillingError
from billing.schema import schema_problem
from kvtoll.cli.errors import fail
from kvtoll.settings import load_settings

T = TypeVar("T")


def first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def database_url() -> str:
    return load_settings().database_url


def require_schema(url: str, engine: Engine) -> None:
    problem = schema_problem(url, engine)
    if problem:
        fail(problem)


@contextmanager
def transaction() -> Iterator[Session]:
    """One committed transaction on the configured database; errors become exit 2."""
    url = database_url()
    engine = engine_for(url)
    try:
        require_schema(url, engine)
        with session_factory(engine).begin() as session:
            yield session
    except BillingError as exc:
        fail(str(exc))
    except SQLAlchemyError as exc:
        fail(f"database error: {first_line(exc)}")
    finally:
        engine.dispose()


def engine_for(url: str) -> Engine:
    """The engine for ``url``, or one ``error:`` line for an unusable URL."""
    try:
        return make_engine(url)
    except BillingError as exc:
        fail(str(exc))


def print_rows(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    typer.echo("\t".join(header))
    for row in rows:
        typer.echo("\t".join("-" if v is None else str(v) for v in row))


def iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="seconds")


def parse_moment(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        fail(f"--effective-from must be an ISO 8601 time, got {text!r}")
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def pick(given: T | None, current: T) -> T:
    return current if given is None else given


def number(text: str | None, kind: Callable[[str], T], option: str) -> T | None:
    """Parse a numeric option ourselves so that a bad value is a one-line error."""
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        fail(f"{option} must be a number, got {text!r}")
    if value != value or value in (float("inf"), float("-inf")):  # NaN / infinities
        fail(f"{option} must be a finite number, got {text!r}")
    return value


@contextmanager
def session() -> Iterator[Session]:
    """A session on the configured database that commits only when the caller does;
    database errors become one ``error:`` line, exit 2."""
    url = database_url()
    engine = engine_for(url)
    try:
        require_schema(url, engine)
        with session_factory(engine)() as opened:
            yield opened
    except SQLAlchemyError as exc:
        fail(f"database error: {first_line(exc)}")
    finally:
        engine.dispose()
