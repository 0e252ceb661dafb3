"""Seed a billing database for the web tests: tenants, keys, prices, ledger rows.

Ledger rows go through the real :func:`billing.ledger.write_usage_many` (rated by
the billing layer); the expected figures are summed here, independently, from the
entries the tests *sent*, never from the code under test.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from billing.accounts import create_key, create_tenant
from billing.ledger import LedgerEntry, write_usage_many
from billing.models import ApiKeyId, RequestStatus, ServedBy, TenantId, UsageRecord
from billing.pricing import set_price

ADMIN_TOKEN = "web-test-admin-token-0123456789"
PRICE_FROM = datetime(2025, 1, 1, tzinfo=UTC)
MODELS = {"smollm2-135m": ("0.15", "0.075", "0.60", "0.25"), "big-model": ("3", "1.5", "12", "0.1")}


@dataclass
class TenantSeed:
    name: str
    tenant_id: TenantId
    keys: dict[str, str] = field(default_factory=dict)  # key_id -> plaintext
    entries: list[LedgerEntry] = field(default_factory=list)

    @property
    def first_key(self) -> str:
        return next(iter(self.keys.values()))


def add_prices(factory: sessionmaker[Session]) -> None:
    with factory.begin() as session:
        for model, (inp, cached, out, frac) in MODELS.items():
            set_price(session, model, inp, cached, out, frac, effective_from=PRICE_FROM)


def add_tenant(factory: sessionmaker[Session], name: str, num_keys: int = 2) -> TenantSeed:
    with factory.begin() as session:
        tenant = create_tenant(session, name)
        seed = TenantSeed(name, TenantId(tenant.id))
        for i in range(num_keys):
            row, plaintext = create_key(session, name, f"{name}-key-{i}")
            seed.keys[row.id] = plaintext
    return seed


def random_entries(
    rng: random.Random, seed: TenantSeed, start: datetime, days: int, count: int
) -> list[LedgerEntry]:
    """``count`` plausible entries spread over ``days`` days from ``start``."""
    entries = []
    for _ in range(count):
        prompt = rng.randint(1, 4000)
        semantic = rng.random() < 0.2
        entries.append(
            LedgerEntry(
                request_id=str(uuid.uuid4()),
                tenant_id=seed.tenant_id,
                api_key_id=ApiKeyId(rng.choice(list(seed.keys))),
                model=rng.choice(list(MODELS)),
                served_by=ServedBy.SEMANTIC if semantic else ServedBy.ENGINE,
                status=RequestStatus.OK,
                prompt_tokens=prompt,
                cached_tokens=0 if semantic else rng.randint(0, prompt),
                completion_tokens=rng.randint(0, 800),
                similarity=0.97 if semantic else None,
                worker=None if semantic else "w0",
                created_at=start + timedelta(seconds=rng.randint(0, days * 86400 - 1)),
            )
        )
    return entries


def record(factory: sessionmaker[Session], seed: TenantSeed, entries: list[LedgerEntry]) -> None:
    write_usage_many(factory, entries)
    seed.entries.extend(entries)


def ledger_money(
    session: Session, tenant_id: int, start: datetime, end: datetime
) -> tuple[int, int]:
    """(billed, list) picodollars straight from the ledger table."""
    r = UsageRecord
    stmt = select(func.coalesce(func.sum(r.billed_pico), 0), func.sum(r.list_pico))
    where = (r.tenant_id == tenant_id, r.created_at >= start, r.created_at < end)
    billed, listed = session.execute(stmt.where(*where)).one()
    return int(billed), int(listed or 0)


def sent_totals(entries: list[LedgerEntry], start: datetime, end: datetime) -> dict[str, int]:
    """What the tenant sent in ``[start, end)``: requests and token counts."""
    chosen = [e for e in entries if start <= e.created_at < end]
    return {
        "requests": len(chosen),
        "input_tokens": sum(e.prompt_tokens for e in chosen),
        "cached_tokens": sum(e.cached_tokens for e in chosen),
        "output_tokens": sum(e.completion_tokens for e in chosen),
        "semantic_requests": sum(e.served_by == ServedBy.SEMANTIC for e in chosen),
        "semantic_tokens": sum(
            e.prompt_tokens + e.completion_tokens
            for e in chosen
            if e.served_by == ServedBy.SEMANTIC
        ),
    }
