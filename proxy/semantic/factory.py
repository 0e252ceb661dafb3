"""Build the semantic cache from plain settings (call once, at app start-up).

Loading the embedding model takes seconds, so this is never called at import time.
Usage in the app factory::

    cache = build_semantic_cache(settings.redis_url)
    await cache.start()      # rebuild the FAISS mirror, follow other replicas
    ...
    await cache.aclose()
"""

from __future__ import annotations

from typing import Literal

from proxy.semantic.embedder import EmbedderSpec, SentenceTransformerEmbedder
from proxy.semantic.index import FaissIndex, IndexConfig
from proxy.semantic.redis_store import RedisStore
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import EntryStore, InMemoryStore, StoreConfig
from proxy.semantic.verifier import (
    LogisticVerifier,
    Verifier,
    load_cross_encoder_verifier,
    load_weights,
)

VerifierChoice = Literal["pair-encoder", "cross-encoder", "logistic"]
VERIFIER_CHOICES: tuple[VerifierChoice, ...] = ("pair-encoder", "cross-encoder", "logistic")


def default_verifier() -> VerifierChoice:
    """The verifier a cache gets when none is named: the pair encoder where its weights
    ship (MiniLM fine-tuned on duplicate questions, guard features stacked on its
    cosine; it beat both others on the clean QQP calib and held-out splits, issue 23's
    note), else the logistic one. The cross-encoder stays selectable."""
    from proxy.semantic.pair_encoder import is_shipped

    return "pair-encoder" if is_shipped() else "logistic"


def build_verifier(choice: VerifierChoice = "pair-encoder") -> Verifier:
    """The shipped verifier named ``choice``: the pair encoder (a fine-tuned second
    encoder re-scores the index's candidates), the cross-encoder (reads both texts
    together) or the logistic one (features only, cheapest)."""
    if choice == "pair-encoder":
        from proxy.semantic.pair_verifier import load_pair_encoder_verifier

        return load_pair_encoder_verifier()
    if choice == "cross-encoder":
        return load_cross_encoder_verifier()
    if choice == "logistic":
        return LogisticVerifier(load_weights())
    raise ValueError(f"unknown verifier {choice!r}; choose one of {', '.join(VERIFIER_CHOICES)}")


def build_store(
    redis_url: str | None, config: StoreConfig | None = None, *, redis_prefix: str = "kvtoll:sem:"
) -> EntryStore:
    """Redis when a URL is given (shared by replicas), otherwise in-process."""
    if redis_url:
        return RedisStore(redis_url, config, prefix=redis_prefix)
    return InMemoryStore(config)


def build_semantic_cache(
    redis_url: str | None = None,
    *,
    config: SemanticConfig | None = None,
    store_config: StoreConfig | None = None,
    embedder_spec: EmbedderSpec | None = None,
    index_config: IndexConfig | None = None,
    redis_prefix: str = "kvtoll:sem:",
    verifier: VerifierChoice | None = None,
) -> SemanticCache:
    """The full service: MiniLM embedder, FAISS per partition, the shipped ``verifier``.

    Sets FAISS's OpenMP pool to one thread (process-wide): lookups search one vector
    at a time, where extra threads only add contention with the rest of the proxy."""
    import faiss

    faiss.omp_set_num_threads(1)
    config = config or SemanticConfig()
    store_config = store_config or StoreConfig(ttl_s=config.ttl_s)
    embedder = SentenceTransformerEmbedder(embedder_spec)
    index_cfg = index_config or IndexConfig()
    return SemanticCache(
        embedder=embedder,
        store=build_store(redis_url, store_config, redis_prefix=redis_prefix),
        verifier=build_verifier(verifier or default_verifier()),
        config=config,
        index_factory=lambda dim: FaissIndex(dim, index_cfg),
    )
