"""Two SemanticCache replicas sharing entries through the real Redis; fail-open."""

from __future__ import annotations

import socket

import pytest

from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.keys import CacheKey
from proxy.semantic.redis_store import RedisStore
from proxy.semantic.service import SemanticCache
from proxy.semantic.store import ChangeEvent, EntryId
from proxy.semantic.verifier import LogisticVerifier
from tests.proxy.semantic.semantic_helpers import Renamed, answer, chat

pytestmark = pytest.mark.anyio


def replica(
    url: str, prefix: str, embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> SemanticCache:
    return SemanticCache(embedder, RedisStore(url, prefix=prefix), verifier)


async def test_replicas_serve_each_others_entries(
    redis_url: str,
    redis_prefix: str,
    embedder: SentenceTransformerEmbedder,
    verifier: LogisticVerifier,
) -> None:
    a = replica(redis_url, redis_prefix, embedder, verifier)
    b = replica(redis_url, redis_prefix, embedder, verifier)
    try:
        await a.load()
        await b.load()
        stored = await a.store("t1", chat("How do I reset my password?"), answer("Click 'forgot'"))
        assert stored is not None
        assert await b.sync() == 1
        hit = await b.lookup("t1", chat("How can I reset my password?"))
        assert hit is not None and hit.entry.entry_id == stored
        assert hit.entry.answer["choices"][0]["message"]["content"] == "Click 'forgot'"
        assert hit.entry.hit_count == 1
        assert await b.lookup("t2", chat("How do I reset my password?")) is None
        # A restarted replica rebuilds its index from Redis.
        c = replica(redis_url, redis_prefix, embedder, verifier)
        assert await c.load() == 1
        assert await c.lookup("t1", chat("How do I reset my password?")) is not None
        await c.aclose()
        # A delete on one replica reaches the other's mirror.
        assert await b.delete("t1", stored)
        await a.sync()
        assert a.num_mirrored() == 0
        assert await a.lookup("t1", chat("How do I reset my password?")) is None
        # So does a flush.
        await b.store("t1", chat("Who wrote Hamlet?"), answer("Shakespeare"))
        await a.sync()
        assert a.num_mirrored("t1") == 1
        assert await a.flush("t1") == 1
        await b.sync()
        assert b.num_mirrored() == 0
    finally:
        await a.aclose()
        await b.aclose()


async def test_background_follow_applies_remote_changes(
    redis_url: str,
    redis_prefix: str,
    embedder: SentenceTransformerEmbedder,
    verifier: LogisticVerifier,
) -> None:
    import asyncio

    a = replica(redis_url, redis_prefix, embedder, verifier)
    b = replica(redis_url, redis_prefix, embedder, verifier)
    try:
        await b.start()
        await a.store("t1", chat("Who wrote Hamlet?"), answer("Shakespeare"))
        for _ in range(100):
            if b.num_mirrored() == 1:
                break
            await asyncio.sleep(0.05)
        assert b.num_mirrored() == 1
    finally:
        await a.aclose()
        await b.aclose()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_redis_fails_open_as_a_miss(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> None:
    cache = replica(f"redis://127.0.0.1:{closed_port()}/0", "x:", embedder, verifier)
    try:
        assert await cache.store("t", chat("Who wrote Hamlet?"), answer("Shakespeare")) is None
        assert await cache.lookup("t", chat("Who wrote Hamlet?")) is None
        assert cache.stats.store_errors == 1 and cache.stats.stored == 0
        # With an entry mirrored locally, the store outage still reads as a miss.
        key = cache.key_for("t", chat("Who wrote Hamlet?"))
        assert isinstance(key, CacheKey)
        vector = embedder.embed([key.query])[0]
        cache.apply(ChangeEvent("put", "t", EntryId("sem_x"), key.partition, key.query, vector,
                                embedder.name))
        result = await cache.lookup_detailed("t", chat("Who wrote Hamlet?"))
        assert result.hit is None and result.reason == "store_error"
        assert cache.stats.store_errors == 2
    finally:
        await cache.aclose()


async def test_a_replica_of_another_embedder_ignores_the_entries(
    redis_url: str,
    redis_prefix: str,
    embedder: SentenceTransformerEmbedder,
    verifier: LogisticVerifier,
) -> None:
    """The entry's hash and its feed event name the embedder that wrote the vector; a
    replica running another one mirrors neither (on load nor from the feed)."""
    import redis.asyncio as aioredis

    a = replica(redis_url, redis_prefix, embedder, verifier)
    other = SemanticCache(Renamed(embedder, "other-model/int8-row"),
                          RedisStore(redis_url, prefix=redis_prefix), verifier)  # fmt: skip
    client = aioredis.from_url(redis_url)
    try:
        await other.load()
        stored = await a.store("t1", chat("Who wrote Hamlet?"), answer("Shakespeare"))
        assert stored is not None
        raw = await client.hget(f"{redis_prefix}e:t1:{stored}", "emb")
        assert raw is not None and raw.decode() == embedder.name
        assert await other.sync() == 1  # the event arrives, and is skipped
        assert other.num_mirrored() == 0 and other.stats.other_embedder == 1
        assert await other.lookup("t1", chat("Who wrote Hamlet?")) is None
        restarted = replica(redis_url, redis_prefix, embedder, verifier)
        assert await restarted.load() == 1  # the writer's own model mirrors it again
        await restarted.aclose()
        again = SemanticCache(Renamed(embedder, "other-model/int8-row"),
                              RedisStore(redis_url, prefix=redis_prefix), verifier)  # fmt: skip
        assert await again.load() == 0 and again.stats.other_embedder == 1
        await again.aclose()
    finally:
        await client.aclose()
        await a.aclose()
        await other.aclose()
