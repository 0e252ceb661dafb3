"""Keys are shown once and then exist nowhere: not in the database, not in the logs."""

from __future__ import annotations

import logging
import sqlite3
import uuid
from datetime import UTC, datetime

import pytest
import typer
from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from billing import accounts, keys
from billing.cli import register
from billing.db import make_engine, session_factory
from billing.ledger import LedgerEntry, write_usage
from billing.models import RequestStatus, ServedBy


def _dump(url: str, engine: Engine) -> str:
    """Every row of every table as text (SQLite: the SQL dump itself)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        with sqlite3.connect(str(parsed.database)) as conn:
            return "\n".join(conn.iterdump())
    lines: list[str] = []
    with engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            rows = conn.execute(text(f'SELECT CAST(t AS text) FROM "{table}" AS t')).scalars()
            lines.extend(f"{table}: {row}" for row in rows)
    return "\n".join(lines)


def _cli_create_key(monkeypatch: pytest.MonkeyPatch, url: str, tenant: str) -> str:
    monkeypatch.setenv("KVTOLL_DATABASE_URL", url)
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["key", "create", tenant, "--name", "cli"])
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.stdout.splitlines() if line.startswith("key kvt_")]
    return line.removeprefix("key ")


def test_plaintext_keys_appear_in_no_table_and_no_log(
    migrated_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.engine")  # statements and parameters
    engine = make_engine(migrated_url)
    factory = session_factory(engine)
    with factory.begin() as session:
        accounts.create_tenant(session, "acme")
        rows_and_keys = [accounts.create_key(session, "acme", f"k{i}") for i in range(3)]
    plaintexts = [plaintext for _, plaintext in rows_and_keys]
    plaintexts.append(_cli_create_key(monkeypatch, migrated_url, "acme"))
    with factory.begin() as session:
        identity = accounts.resolve_key(session, plaintexts[0])
        assert identity is not None
        assert all(accounts.resolve_key(session, p) is not None for p in plaintexts)
        accounts.revoke_key(session, rows_and_keys[1][0].id)
    entry = LedgerEntry(
        str(uuid.uuid4()), identity.tenant_id, identity.key_id, "smol", ServedBy.ENGINE,
        RequestStatus.OK, 10, 0, 5, None, None, datetime.now(UTC),
    )
    assert write_usage(factory, entry)
    dump = _dump(migrated_url, engine)
    engine.dispose()
    logs = caplog.text + "\n".join(str(r.__dict__) for r in caplog.records)

    assert "api_keys" in dump and keys.hash_key(plaintexts[0]) in dump  # the dump is real
    assert "INSERT INTO api_keys" in logs and "UPDATE api_keys" in logs  # SQL was logged
    for plaintext in plaintexts:
        secret_part = plaintext[len(keys.KEY_PREFIX) : -keys.CHECKSUM_LENGTH]
        for haystack in (dump, logs):
            assert plaintext not in haystack
            assert secret_part not in haystack
            assert secret_part[4:-4] not in haystack
