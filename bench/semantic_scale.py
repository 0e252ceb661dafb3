"""Semantic-cache lookup latency at 100,000 entries in one tenant partition.

Entries are synthetic questions from templates (distinct, random-ish), embedded with
the real model and stored through the service; queries are 50/50 reworded stored
questions and unseen ones, looked up one at a time through the real service
(embed + HNSW search + verify; ``--verifier``: the default one, with its own embedder). Goal:
p99 of the three <= 15 ms.

Peer in the same run: an exact ``IndexFlatIP`` over the same vectors (GPTCache's
default FAISS index) - its search latency and HNSW's recall@1 against it.

Usage: .venv/bin/python bench/semantic_scale.py [--entries 100000] [--queries 400]
       [--vectors-cache /tmp/scale.npy]     (prints one JSON object)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: bench/kernels.py must not
    import sys  # shadow the ``kernels`` package transformers probes for: the repo root instead

    sys.path[0] = str(Path(__file__).resolve().parents[1])

from proxy.semantic.embedder import Embedder, embed_many
from proxy.semantic.index import FaissIndex, IndexConfig
from proxy.semantic.keys import CacheKey
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.store import InMemoryStore, StoreConfig

OPENERS = ["How do I", "What is the best way to", "Can I", "Why should I", "When should I",
           "Is it safe to", "How long does it take to", "What does it cost to"]  # fmt: skip
VERBS = ["repair", "clean", "install", "replace", "paint", "sell", "buy", "rent", "insure",
         "ship", "store", "heat", "cool", "move", "upgrade", "test", "measure",
         "recycle"]  # fmt: skip
OBJECTS = ["a bicycle", "a laptop", "an old piano", "a kitchen sink", "a car battery",
           "a wooden fence", "a garden shed", "a gas boiler", "a smartphone", "a roof",
           "a bathtub", "a washing machine", "solar panels", "a fish tank", "a sofa",
           "hardwood floors", "a water heater", "a motorcycle", "a printer", "a tent"]  # fmt: skip
PLACES = ["in Berlin", "in Texas", "in a small flat", "in winter", "on a budget", "at home",
          "without tools", "in Tokyo", "near the coast", "in the rain", "for a school",
          "in Ontario", "in an office", "in a hurry", "for a restaurant", "in Kenya"]  # fmt: skip
REWORD = [("How do I", "How can I"), ("What is the best way to", "What's the best way to"),
          ("Can I", "Is it possible to"), ("Is it safe to", "Is it dangerous to")]  # fmt: skip


def synthetic_questions(n: int, seed: int = 7) -> list[str]:
    """``n`` distinct questions: template product, then numbered variants."""
    rng = random.Random(seed)
    base = [
        f"{o} {v} {obj} {p}?" for o in OPENERS for v in VERBS for obj in OBJECTS for p in PLACES
    ]
    rng.shuffle(base)
    out = base[:n]
    years = iter(range(1950, 10**6))
    while len(out) < n:
        out.append(base[len(out) % len(base)].rstrip("?") + f" in {next(years)}?")
    return out


def embed_entries(
    embedder: Embedder, texts: list[str], num_real: int
) -> np.ndarray:
    """Real embeddings for the first ``num_real`` texts; the rest (when the CPU is too
    busy to embed 100k texts) are mixtures of two real ones plus noise, normalised:
    vectors with the same neighbourhood structure, which is what search cost depends on."""
    num_real = min(num_real, len(texts))
    real = embed_many(embedder, texts[:num_real], batch_size=128)
    if num_real == len(texts):
        return real
    rng = np.random.default_rng(5)
    n = len(texts) - num_real
    i, j = rng.integers(0, num_real, n), rng.integers(0, num_real, n)
    w = rng.uniform(0.55, 0.9, (n, 1)).astype(np.float32)
    mixed = (
        w * real[i] + (1 - w) * real[j] + rng.normal(0, 0.02, (n, real.shape[1])).astype(np.float32)
    )
    mixed /= np.linalg.norm(mixed, axis=1, keepdims=True)
    return np.vstack([real, mixed.astype(np.float32)])


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def pct(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    p50, p99 = np.percentile(arr, 50), np.percentile(arr, 99)
    return {
        "p50": round(float(p50), 3),
        "p99": round(float(p99), 3),
        "max": round(float(arr.max()), 3),
    }


def body(text: str) -> dict[str, Any]:
    return {"model": "bench", "temperature": 0, "messages": [{"role": "user", "content": text}]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import faiss

    faiss.omp_set_num_threads(1)  # single-query searches: OpenMP only adds contention
    from proxy.semantic.factory import build_pair, default_verifier

    embedder, verifier = build_pair(args.verifier or default_verifier())
    texts = synthetic_questions(args.entries)
    started = time.perf_counter()
    cache_path = args.vectors_cache and Path(args.vectors_cache)
    if cache_path:  # one file per embedder: another model's vectors are never reused
        cache_path = cache_path.with_name(f"{cache_path.stem}-{_slug(embedder.name)}.npy")
    if cache_path and cache_path.exists():
        vectors = np.load(cache_path)
    else:
        vectors = embed_entries(embedder, texts, args.embed_entries)
        if cache_path:
            np.save(cache_path, vectors)
    embed_s = time.perf_counter() - started
    store = InMemoryStore(StoreConfig(capacity_per_tenant=args.entries + 10))
    cfg = IndexConfig()
    cache = SemanticCache(embedder, store, verifier, SemanticConfig(),
                          index_factory=lambda dim: FaissIndex(dim, cfg))  # fmt: skip
    started = time.perf_counter()
    for text, vector in zip(texts, vectors, strict=True):
        key = cache.key_for("scale", body(text))
        assert isinstance(key, CacheKey)
        await cache.store_embedded(key, {"choices": [{"finish_reason": "stop"}]}, vector)
    fill_s = time.perf_counter() - started

    import torch

    torch.set_num_threads(args.torch_threads)  # one short text per lookup: no intra-op gain
    rng = random.Random(11)
    queries: list[str] = []
    for i in range(args.queries):
        if i % 2 == 0:
            text = texts[rng.randrange(min(len(texts), args.embed_entries))]  # real vectors
            for old, new in REWORD:
                text = text.replace(old, new)
            queries.append(text)
        else:
            v, o, p = rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES)
            queries.append(f"Where can I learn to {v} {o} {p} quickly?")
    for q in queries[:20]:  # warm-up (thread pool, allocator)
        await cache.lookup_detailed("scale", body(q))
    results = [await cache.lookup_detailed("scale", body(q)) for q in queries]

    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    qvec = embed_many(embedder, queries)
    flat_ms: list[float] = []
    agree = 0
    key0 = cache.key_for("scale", body(texts[0]))
    assert isinstance(key0, CacheKey)
    partition = cache.mirror.index("scale", key0.partition)
    assert partition is not None
    for row in qvec:
        t0 = time.perf_counter()
        _, ids = flat.search(row.reshape(1, -1), 1)
        flat_ms.append((time.perf_counter() - t0) * 1e3)
        hnsw_best = cache.mirror.search("scale", key0.partition, row, 1)
        agree += int(bool(hnsw_best) and hnsw_best[0][0].prompt == texts[int(ids[0][0])])
    await cache.aclose()
    timings = [r.timing for r in results]
    return {
        "entries": args.entries,
        "entries_embedded_for_real": min(args.embed_entries, args.entries),
        "queries": len(queries),
        "index": "HNSW" if getattr(partition, "is_hnsw", False) else "flat",
        "hnsw": {
            "M": cfg.hnsw_m,
            "ef_construction": cfg.ef_construction,
            "ef_search": cfg.ef_search,
        },
        "verifier": args.verifier or default_verifier(),
        "embedder": embedder.name,
        "hits": sum(1 for r in results if r.hit is not None),
        "lookup_ms": {
            "embed": pct([t.embed_ms for t in timings]),
            "search": pct([t.search_ms for t in timings]),
            "verify": pct([t.verify_ms for t in timings]),
            "total": pct([t.total_ms for t in timings]),
        },
        "goal_total_p99_ms": 15.0,
        "peer_flat_exact_search_ms": pct(flat_ms),
        "hnsw_recall_at_1_vs_flat": round(agree / len(queries), 4),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "setup_s": {"embed_entries": round(embed_s, 1), "fill": round(fill_s, 1)},
    }


def main() -> None:
    from proxy.semantic.factory import VERIFIER_CHOICES

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--vectors-cache", default=None)
    parser.add_argument("--embed-entries", type=int, default=10**9,
                        help="embed only this many entries for real, derive the rest")  # fmt: skip
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--verifier", choices=VERIFIER_CHOICES, default=None,
                        help="default: proxy.semantic.factory.default_verifier()")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
