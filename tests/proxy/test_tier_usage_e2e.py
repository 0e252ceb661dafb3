"""Which KV tier served the cached tokens, end to end through the real engine (tiny
random Llama with a host tier, in-process) and the gateway: the usage object's
``prompt_tokens_details.kvtoll_tier_cached_tokens`` and the ledger row's
``tier_host_cached_tokens`` / ``tier_shared_cached_tokens``, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.tier.config import TierConfig
from kvtoll.settings import load_settings
from proxy.upstream.inprocess import InProcessUpstream
from tests.proxy.helpers import ADMIN_TOKEN, LiveServer, build_app, seed, settled_rows

SYSTEM_A = "Tier A: the careful assistant of the kvtoll tests. " * 3  # ~10 blocks of 16
SYSTEM_B = "Tier B: another assistant, other words entirely!! " * 3


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    # 16 blocks of 16 tokens: B's prompt evicts part of A's, which goes to the host tier.
    config = EngineConfig.tiny(num_kv_blocks=16, kv_tier=TierConfig(host_bytes=1 << 20))
    eng = build_engine(config)
    yield eng
    eng.shutdown()


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tier.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def factory(ledger_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(ledger_url)
    db = make_engine(ledger_url)
    yield session_factory(db)
    db.dispose()


def _ask(server: LiveServer, key: str, model: str, system: str) -> dict[str, Any]:
    body = {
        "model": model, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
    }
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    details: dict[str, Any] = response.json()["usage"]["prompt_tokens_details"]
    return details


def test_usage_and_ledger_say_which_tier_served_the_cached_tokens(
    engine: AsyncEngine, factory: sessionmaker[Session], tmp_path: Path, ledger_url: str
) -> None:
    tier = engine.engine.tier
    assert tier is not None
    tenants = seed(factory, model=engine.model_name)
    settings = load_settings(database_url=ledger_url, admin_token=ADMIN_TOKEN,
                             secret="test-server-secret", data_dir=str(tmp_path / "data"),
                             redis_url=None)
    app = build_app(settings, factory, upstreams=[InProcessUpstream(engine)],
                    models=[engine.model_name], tokenizer=engine.tokenizer(),
                    context_len=engine.max_model_len)
    with LiveServer(app) as server:
        first = _ask(server, tenants.key_a, engine.model_name, SYSTEM_A)
        _ask(server, tenants.key_a, engine.model_name, SYSTEM_B)  # evicts A's blocks
        tier.writer.drain()  # the evicted blocks have reached the host tier
        again = _ask(server, tenants.key_a, engine.model_name, SYSTEM_A)
        rows = settled_rows(factory, 3)

    assert first == {"cached_tokens": 0, "kvtoll_tier_cached_tokens": {"host": 0, "shared": 0}}
    assert tier.num_loaded_blocks > 0
    host = tier.num_loaded_blocks * engine.block_size
    assert again["kvtoll_tier_cached_tokens"] == {"host": host, "shared": 0}
    assert 0 < host <= again["cached_tokens"]
    row = rows[2]
    assert row.cached_tokens == again["cached_tokens"]
    assert (row.tier_host_cached_tokens, row.tier_shared_cached_tokens) == (host, 0)
    assert (rows[0].tier_host_cached_tokens, rows[0].tier_shared_cached_tokens) == (0, 0)
