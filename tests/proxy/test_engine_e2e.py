"""End to end through the real engine (tiny random Llama, byte tokenizer): prefix-cache
hits reported as ``cached_tokens`` and billed at the cached price, tenant isolation."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from kvtoll.settings import Settings
from proxy.upstream.inprocess import InProcessUpstream
from tests.proxy.helpers import LiveServer, Tenants, build_app, seed, settled_rows

SYSTEM = "You are a careful assistant for the kvtoll tests. " * 3  # > 8 blocks of 16 bytes
PRICE_PICO = {"input": 1_000_000, "cached": 500_000, "output": 2_000_000}  # seed(): 1/0.5/2 USD


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    eng = build_engine(EngineConfig.tiny())
    yield eng
    eng.shutdown()


@pytest.fixture
def world(
    settings: Settings, db: sessionmaker[Session], engine: AsyncEngine
) -> Iterator[tuple[LiveServer, Tenants]]:
    tenants = seed(db, model=engine.model_name)
    app = build_app(settings, db, upstreams=[InProcessUpstream(engine)],
                    models=[engine.model_name], tokenizer=engine.tokenizer(),
                    context_len=engine.max_model_len)
    with LiveServer(app) as server:
        yield server, tenants


def _client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _ask(client: openai.OpenAI, model: str, user: str = "hi") -> tuple[int, int, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    )
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return usage.prompt_tokens, cached, raw.headers["x-kvtoll-cache"]


def test_repeated_system_prompt_hits_and_bills_cached_price(
    world: tuple[LiveServer, Tenants], engine: AsyncEngine, db: sessionmaker[Session]
) -> None:
    server, tenants = world
    client = _client(server, tenants.key_a)
    _, cached1, header1 = _ask(client, engine.model_name, "first question")
    prompt2, cached2, header2 = _ask(client, engine.model_name, "other question")
    assert (cached1, header1) == (0, "miss")
    assert cached2 > 0 and header2 == "prefix"
    assert cached2 % engine.block_size == 0 and cached2 < prompt2
    first, second = settled_rows(db, 2)
    assert (second.prompt_tokens, second.cached_tokens) == (prompt2, cached2)
    for row in (first, second):
        expected = (
            (row.prompt_tokens - row.cached_tokens) * PRICE_PICO["input"]
            + row.cached_tokens * PRICE_PICO["cached"]
            + row.completion_tokens * PRICE_PICO["output"]
        )
        assert row.billed_pico == expected
    assert second.billed_pico < second.list_pico


def test_tenant_isolation_both_halves(
    world: tuple[LiveServer, Tenants], engine: AsyncEngine
) -> None:
    server, tenants = world
    a, b = _client(server, tenants.key_a), _client(server, tenants.key_b)
    assert _ask(a, engine.model_name)[1] == 0
    _, cached_b, header_b = _ask(b, engine.model_name)  # A's exact prompt, other tenant
    assert (cached_b, header_b) == (0, "miss")
    _, cached_a, header_a = _ask(a, engine.model_name)
    assert cached_a > 0 and header_a == "prefix"


def test_streaming_usage_reports_cached_tokens(
    world: tuple[LiveServer, Tenants], engine: AsyncEngine, db: sessionmaker[Session]
) -> None:
    server, tenants = world
    client = _client(server, tenants.key_a)
    _ask(client, engine.model_name)
    stream = client.chat.completions.create(
        model=engine.model_name, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0
    assert settled_rows(db, 2)[-1].cached_tokens == usage.prompt_tokens_details.cached_tokens
    completions = client.completions.create(model=engine.model_name, prompt=SYSTEM, max_tokens=3)
    assert completions.usage is not None and completions.usage.completion_tokens <= 3


def test_logprobs_pass_through(
    world: tuple[LiveServer, Tenants], engine: AsyncEngine
) -> None:
    server, tenants = world
    client = _client(server, tenants.key_a)
    out = client.chat.completions.create(
        model=engine.model_name, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "hi"}],
    )
    content = out.choices[0].logprobs.content if out.choices[0].logprobs else None
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 for t in content)
    stream = client.completions.create(
        model=engine.model_name, prompt="abc", max_tokens=3, temperature=0, logprobs=1,
        stream=True,
    )
    tokens = [t for c in stream for t in (c.choices[0].logprobs.tokens or [])  # type: ignore[union-attr]
              if c.choices and c.choices[0].logprobs]
    assert len(tokens) == 3


def test_streamed_prefix_hit_header_and_disconnect_bills_cached_tokens(
    settings: Settings, db: sessionmaker[Session]
) -> None:
    """A streamed response says ``prefix`` before its usage exists, and a client that
    leaves before the usage item is still billed the cached tokens at the cached price."""
    engine = build_engine(EngineConfig.tiny(max_model_len=1024, num_kv_blocks=160))
    tenants = seed(db, model=engine.model_name)
    app = build_app(settings, db, upstreams=[InProcessUpstream(engine)],
                    models=[engine.model_name], tokenizer=engine.tokenizer(),
                    context_len=engine.max_model_len)
    body = {"model": engine.model_name, "max_tokens": 700, "ignore_eos": True, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {tenants.key_a}"}
    try:
        with LiveServer(app) as server:
            _ask(_client(server, tenants.key_a), engine.model_name)
            [first] = settled_rows(db, 1)
            with httpx.Client(timeout=60) as client, client.stream(
                "POST", server.url + "/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.headers.get("x-kvtoll-cache") == "prefix", response.read()
                for line in response.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        break  # leave before the usage item
            _, row = settled_rows(db, 2)
    finally:
        engine.shutdown()
    assert row.status is RequestStatus.CLIENT_DISCONNECT
    assert row.prompt_tokens == first.prompt_tokens and 0 < row.completion_tokens < 700
    assert row.cached_tokens > 0 and row.cached_tokens % engine.block_size == 0
    expected = (
        (row.prompt_tokens - row.cached_tokens) * PRICE_PICO["input"]
        + row.cached_tokens * PRICE_PICO["cached"]
        + row.completion_tokens * PRICE_PICO["output"]
    )
    assert row.billed_pico == expected
