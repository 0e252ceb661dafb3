"""Pair benchmark of the semantic cache (``kvtoll bench semantic``).

Every ``text_a`` goes into a fresh cache (one tenant, one partition) as if it had
been answered; every ``text_b`` is then looked up through the real service (real
embedder, FAISS, verifier), one at a time. A hit is correct only if it returns the
entry of its own pair (the entry holding that pair's ``text_a``; identical
``text_a`` strings share one entry) and the pair's label is 1.

Peer in the same run: GPTCache's default policy, a hit when the nearest cached
prompt's cosine similarity is >= 0.8, on the same embeddings without the verifier.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.semantic.pair_metrics import forced_queries, precision_views
from proxy.semantic.embedder import SentenceTransformerEmbedder
from proxy.semantic.keys import CacheKey
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.stats import LookupResult
from proxy.semantic.store import EntryId, InMemoryStore, StoreConfig
from proxy.semantic.verifier import LogisticVerifier, load_weights

GPTCACHE_DEFAULT_THRESHOLD = 0.8
BENCH_TENANT = "bench"


@dataclass(frozen=True)
class Pair:
    text_a: str
    text_b: str
    label: int


def qqp_split(text_a: str, text_b: str) -> str:
    """The verifier's training split of a pair: ``heldout`` (20 %), ``calib`` or ``fit``."""
    h = int(hashlib.sha1(f"{text_a}\t{text_b}".encode()).hexdigest()[:8], 16) % 100
    return "heldout" if h < 20 else ("calib" if h < 32 else "fit")


def read_pairs(path: Path) -> list[Pair]:
    """Rows ``{text_a, text_b, label}``; ValueError names the first bad line."""
    pairs: list[Pair] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected an object")
        a, b, label = row.get("text_a"), row.get("text_b"), row.get("label")
        if not isinstance(a, str) or not isinstance(b, str) or not a.strip() or not b.strip():
            raise ValueError(f"{path}:{number}: text_a and text_b must be non-empty strings")
        if label not in (0, 1) or isinstance(label, bool):
            raise ValueError(f"{path}:{number}: label must be 0 or 1")
        pairs.append(Pair(a, b, int(label)))
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


def _body(text: str) -> dict[str, Any]:
    return {"model": "bench", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def _answer(text: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": f"answer to: {text}"}
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def _pct(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {
        "p50": round(float(np.percentile(arr, 50)), 3),
        "p99": round(float(np.percentile(arr, 99)), 3),
    }


async def _fill(
    cache: SemanticCache, embedder: SentenceTransformerEmbedder, pairs: list[Pair]
) -> dict[EntryId, set[int]]:
    vectors = embedder.embed_batched([p.text_a for p in pairs])
    owners: dict[EntryId, set[int]] = {}
    for i, (pair, vector) in enumerate(zip(pairs, vectors, strict=True)):
        key = cache.key_for(BENCH_TENANT, _body(pair.text_a))
        assert isinstance(key, CacheKey)
        entry_id = await cache.store_embedded(key, _answer(pair.text_a), vector)
        if entry_id is None:
            raise RuntimeError("the in-memory store refused an entry")
        owners.setdefault(entry_id, set()).add(i)
    return owners


def _peer(
    embedder: SentenceTransformerEmbedder, pairs: list[Pair], queries: list[int]
) -> dict[str, Any]:
    """GPTCache-style: nearest text_a by cosine, hit at >= 0.8, no verifier."""
    a = embedder.embed_batched([p.text_a for p in pairs])
    b = embedder.embed_batched([pairs[i].text_b for i in queries])
    texts = [p.text_a for p in pairs]
    hits = correct = 0
    for start in range(0, len(queries), 512):
        sims = b[start : start + 512] @ a.T
        best = sims.argmax(axis=1)
        for row, j in enumerate(best.tolist()):
            i = queries[start + row]
            if sims[row, j] >= GPTCACHE_DEFAULT_THRESHOLD:
                hits += 1
                correct += int(texts[j] == pairs[i].text_a and pairs[i].label == 1)
    positives = sum(pairs[i].label for i in queries)
    return _summary(hits, correct, positives, len(queries)) | {
        "policy": "cosine >= 0.8 on the same embedder, no verifier (GPTCache default)"
    }


def _summary(hits: int, correct: int, positives: int, queries: int) -> dict[str, Any]:
    return {
        "precision": round(correct / hits, 4) if hits else None,
        "recall": round(correct / positives, 4) if positives else None,
        "hit_rate": round(hits / queries, 4),
        "hits": hits,
        "correct_hits": correct,
        "false_hits": hits - correct,
    }


async def run_pair_bench(
    pairs: list[Pair], *, threshold: float | None, heldout_only: bool, candidates: int
) -> dict[str, Any]:
    """Fill, query, and summarise (see the module docstring)."""
    import faiss

    faiss.omp_set_num_threads(1)  # as in the proxy (see factory.build_semantic_cache)
    embedder = SentenceTransformerEmbedder()
    verifier = LogisticVerifier(load_weights())
    store = InMemoryStore(StoreConfig(capacity_per_tenant=max(1, len(pairs))))
    cache = SemanticCache(embedder, store, verifier, SemanticConfig(num_candidates=candidates))
    owners = await _fill(cache, embedder, pairs)
    queries = [
        i
        for i, p in enumerate(pairs)
        if not heldout_only or qqp_split(p.text_a, p.text_b) == "heldout"
    ]
    results: list[LookupResult] = []
    for i in queries:
        results.append(
            await cache.lookup_detailed(BENCH_TENANT, _body(pairs[i].text_b), threshold=threshold)
        )
    await cache.aclose()
    outcomes = [_outcome(pairs[i], i, r, owners) for i, r in zip(queries, results, strict=True)]
    hits = sum(1 for o in outcomes if o != "miss")
    correct = outcomes.count("correct")
    positives = sum(pairs[i].label for i in queries)
    heldout = [
        (o, pairs[i].label) for i, o in zip(queries, outcomes, strict=True)
        if qqp_split(pairs[i].text_a, pairs[i].text_b) == "heldout"
    ]  # fmt: skip
    timings = [r.timing for r in results]
    limit = threshold if threshold is not None else verifier.default_threshold
    return {
        "pairs": len(pairs),
        "queries": len(queries),
        "query_split": "qqp heldout (never trained on)" if heldout_only else "all",
        "positives": positives,
        "threshold": threshold if threshold is not None else verifier.default_threshold,
        **_summary(hits, correct, positives, len(queries)),
        "false_hits_own_pair_label_0": outcomes.count("own_label_0"),
        "rule_ceiling": rule_ceiling(pairs, queries),
        "false_hits_other_entry": outcomes.count("other_entry"),
        "qqp_heldout_subset": _summary(
            sum(1 for o, _ in heldout if o != "miss"),
            sum(1 for o, _ in heldout if o == "correct"),
            sum(label for _, label in heldout),
            max(1, len(heldout)),
        ),
        "precision_views": _views(pairs, queries, outcomes),
        "hard_cases_heldout": hard_case_report(embedder, verifier, limit),
        "verifier_rejections": cache.stats.rejections,
        "latency_ms": {
            "embed": _pct([t.embed_ms for t in timings]),
            "search": _pct([t.search_ms for t in timings]),
            "verify": _pct([t.verify_ms for t in timings]),
            "total": _pct([t.total_ms for t in timings]),
        },
        "peer_gptcache_similarity_0.8": _peer(embedder, pairs, queries),
    }


def _views(pairs: list[Pair], queries: list[int], outcomes: list[str]) -> dict[str, Any]:
    """Strict / excluding forced exact repeats / own-pair precision, all and held-out."""
    forced = forced_queries(pairs, queries)
    out: dict[str, Any] = {}
    for name, keep in (
        ("all", lambda i: True),
        ("qqp_heldout", lambda i: qqp_split(pairs[i].text_a, pairs[i].text_b) == "heldout"),
    ):
        rows = [(i, o) for i, o in zip(queries, outcomes, strict=True) if keep(i)]
        out[name] = precision_views(
            [o for _, o in rows], [pairs[i].label for i, _ in rows], [i in forced for i, _ in rows]
        )
    return out


def hard_case_report(
    embedder: SentenceTransformerEmbedder, verifier: LogisticVerifier, threshold: float
) -> dict[str, Any]:
    """The verifier's decision on each hand-written hard case held out of training
    (``split == heldout`` in ``bench/semantic/hard_cases.jsonl``): query ``text_b`` against the
    cached ``text_a`` at their embedding similarity; right when accept == label."""
    from importlib import resources

    text = resources.files("bench.semantic").joinpath("hard_cases.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = [r for r in rows if r["split"] == "heldout"]
    va = embedder.embed([r["text_a"] for r in rows])
    vb = embedder.embed([r["text_b"] for r in rows])
    per_kind: dict[str, dict[str, int]] = {}
    for r, x, y in zip(rows, va, vb, strict=True):
        accept = verifier.score(r["text_b"], r["text_a"], float(x @ y)) >= threshold
        tally = per_kind.setdefault(r["kind"], {"correct": 0, "total": 0})
        tally["correct"] += int(accept == bool(r["label"]))
        tally["total"] += 1
    total = {k: sum(t[k] for t in per_kind.values()) for k in ("correct", "total")}
    return {"total": total, "per_kind": dict(sorted(per_kind.items()))}


def rule_ceiling(pairs: Sequence[Pair], queries: Sequence[int]) -> dict[str, Any]:
    """The best precision any cache can reach under the own-pair rule on these queries.

    A query whose text is, character for character, another pair's ``text_a`` finds
    that stored prompt itself; every cache serves an identical question (it is an
    exact repeat), yet the rule counts the hit false because the entry is not the
    query's own pair. With ``forced`` such queries, even a perfect verifier that
    serves every other positive and nothing else reaches only
    ``achievable / (achievable + forced)``.
    """
    forced = forced_queries(pairs, queries)
    positives = sum(pairs[i].label for i in queries)
    achievable = positives - sum(pairs[i].label for i in forced)
    denominator = achievable + len(forced)
    return {
        "queries_identical_to_another_pairs_prompt": len(forced),
        "max_precision": round(achievable / denominator, 4) if denominator else None,
        "max_recall": round(achievable / positives, 4) if positives else None,
    }


def _outcome(pair: Pair, i: int, result: LookupResult, owners: dict[EntryId, set[int]]) -> str:
    """miss | correct | own_label_0 | other_entry."""
    if result.hit is None:
        return "miss"
    entry = result.hit.entry
    if entry is None or i not in owners.get(entry.entry_id, set()):
        return "other_entry"
    return "correct" if pair.label == 1 else "own_label_0"


def run_pair_bench_sync(pairs: list[Pair], **kwargs: Any) -> dict[str, Any]:
    """:func:`run_pair_bench` from synchronous code (the CLI)."""
    return asyncio.run(run_pair_bench(pairs, **kwargs))
