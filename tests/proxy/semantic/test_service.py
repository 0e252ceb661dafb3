"""SemanticCache end to end with the real embedding model and the shipped verifier."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import InMemoryStore, StoreConfig
from proxy.semantic.verifier import LogisticVerifier
from tests.proxy.semantic.semantic_helpers import Renamed, answer, chat

pytestmark = pytest.mark.anyio

MakeCache = Callable[..., SemanticCache]


async def test_tenant_isolation_both_halves(make_cache: MakeCache) -> None:
    cache = make_cache()
    stored = await cache.store(
        "tenant-a", chat("How do I reset my password?"), answer("A's answer")
    )
    assert stored is not None
    hit = await cache.lookup("tenant-a", chat("How can I reset my password?"))
    assert hit is not None and hit.entry.entry_id == stored
    assert hit.entry.answer["choices"][0]["message"]["content"] == "A's answer"
    assert await cache.lookup("tenant-b", chat("How do I reset my password?")) is None
    assert await cache.lookup("tenant-b", chat("How can I reset my password?")) is None
    assert cache.stats.hits == 1 and cache.stats.misses == 2


async def test_same_follow_up_in_two_conversations_never_hits(make_cache: MakeCache) -> None:
    cache = make_cache()
    rust = (
        {"role": "user", "content": "What is Rust?"},
        {"role": "assistant", "content": "A language."},
    )
    python = (
        {"role": "user", "content": "What is Python?"},
        {"role": "assistant", "content": "A language."},
    )
    assert await cache.store("t", chat("tell me more", *rust), answer("More on Rust")) is not None
    assert await cache.lookup("t", chat("tell me more", *python)) is None
    hit = await cache.lookup("t", chat("tell me more", *rust))
    assert (
        hit is not None and hit.entry.answer["choices"][0]["message"]["content"] == "More on Rust"
    )


async def test_verifier_rejection_is_counted(make_cache: MakeCache) -> None:
    cache = make_cache()
    await cache.store("t", chat("How do I enable dark mode on Windows?"), answer("enable it"))
    result = await cache.lookup_detailed("t", chat("How do I disable dark mode on Windows?"))
    assert result.hit is None and result.reason == "rejected"
    assert cache.stats.rejections == 1
    assert result.timing.embed_ms > 0 and result.timing.verify_ms >= 0


async def test_only_complete_answers_are_stored(make_cache: MakeCache) -> None:
    cache = make_cache()
    assert await cache.store("t", chat("Write a poem"), answer("Roses", "length")) is None
    call = {"id": "c", "type": "function"}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    tool_answer = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}]}
    assert await cache.store("t", chat("Weather in Paris?"), tool_answer) is None
    assert await cache.store("t", chat("Weather in Paris?"), tool_answer, allow_tool_calls=True)
    assert cache.num_mirrored("t") == 1 and cache.stats.store_skipped == 2


async def test_sampled_requests_need_the_tenant_opt_in(make_cache: MakeCache) -> None:
    cache = make_cache()
    body = chat("What is the capital of France?", temperature=0.8)
    assert await cache.store("t", body, answer("Paris")) is None
    assert await cache.store("t", body, answer("Paris"), allow_sampled=True) is not None
    assert await cache.lookup("t", body) is None
    assert cache.stats.bypassed == 1
    assert await cache.lookup("t", body, allow_sampled=True) is not None


async def test_delete_feedback_and_flush(make_cache: MakeCache) -> None:
    cache = make_cache()
    q1, q2 = chat("What is the capital of France?"), chat("How many legs does a spider have?")
    e1 = await cache.store("t", q1, answer("Paris"))
    e2 = await cache.store("t", q2, answer("Eight"))
    assert e1 and e2
    assert await cache.delete("other-tenant", e1) is False
    assert await cache.lookup("t", q1, request_id="req-1") is not None
    assert await cache.invalidate("t", request_id="req-1") == e1
    assert await cache.lookup("t", q1) is None
    assert await cache.flush("t") == 1
    assert await cache.lookup("t", q2) is None and cache.num_mirrored() == 0


async def test_ttl_expired_entries_miss_and_leave_the_mirror(
    make_cache: MakeCache, embedder: object, verifier: object
) -> None:
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    store = InMemoryStore(StoreConfig(ttl_s=60), clock)
    cache = SemanticCache(embedder, store, verifier, SemanticConfig(ttl_s=60), clock=clock)  # type: ignore[arg-type]
    await cache.store("t", chat("What is the capital of France?"), answer("Paris"))
    assert await cache.lookup("t", chat("What is the capital of France?")) is not None
    now[0] += 61
    assert await cache.lookup("t", chat("What is the capital of France?")) is None
    assert cache.num_mirrored() == 0


async def test_capacity_eviction_reaches_the_mirror(embedder: object, verifier: object) -> None:
    store = InMemoryStore(StoreConfig(capacity_per_tenant=2))
    cache = SemanticCache(embedder, store, verifier)  # type: ignore[arg-type]
    for q in (
        "What is the capital of France?",
        "How many legs does a spider have?",
        "Who wrote Hamlet?",
    ):
        await cache.store("t", chat(q), answer(q))
    assert cache.num_mirrored("t") == 2 and cache.stats.evictions == 1
    assert await cache.lookup("t", chat("What is the capital of France?")) is None


async def test_storing_the_same_prompt_twice_keeps_one_entry(make_cache: MakeCache) -> None:
    cache = make_cache()
    first = await cache.store("t", chat("Who wrote Hamlet?"), answer("Shakespeare"))
    assert await cache.store("t", chat("Who wrote Hamlet?"), answer("Shakespeare")) == first
    assert cache.num_mirrored() == 1


async def test_concurrent_lookups_are_micro_batched(make_cache: MakeCache) -> None:
    import asyncio

    cache = make_cache()
    await cache.store("t", chat("Who wrote Hamlet?"), answer("Shakespeare"))
    texts = [f"Who wrote Hamlet? ({i})" for i in range(8)]
    results = await asyncio.gather(*(cache.lookup_detailed("t", chat(t)) for t in texts))
    assert len(results) == 8
    assert cache._batcher.num_batches < 8 and cache._batcher.num_texts >= 9


async def test_background_follower_does_not_starve_the_event_loop(make_cache: MakeCache) -> None:
    import asyncio

    cache = make_cache(sync_block_ms=50)
    await cache.start()
    try:
        ticks = 0
        for _ in range(5):
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 5
        assert await cache.store("t", chat("Who wrote Hamlet?"), answer("Shakespeare"))
    finally:
        await cache.aclose()


class BrokenEmbedder:
    """A stand-in model that always fails (the cache's fail-open path is under test)."""

    dim = 384
    name = "broken"

    def embed(self, texts: object) -> object:
        raise RuntimeError("model crashed")


async def test_a_failing_embedder_is_a_miss_and_stores_nothing(
    verifier: LogisticVerifier,
) -> None:
    cache = SemanticCache(BrokenEmbedder(), InMemoryStore(), verifier, SemanticConfig())
    assert await cache.store("t", chat("How do I reset my password?"), answer("x")) is None
    result = await cache.lookup_detailed("t", chat("How do I reset my password?"))
    assert result.hit is None and result.reason == "embed_error"
    assert cache.stats.embed_errors == 2


class _ThreadRecordingVerifier:
    """The shipped logistic verifier, noting which thread scored (``runs_model`` as given)."""

    def __init__(self, inner: LogisticVerifier, runs_model: bool) -> None:
        self.inner = inner
        self.runs_model = runs_model
        self.threads: list[str] = []
        self.default_threshold = inner.default_threshold
        self.min_similarity = inner.min_similarity

    def score(self, query: str, prompt: str, similarity: float) -> float:
        return self.score_many(query, [(prompt, similarity)])[0]

    def score_many(self, query: str, candidates: list[tuple[str, float]]) -> list[float]:
        import threading

        self.threads.append(threading.current_thread().name)
        return self.inner.score_many(query, candidates)


@pytest.mark.parametrize("runs_model", [True, False])
async def test_a_model_verifier_runs_on_the_embedders_workers(
    embedder: object, verifier: LogisticVerifier, runs_model: bool
) -> None:
    """Issue 23: the second stage must not block the event loop (a model's forward pass
    does); a verifier without a model stays inline (no thread hop)."""
    import threading

    recording = _ThreadRecordingVerifier(verifier, runs_model)
    cache = SemanticCache(embedder, InMemoryStore(), recording, SemanticConfig())  # type: ignore[arg-type]
    await cache.store("t", chat("How do I reset my password?"), answer("reset it"))
    hit = await cache.lookup("t", chat("How can I reset my password?"))
    assert hit is not None and len(recording.threads) == 1
    if runs_model:
        assert recording.threads[0].startswith("kvtoll-embed")
    else:
        assert recording.threads[0] == threading.current_thread().name


async def test_entries_of_another_embedder_are_never_mirrored(embedder: object,
                                                              verifier: LogisticVerifier) -> None:
    """Vectors of two models never meet in one index: a cache mirrors only the entries
    its own embedder wrote (the entry records the embedder's name), on load and live."""
    from proxy.semantic.store import ChangeEvent

    store = InMemoryStore()
    old = SemanticCache(Renamed(embedder, "old-model/int8-row"), store, verifier)
    stored = await old.store("t", chat("Who wrote Hamlet?"), answer("Shakespeare"))
    entry = await store.get("t", stored)  # type: ignore[arg-type]
    assert entry is not None and entry.embedder == "old-model/int8-row"
    new = SemanticCache(embedder, store, verifier)  # type: ignore[arg-type]
    assert await new.load() == 0 and new.stats.other_embedder == 1
    assert await new.lookup("t", chat("Who wrote Hamlet?")) is None
    new.apply(ChangeEvent("put", "t", entry.entry_id, entry.partition, entry.prompt,
                          entry.vector, entry.embedder))  # fmt: skip
    assert new.num_mirrored() == 0 and new.stats.other_embedder == 2
    # The same entry written by this cache's own embedder is mirrored and served.
    assert await new.store("t", chat("Who wrote Hamlet?"), answer("Shakespeare")) != stored
    assert await new.lookup("t", chat("Who wrote Hamlet?")) is not None
    await old.aclose()
    await new.aclose()
