"""The shared tier on the real Redis: a worker loads a prefix another worker computed,
no tenant loads another tenant's block (not even a copy under its own key), and a
store that is down or blackholed costs at most its timeout, then recompute."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
import redis

from engine.api import GenerationRequest
from engine.async_engine import AsyncEngine
from engine.factory import LoadedModel
from engine.kv.tier.codec import BlockKey
from engine.kv.tier.config import TierConfig
from engine.llm_engine import LLMEngine
from kvtoll.openai.responses import TierCachedTokens
from tests.engine.kv.tier.test_tier_engine import (
    GREEDY,
    PROMPT_A,
    SALT_A,
    SALT_B,
    _engine,
    _last,
    _run,
)
from tests.proxy.tcp_proxy import TcpProxy

pytestmark = pytest.mark.redis


def _shared(url: str, prefix: str, timeout_s: float = 0.25) -> TierConfig:
    return TierConfig(
        host_bytes=1 << 20,
        shared="redis",
        redis_url=url,
        redis_prefix=prefix.rstrip(":"),
        timeout_s=timeout_s,
        backoff_s=30.0,
    )


def _prefetch(engine: LLMEngine, salt: bytes | None, prompt: list[int]) -> int:
    tier = engine.tier
    assert tier is not None
    return tier.prefetch(salt, prompt, engine.kv.pool.cached.__contains__)  # type: ignore[arg-type]


def test_worker_b_loads_the_prefix_worker_a_computed(
    tiny_model: LoadedModel, redis_url: str, redis_prefix: str
) -> None:
    a = _engine(tiny_model, _shared(redis_url, redis_prefix), blocks=32)
    b = _engine(tiny_model, _shared(redis_url, redis_prefix), blocks=32)
    expected, _ = _run(a, "a", PROMPT_A, SALT_A)  # written through to Redis
    assert _prefetch(b, SALT_A, PROMPT_A) == 6
    tokens, last = _last(b, "b", PROMPT_A, SALT_A)
    assert (tokens, last.cached_tokens) == (expected, 96)
    assert last.tier_cached_tokens == TierCachedTokens(host=0, shared=96)  # all from Redis


def test_no_tenant_loads_a_block_another_tenants_salt_made(
    tiny_model: LoadedModel, redis_url: str, redis_prefix: str
) -> None:
    a = _engine(tiny_model, _shared(redis_url, redis_prefix), blocks=32)
    b = _engine(tiny_model, _shared(redis_url, redis_prefix), blocks=32)
    _run(a, "a", PROMPT_A, SALT_A)
    assert _prefetch(b, SALT_B, PROMPT_A) == 0  # tenant B's keys: nothing there
    # A hostile copy: tenant A's values stored under tenant B's keys for the same tokens.
    tier_b = b.tier
    assert tier_b is not None
    client = redis.Redis.from_url(redis_url)
    try:
        prefix = redis_prefix.rstrip(":")
        keys_a = sorted(k for k in client.scan_iter(match=f"{prefix}:*:{SALT_A.hex()}:*"))
        assert len(keys_a) == 6
        from engine.kv.hashing import hash_prompt_blocks

        for i, h in enumerate(hash_prompt_blocks(PROMPT_A, 16, SALT_B)[:6]):
            value_a = client.get(
                BlockKey(tier_b.model, SALT_A, hash_prompt_blocks(PROMPT_A, 16, SALT_A)[i])
                .redis_key(prefix)
            )  # fmt: skip
            assert value_a is not None
            client.set(BlockKey(tier_b.model, SALT_B, h).redis_key(prefix), value_a)
    finally:
        client.close()
    assert _prefetch(b, SALT_B, PROMPT_A) == 0  # refused by the key digest
    assert tier_b.host.stats.corrupt == 1
    assert _run(b, "x", PROMPT_A, SALT_B)[1] == 0 and tier_b.num_loaded_blocks == 0


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A port that accepts connections (kernel backlog) and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


def test_a_blackholed_store_costs_one_timeout_then_recompute(
    tiny_model: LoadedModel, blackhole: int
) -> None:
    url = f"redis://127.0.0.1:{blackhole}/0"
    engine = AsyncEngine(_engine(tiny_model, _shared(url, "kvtoll-test:bh", timeout_s=0.3)))
    plain = _engine(tiny_model, None)
    expected, _ = _run(plain, "p", PROMPT_A, SALT_A)

    async def ask(rid: str) -> tuple[list[int], float]:
        t0 = time.monotonic()
        request = GenerationRequest(rid, tuple(PROMPT_A), GREEDY, SALT_A)
        out = [c async for c in engine.generate(request)]
        return [t for c in out for t in c.token_ids], time.monotonic() - t0

    try:
        first, _ = asyncio.run(ask("r1"))
        assert first == expected
        tier = engine.engine.tier
        assert tier is not None and tier.shared is not None
        assert tier.shared.stats.errors >= 1  # it timed out once ...
        errors = tier.shared.stats.errors
        second, _ = asyncio.run(ask("r2"))
        assert second == expected
        # ... then is skipped while it backs off
        assert tier.shared.stats.errors == errors and tier.shared.stats.skipped >= 1
    finally:
        engine.shutdown()


def test_a_store_that_goes_down_means_recompute(
    tiny_model: LoadedModel, redis_url: str, redis_prefix: str
) -> None:
    host, port = redis_url.split("//")[1].split("/")[0].rsplit(":", 1)
    proxy = TcpProxy(host, int(port))
    proxy.start()
    url = f"redis://127.0.0.1:{proxy.port}/{redis_url.rsplit('/', 1)[-1] or '0'}"
    a = _engine(tiny_model, _shared(url, redis_prefix), blocks=32)
    b = _engine(tiny_model, _shared(url, redis_prefix), blocks=32)
    expected, _ = _run(a, "a", PROMPT_A, SALT_A)
    proxy.stop()
    assert _prefetch(b, SALT_A, PROMPT_A) == 0
    assert _run(b, "b", PROMPT_A, SALT_A) == (expected, 0)
