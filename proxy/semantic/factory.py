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

from proxy.semantic.embedder import Embedder, EmbedderSpec, SentenceTransformerEmbedder
from proxy.semantic.index import FaissIndex, IndexConfig
from proxy.semantic.redis_store import DEFAULT_PREFIX, RedisStore
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import EntryStore, InMemoryStore, StoreConfig
from proxy.semantic.verifier import (
    LogisticVerifier,
    Verifier,
    check_pairing,
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


def build_embedder(choice: VerifierChoice, spec: EmbedderSpec | None = None) -> Embedder:
    """The embedder ``choice``'s verifier was fitted on: the pair encoder for its own
    verifier (its cosine is the verifier's main feature, so one forward per lookup
    serves both the index and the verifier), base all-MiniLM-L6-v2 (``spec``) for the
    cross-encoder and the logistic verifier, whose floors and weights read its cosine."""
    if choice == "pair-encoder":
        if spec is not None:
            raise ValueError("an EmbedderSpec configures the base MiniLM embedder only")
        from proxy.semantic.pair_encoder import load_pair_encoder

        return load_pair_encoder()
    return SentenceTransformerEmbedder(spec)


def build_verifier(choice: VerifierChoice = "pair-encoder", embedder: Embedder | None = None
                   ) -> Verifier:  # fmt: skip
    """The shipped verifier named ``choice``: the pair encoder's (guard features stacked
    on the tuned cosine the index hands over; ``embedder``: the loaded pair encoder, to
    read its config without loading the weights again), the cross-encoder (reads both
    texts together) or the logistic one (features only, cheapest)."""
    if choice == "pair-encoder":
        from proxy.semantic.pair_encoder import PairEncoder
        from proxy.semantic.pair_verifier import PairEncoderVerifier, load_pair_encoder_verifier

        if isinstance(embedder, PairEncoder):
            return PairEncoderVerifier(embedder.config, embedder.name)
        return load_pair_encoder_verifier()
    if choice == "cross-encoder":
        return load_cross_encoder_verifier()
    if choice == "logistic":
        return LogisticVerifier(load_weights())
    raise ValueError(f"unknown verifier {choice!r}; choose one of {', '.join(VERIFIER_CHOICES)}")


def build_pair(choice: VerifierChoice, spec: EmbedderSpec | None = None
               ) -> tuple[Embedder, Verifier]:  # fmt: skip
    """The embedder and the verifier of ``choice``, checked to belong together."""
    embedder = build_embedder(choice, spec)
    verifier = build_verifier(choice, embedder)
    check_pairing(embedder.name, verifier)
    return embedder, verifier


def build_store(
    redis_url: str | None, config: StoreConfig | None = None, *, redis_prefix: str = DEFAULT_PREFIX
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
    redis_prefix: str = DEFAULT_PREFIX,
    verifier: VerifierChoice | None = None,
) -> SemanticCache:
    """The full service: the ``verifier``'s embedder (:func:`build_embedder`), FAISS per
    partition, the shipped ``verifier``.

    Sets FAISS's OpenMP pool to one thread (process-wide): lookups search one vector
    at a time, where extra threads only add contention with the rest of the proxy."""
    import faiss

    faiss.omp_set_num_threads(1)
    config = config or SemanticConfig()
    store_config = store_config or StoreConfig(ttl_s=config.ttl_s)
    embedder, chosen = build_pair(verifier or default_verifier(), embedder_spec)
    index_cfg = index_config or IndexConfig()
    return SemanticCache(
        embedder=embedder,
        store=build_store(redis_url, store_config, redis_prefix=redis_prefix),
        verifier=chosen,
        config=config,
        index_factory=lambda dim: FaissIndex(dim, index_cfg),
    )
