"""Proxy test helpers: seeding two tenants with keys and a price, ledger queries, apps
built by the real factory and a live uvicorn server on a free port."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import uvicorn
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from billing import accounts, pricing
from billing.ledger import LedgerEntry
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId, UsageRecord
from kvtoll.settings import Settings
from proxy.app import create_app
from proxy.cli.serve import server_config

MODEL = "test-model"
ADMIN_TOKEN = "a-long-and-random-admin-token-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # /metrics and the admin API


@dataclass(frozen=True)
class Tenants:
    key_a: str
    key_b: str
    key_a_id: str
    tenant_a: int
    tenant_b: int


def seed(factory: sessionmaker[Session], model: str = MODEL, rpm: int | None = None) -> Tenants:
    """Tenants ``acme`` and ``globex`` with one key each, and a price for ``model``."""
    with factory.begin() as s:
        a = accounts.create_tenant(s, "acme")
        b = accounts.create_tenant(s, "globex")
        row_a, key_a = accounts.create_key(s, "acme", requests_per_minute=rpm)
        _, key_b = accounts.create_key(s, "globex", requests_per_minute=rpm)
        pricing.set_price(s, model, "1", "0.5", "2", "0.1")
        return Tenants(key_a, key_b, row_a.id, a.id, b.id)


def ledger_rows(factory: sessionmaker[Session]) -> list[UsageRecord]:
    with factory() as s:
        return list(s.scalars(select(UsageRecord).order_by(UsageRecord.created_at, UsageRecord.id)))


def ledger_count(factory: sessionmaker[Session]) -> int:
    with factory() as s:
        return int(s.scalar(select(func.count()).select_from(UsageRecord)) or 0)



def build_app(settings: Settings, factory: sessionmaker[Session], **kwargs: Any) -> FastAPI:
    kwargs.setdefault("models", [MODEL])
    return create_app(settings, session_factory=factory, **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """``app`` served in a thread on 127.0.0.1:<free port>, configured as ``kvtoll serve``
    serves it (:func:`proxy.cli.serve.server_config`)."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        config = server_config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def settled_rows(factory: sessionmaker[Session], count: int) -> list[UsageRecord]:
    """The ledger rows once exactly ``count`` have been written (the outbox drains in the
    background, milliseconds after each response)."""
    wait_until(lambda: ledger_count(factory) >= count, f"{count} ledger rows")
    rows = ledger_rows(factory)
    assert len(rows) == count, [r.request_id for r in rows]
    return rows


def ledger_entry(tenants: Tenants, **changes: object) -> LedgerEntry:
    """A valid ledger entry of tenant A's first key; ``changes`` override its fields."""
    fields: dict[str, object] = dict(
        request_id=str(uuid.uuid4()), tenant_id=TenantId(tenants.tenant_a),
        api_key_id=ApiKeyId(tenants.key_a_id), model="test-model", served_by=ServedBy.ENGINE,
        status=RequestStatus.OK, prompt_tokens=10, cached_tokens=4, completion_tokens=3,
        similarity=None, worker="w", created_at=datetime.now(UTC), latency_ms=1.5, ttft_ms=0.5,
    )
    fields.update(changes)
    return LedgerEntry(**fields)  # type: ignore[arg-type]
