"""Pair benchmark of the semantic cache (``kvtoll bench semantic``), both readings.

Per query: every ``text_a`` goes into a fresh cache (one tenant, one partition) as if
it had been answered; every ``text_b`` is then looked up through the real service (real
embedder, FAISS, verifier), one at a time. A hit is correct if it returns the entry of
its own pair (the entry holding that pair's ``text_a``) and the pair's label is 1, or
if the stored prompt is an exact repeat of the query (case, spacing and final
punctuation aside: every cache serves those). The verifier's scores of each lookup are
recorded, so the whole precision / hit-rate curve comes from the same lookups
(:mod:`bench.semantic.readings`); the operating point is the service's own decisions.

Pairwise: each queried pair's two texts scored directly (precision and recall of the
cache's decision, average precision and ROC AUC of the verifier's score).

Peer in the same run: GPTCache's default policy, a hit when the nearest cached
prompt's cosine similarity is >= 0.8, on the same embeddings without the verifier;
its wrong hits at our hit rate are read off its own curve.
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
from bench.semantic.readings import QueryOutcomes, curve, pairwise, point, wrong_at_hits
from proxy.semantic.embedder import Embedder, embed_many
from proxy.semantic.keys import CacheKey
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.stats import LookupResult
from proxy.semantic.store import EntryId, InMemoryStore, StoreConfig
from proxy.semantic.verifier import Verifier, exact_repeat

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
    cache: SemanticCache, vectors: np.ndarray, pairs: list[Pair]
) -> dict[EntryId, set[int]]:
    owners: dict[EntryId, set[int]] = {}
    for i, (pair, vector) in enumerate(zip(pairs, vectors, strict=True)):
        key = cache.key_for(BENCH_TENANT, _body(pair.text_a))
        assert isinstance(key, CacheKey)
        entry_id = await cache.store_embedded(key, _answer(pair.text_a), vector)
        if entry_id is None:
            raise RuntimeError("the in-memory store refused an entry")
        owners.setdefault(entry_id, set()).add(i)
    return owners


def embed_cached(
    embedder: Embedder, texts: list[str], cache_dir: Path | None
) -> np.ndarray:
    """``embed_many(embedder, texts)``, kept in ``cache_dir`` under a digest of the
    embedder's name and the texts (a re-run on the same file skips the embedding)."""
    if cache_dir is None:
        return embed_many(embedder, texts)
    digest = hashlib.sha1(embedder.name.encode())
    for text in texts:
        digest.update(text.encode() + b"\0")
    path = cache_dir / f"vectors-{digest.hexdigest()[:16]}.npy"
    if path.is_file():
        return np.load(path)
    vectors = embed_many(embedder, texts)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(path, vectors)
    return vectors


def _summary(hits: int, correct: int, positives: int, queries: int) -> dict[str, Any]:
    return {
        "precision": round(correct / hits, 4) if hits else None,
        "recall": round(correct / positives, 4) if positives else None,
        "hit_rate": round(hits / queries, 4),
        "hits": hits,
        "correct_hits": correct,
        "false_hits": hits - correct,
    }


class RecordingVerifier:
    """A verifier that remembers the candidates and scores of its last ``score_many``
    (the bench reads each lookup's scores without a second pass)."""

    def __init__(self, inner: Verifier) -> None:
        self.inner = inner
        self.last: list[tuple[str, float, float]] = []
        self.runs_model = False  # scored inline: ``last`` belongs to this lookup

    @property
    def default_threshold(self) -> float:
        return self.inner.default_threshold

    @property
    def min_similarity(self) -> float:
        return self.inner.min_similarity

    def score(self, query: str, prompt: str, similarity: float) -> float:
        return self.inner.score(query, prompt, similarity)

    def score_many(self, query: str, candidates: Sequence[tuple[str, float]]) -> list[float]:
        scores = self.inner.score_many(query, candidates)
        self.last = [(p, sim, sc) for (p, sim), sc in zip(candidates, scores, strict=True)]
        return scores


def score_pairs(verifier: Verifier, pairs: Sequence[tuple[str, str, float]]) -> list[float]:
    """Scores of ``(query, prompt, similarity)`` triples, batched where the verifier can."""
    triples = getattr(verifier, "score_triples", None)
    if triples is not None:
        return list(triples(pairs))
    batched = getattr(verifier, "score_pairs", None)
    if batched is not None:
        out: list[float] = []
        for start in range(0, len(pairs), 256):
            out.extend(batched([(q, p) for q, p, _ in pairs[start : start + 256]]))
        return out
    return [verifier.score(q, p, sim) for q, p, sim in pairs]


def _best(query: str, pair: Pair, scored: list[tuple[str, float, float]]) -> tuple[float, bool]:
    """The best-scored candidate's score, and whether serving it is correct."""
    if not scored:
        return float("-inf"), False
    prompt, _, score = max(scored, key=lambda item: item[2])
    right = (prompt == pair.text_a and pair.label == 1) or exact_repeat(query, prompt)
    return score, right


def _peer_outcomes(
    a: np.ndarray, b: np.ndarray, pairs: list[Pair], queries: list[int]
) -> QueryOutcomes:
    """GPTCache-style: nearest text_a by cosine over every stored vector, no verifier."""
    texts = [p.text_a for p in pairs]
    scores: list[float] = []
    correct: list[bool] = []
    for start in range(0, len(queries), 512):
        sims = b[start : start + 512] @ a.T
        best = sims.argmax(axis=1)
        for row, j in enumerate(best.tolist()):
            pair = pairs[queries[start + row]]
            scores.append(float(sims[row, j]))
            correct.append(
                (texts[j] == pair.text_a and pair.label == 1)
                or exact_repeat(pair.text_b, texts[j])
            )
    return QueryOutcomes.of(scores, correct, sum(pairs[i].label for i in queries))


async def run_pair_bench(
    pairs: list[Pair], *, threshold: float | None, heldout_only: bool, candidates: int,
    verifier: str = "cross-encoder", plot: Path | None = None,
    vectors_cache: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Fill, query, and summarise (see the module docstring)."""
    import faiss

    from proxy.semantic.factory import build_pair

    faiss.omp_set_num_threads(1)  # as in the proxy (see factory.build_semantic_cache)
    embedder, inner = build_pair(verifier)  # type: ignore[arg-type]
    recorder = RecordingVerifier(inner)
    store = InMemoryStore(StoreConfig(capacity_per_tenant=max(1, len(pairs))))
    cache = SemanticCache(embedder, store, recorder, SemanticConfig(num_candidates=candidates))
    vectors_a = embed_cached(embedder, [p.text_a for p in pairs], vectors_cache)
    owners = await _fill(cache, vectors_a, pairs)
    queries = [
        i
        for i, p in enumerate(pairs)
        if not heldout_only or qqp_split(p.text_a, p.text_b) == "heldout"
    ]
    limit = threshold if threshold is not None else inner.default_threshold
    results: list[LookupResult] = []
    best: list[tuple[float, bool]] = []
    for i in queries:
        recorder.last = []
        results.append(
            await cache.lookup_detailed(BENCH_TENANT, _body(pairs[i].text_b), threshold=limit)
        )
        best.append(_best(pairs[i].text_b, pairs[i], recorder.last))
    await cache.aclose()
    outcomes = [_outcome(pairs[i], i, r, owners) for i, r in zip(queries, results, strict=True)]
    hits = sum(1 for o in outcomes if o != "miss")
    correct = outcomes.count("correct")
    positives = sum(pairs[i].label for i in queries)
    vectors_b = embed_cached(embedder, [pairs[i].text_b for i in queries], vectors_cache)
    peer = _peer_outcomes(vectors_a, vectors_b, pairs, queries)
    peer_point = point(peer, GPTCACHE_DEFAULT_THRESHOLD)
    at_our_hits = wrong_at_hits(peer, hits)
    own = QueryOutcomes.of([s for s, _ in best], [c for _, c in best], positives)
    sims = np.sum(vectors_a[queries] * vectors_b, axis=1)
    triples = [(pairs[i].text_b, pairs[i].text_a, float(s))
               for i, s in zip(queries, sims.tolist(), strict=True)]
    pair_scores = score_pairs(inner, triples)
    labels = [pairs[i].label for i in queries]
    decided = [sc >= limit and (sim >= inner.min_similarity or sc >= 1.0)
               for sc, sim in zip(pair_scores, sims.tolist(), strict=True)]
    timings = [r.timing for r in results]
    wrong = hits - correct
    report: dict[str, Any] = {
        "pairs": len(pairs),
        "queries": len(queries),
        "query_split": "qqp heldout (never trained on)" if heldout_only else "all",
        "positives": positives,
        "verifier": verifier,
        "threshold": limit,
        "min_similarity": inner.min_similarity,
        "candidates": candidates,
        **_summary(hits, correct, positives, len(queries)),
        "false_hits_per_1000_queries": round(1000 * wrong / max(1, len(queries)), 2),
        "per_query": {"at_threshold": point(own, limit), "curve": curve(own)},
        "pairwise": pairwise(pair_scores, labels, limit, decided),
        "false_hits_own_pair_label_0": outcomes.count("own_label_0"),
        "false_hits_other_entry": outcomes.count("other_entry"),
        "rule_ceiling": rule_ceiling(pairs, queries),
        "precision_views": _views(pairs, queries, outcomes),
        "hard_cases_heldout": hard_case_report(embedder, inner, limit),
        "verifier_rejections": cache.stats.rejections,
        "latency_ms": {
            "embed": _pct([t.embed_ms for t in timings]),
            "search": _pct([t.search_ms for t in timings]),
            "verify": _pct([t.verify_ms for t in timings]),
            "total": _pct([t.total_ms for t in timings]),
        },
        "peer_gptcache_similarity_0.8": peer_point | {
            "policy": "cosine >= 0.8 on the same embedder, no verifier (GPTCache default)",
            "curve": curve(peer),
            "pairwise": pairwise(sims.tolist(), labels, GPTCACHE_DEFAULT_THRESHOLD),
            "at_our_hit_rate": at_our_hits,
        },
        "peer_wrong_hits_at_our_hit_rate_ratio": (
            round(at_our_hits["false_hits"] / wrong, 2) if wrong else None
        ),
    }
    if plot is not None:
        from bench.semantic.plot import plot_curves

        plot_curves(report, plot)
        report["plot"] = str(plot)
    return report


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
    embedder: Embedder, verifier: Verifier, threshold: float
) -> dict[str, Any]:
    """The cache's decision on each hand-written hard case held out of training
    (``split == heldout`` in ``bench/semantic/hard_cases.jsonl``): query ``text_b``
    against the cached ``text_a``, served when its similarity reaches the verifier's
    floor and its score the threshold; right when served == label. Paraphrases
    (label 1) give recall and precision; every label-0 row is a near-miss."""
    from importlib import resources

    text = resources.files("bench.semantic").joinpath("hard_cases.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = [r for r in rows if r["split"] == "heldout"]
    va = embedder.embed([r["text_a"] for r in rows])
    vb = embedder.embed([r["text_b"] for r in rows])
    sims = np.sum(va * vb, axis=1).tolist()
    triples = [(r["text_b"], r["text_a"], s) for r, s in zip(rows, sims, strict=True)]
    scores = score_pairs(verifier, triples)
    per_kind: dict[str, dict[str, int]] = {}
    served_near_misses: list[str] = []
    paraphrases = served_paraphrases = 0
    for r, sim, score in zip(rows, sims, scores, strict=True):
        accept = score >= threshold and (sim >= verifier.min_similarity or score >= 1.0)
        tally = per_kind.setdefault(r["kind"], {"correct": 0, "total": 0})
        tally["correct"] += int(accept == bool(r["label"]))
        tally["total"] += 1
        if r["label"]:
            paraphrases += 1
            served_paraphrases += int(accept)
        elif accept:
            served_near_misses.append(f"{r['text_a']} -> {r['text_b']}")
    total = {k: sum(t[k] for t in per_kind.values()) for k in ("correct", "total")}
    served = served_paraphrases + len(served_near_misses)
    return {
        "total": total,
        "paraphrases": paraphrases,
        "paraphrase_recall": round(served_paraphrases / paraphrases, 4) if paraphrases else None,
        "precision": round(served_paraphrases / served, 4) if served else None,
        "near_misses": total["total"] - paraphrases,
        "near_misses_served": len(served_near_misses),
        "near_misses_served_list": served_near_misses,
        "per_kind": dict(sorted(per_kind.items())),
    }


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
    if entry is not None and exact_repeat(pair.text_b, entry.prompt):
        return "correct"  # an exact repeat of a stored prompt: every cache serves it
    if entry is None or i not in owners.get(entry.entry_id, set()):
        return "other_entry"
    return "correct" if pair.label == 1 else "own_label_0"


def run_pair_bench_sync(pairs: list[Pair], **kwargs: Any) -> dict[str, Any]:
    """:func:`run_pair_bench` from synchronous code (the CLI)."""
    return asyncio.run(run_pair_bench(pairs, **kwargs))
