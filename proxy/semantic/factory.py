"""Build the semantic cache from plain settings (call once, at app start-up).

Loading the embedding model takes seconds, so this is never called at import time.
Usage in the app factory::

    cache = build_semantic_cache(settings.redis_url)
    await cache.start()      # rebuild the FAISS mirror, follow other replicas
    ...
    await cache.aclose()
"""

from __future__ import annotations

from proxy.semantic.embedder import EmbedderSpec, SentenceTransformerEmbedder
from proxy.semantic.index import FaissIndex, IndexConfig
from proxy.semantic.redis_store import RedisStore
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import EntryStore, InMemoryStore, StoreConfig
from proxy.semantic.verifier import LogisticVerifier, load_weights


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
) -> SemanticCache:
    """The full service: MiniLM embedder, FAISS per partition, shipped verifier weights.

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
        verifier=LogisticVerifier(load_weights()),
        config=config,
        index_factory=lambda dim: FaissIndex(dim, index_cfg),
    )
