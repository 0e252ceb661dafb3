"""Shared fixtures: one real embedding model per test session, small caches around it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import EntryStore, InMemoryStore
from proxy.semantic.verifier import LogisticVerifier, load_weights


@pytest.fixture(scope="session")
def embedder() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder()


@pytest.fixture(scope="session")
def verifier() -> LogisticVerifier:
    return LogisticVerifier(load_weights())


@pytest.fixture
def make_cache(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier
) -> Callable[..., SemanticCache]:
    def make(store: EntryStore | None = None, **config: object) -> SemanticCache:
        return SemanticCache(
            embedder,
            store or InMemoryStore(),
            verifier,
            SemanticConfig(**config),  # type: ignore[arg-type]
        )

    return make


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
