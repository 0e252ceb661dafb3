"""Stream bench of the error bound (``kvtoll bench semantic --stream``).

The pairs become one shuffled prompt stream (seeded): both texts of every pair, each
at a random place, and after any prompt, with probability ``repeat_rate``, an exact
repeat of a prompt asked earlier (chosen uniformly). Every prompt goes through two
real caches (same embedder and verifier, one tenant, one partition), in the same run:

* ``bounded``: the error bound at ``max_error_rate`` with exploration on
  (:mod:`proxy.semantic.bound`, :mod:`proxy.semantic.explore`);
* ``fixed_threshold``: the peer, today's rule (verifier score >= its default
  threshold), no bound.

The oracle is the label: answering a prompt from the entry of a text is correct iff
the texts are equal (an exact repeat) or they form a pair labelled 1. It plays the
engine too: a miss stores the prompt's answer; an explored or held-back probe is
recorded as correct or not by the oracle (as the gateway would by comparing answers).
An *oracle hit* is a prompt that some entry already in the cache could answer
correctly (an earlier equal prompt, or an earlier text of a label-1 pair with it).

Reported per cache: hits, wrong hits, cumulative hit rate and wrong-hit rate (wrong
hits / hits) at checkpoints, over the whole stream and its last half, and the share
of the oracle's hits served (split into exact repeats and paraphrases).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.semantic.evaluate import Pair
from proxy.semantic.bound import wilson_interval
from proxy.semantic.embedder import Embedder, Vectors, embed_many
from proxy.semantic.keys import CacheKey
from proxy.semantic.service import SemanticCache, SemanticConfig
from proxy.semantic.stats import LookupResult
from proxy.semantic.store import EntryId, InMemoryStore, StoreConfig

TENANT = "stream"


@dataclass(frozen=True)
class StreamConfig:
    max_error_rate: float = 0.02
    explore_rate: float = 0.1
    repeat_rate: float = 0.25
    seed: int = 0
    checkpoints: int = 20
    verifier: str | None = None  # a proxy.semantic.factory choice; None: its default


def build_stream(pairs: Sequence[Pair], repeat_rate: float, seed: int) -> list[str]:
    """Both texts of every pair, shuffled, with exact repeats of earlier prompts."""
    rng = random.Random(seed)
    base = [p.text_a for p in pairs] + [p.text_b for p in pairs]
    rng.shuffle(base)
    stream: list[str] = []
    for text in base:
        stream.append(text)
        if rng.random() < repeat_rate:
            stream.append(stream[rng.randrange(len(stream))])
    return stream


class Oracle:
    """Which text's stored answer answers which prompt (the labels)."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        self._duplicates: dict[str, set[str]] = {}
        for p in pairs:
            if p.label == 1:
                self._duplicates.setdefault(p.text_a, set()).add(p.text_b)
                self._duplicates.setdefault(p.text_b, set()).add(p.text_a)

    def correct(self, query: str, stored: str) -> bool:
        return query == stored or stored in self._duplicates.get(query, ())

    def paraphrases(self, query: str) -> set[str]:
        return self._duplicates.get(query, set())


@dataclass
class Tally:
    """One cache's outcomes along the stream."""

    hits: int = 0
    wrong: int = 0
    served_repeat: int = 0
    served_paraphrase: int = 0
    explored: int = 0
    held_back: int = 0
    curve: list[dict[str, Any]] = field(default_factory=list)
    half: tuple[int, int] = (0, 0)  # (hits, wrong) at the half-way point

    def summary(self, queries: int, oracle_repeat: int, oracle_paraphrase: int) -> dict[str, Any]:
        low, high = wilson_interval(self.wrong, self.hits)
        late_hits, late_wrong = self.hits - self.half[0], self.wrong - self.half[1]
        oracle = oracle_repeat + oracle_paraphrase
        served = self.served_repeat + self.served_paraphrase
        return {
            "hits": self.hits, "wrong_hits": self.wrong,
            "hit_rate": _ratio(self.hits, queries),
            "wrong_hit_rate": _ratio(self.wrong, self.hits),
            "wrong_hit_rate_95": [round(low, 4), round(high, 4)],
            "last_half": {"hits": late_hits, "wrong_hits": late_wrong,
                          "wrong_hit_rate": _ratio(late_wrong, late_hits)},
            "oracle_hits_served": served,
            "share_of_oracle_hits_served": _ratio(served, oracle),
            "share_of_oracle_repeats_served": _ratio(self.served_repeat, oracle_repeat),
            "share_of_oracle_paraphrases_served": _ratio(self.served_paraphrase, oracle_paraphrase),
            "explored": self.explored, "held_back": self.held_back,
            "curve": self.curve,
        }  # fmt: skip


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


class PrecomputedEmbedder:
    """The embedder's vectors computed once for every text of the stream (one batched
    pass), so that both caches see identical vectors without embedding twice."""

    def __init__(self, inner: Embedder, texts: Sequence[str]) -> None:
        self._inner = inner
        unique = list(dict.fromkeys(texts))
        vectors = embed_many(inner, unique)
        self._vectors = {t: vectors[i] for i, t in enumerate(unique)}

    @property
    def dim(self) -> int:
        return self._inner.dim

    @property
    def name(self) -> str:
        return self._inner.name

    def vector(self, text: str) -> np.ndarray:
        found = self._vectors.get(text)
        return found if found is not None else self._inner.embed([text])[0]

    def embed(self, texts: Sequence[str]) -> Vectors:
        return np.stack([self.vector(t) for t in texts]).astype(np.float32)


def _body(text: str) -> dict[str, Any]:
    return {"model": "bench", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def _answer(text: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": f"answer to: {text}"}
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


class StreamRun:
    """One cache driven along the stream, the oracle playing the engine."""

    def __init__(self, cache: SemanticCache, embedder: PrecomputedEmbedder, oracle: Oracle,
                 max_error_rate: float | None) -> None:  # fmt: skip
        self.cache = cache
        self.tally = Tally()
        self._embedder = embedder
        self._oracle = oracle
        self._bound = max_error_rate
        self._prompt_of: dict[EntryId, str] = {}

    async def ask(self, text: str, oracle_kind: str | None) -> None:
        result = await self.cache.lookup_detailed(TENANT, _body(text),
                                                  max_error_rate=self._bound)  # fmt: skip
        if result.hit is not None and result.hit.entry is not None:
            self._served(text, result.hit.entry.entry_id, oracle_kind)
            return
        await self._check(text, result)
        key = self.cache.key_for(TENANT, _body(text))
        assert isinstance(key, CacheKey)
        entry_id = await self.cache.store_embedded(key, _answer(text), self._embedder.vector(text))
        if entry_id is not None:
            self._prompt_of.setdefault(entry_id, text)

    def _served(self, text: str, entry_id: EntryId, oracle_kind: str | None) -> None:
        self.tally.hits += 1
        if not self._oracle.correct(text, self._prompt_of[entry_id]):
            self.tally.wrong += 1
        elif oracle_kind == "repeat":
            self.tally.served_repeat += 1
        else:
            self.tally.served_paraphrase += 1

    async def _check(self, text: str, result: LookupResult) -> None:
        probe = result.probe
        if probe is None:
            return
        if probe.explored:
            self.tally.explored += 1
        else:
            self.tally.held_back += 1
        stored = self._prompt_of[EntryId(probe.entry_id)]
        await self.cache.evidence.record_check(TENANT, probe, self._oracle.correct(text, stored))

    def checkpoint(self, asked: int) -> None:
        t = self.tally
        self.tally.curve.append({"queries": asked, "hit_rate": _ratio(t.hits, asked),
                                 "wrong_hit_rate": _ratio(t.wrong, t.hits)})  # fmt: skip


async def run_stream_bench(pairs: list[Pair], config: StreamConfig) -> dict[str, Any]:
    """Replay the stream through both caches and summarise (module docstring)."""
    import faiss

    faiss.omp_set_num_threads(1)
    stream = build_stream(pairs, config.repeat_rate, config.seed)
    from proxy.semantic.factory import build_pair, default_verifier

    inner, verifier = build_pair(config.verifier or default_verifier())  # type: ignore[arg-type]
    embedder = PrecomputedEmbedder(inner, stream)
    oracle = Oracle(pairs)
    store_config = StoreConfig(capacity_per_tenant=max(1, len(stream)))

    def cache(store: InMemoryStore) -> SemanticCache:
        return SemanticCache(embedder, store, verifier,
                             SemanticConfig(explore_rate=config.explore_rate, embed_workers=1),
                             rng=random.Random(config.seed))  # fmt: skip

    bounded_store = InMemoryStore(store_config)
    bounded = StreamRun(cache(bounded_store), embedder, oracle, config.max_error_rate)
    fixed = StreamRun(cache(InMemoryStore(store_config)), embedder, oracle, None)
    seen: set[str] = set()
    oracle_repeat = oracle_paraphrase = 0
    every = max(1, len(stream) // config.checkpoints)
    for n, text in enumerate(stream, start=1):
        kind = "repeat" if text in seen else (
            "paraphrase" if oracle.paraphrases(text) & seen else None)  # fmt: skip
        oracle_repeat += kind == "repeat"
        oracle_paraphrase += kind == "paraphrase"
        seen.add(text)
        for run in (bounded, fixed):
            await run.ask(text, kind)
            if n % every == 0 or n == len(stream):
                run.checkpoint(n)
            if n == len(stream) // 2:
                run.tally.half = (run.tally.hits, run.tally.wrong)
    report = {
        "pairs": len(pairs), "queries": len(stream), "seed": config.seed,
        "repeat_rate": config.repeat_rate, "explore_rate": config.explore_rate,
        "max_error_rate": config.max_error_rate,
        "oracle_hits": oracle_repeat + oracle_paraphrase,
        "oracle_repeats": oracle_repeat, "oracle_paraphrases": oracle_paraphrase,
        "verifier_default_threshold": verifier.default_threshold,
        "bounded": bounded.tally.summary(len(stream), oracle_repeat, oracle_paraphrase),
        "fixed_threshold": fixed.tally.summary(len(stream), oracle_repeat, oracle_paraphrase),
        "bound_stats": vars(bounded.cache.stats.tenant(TENANT)) | {
            "measured_wrong_hit_rate": bounded.cache.stats.tenant(TENANT).wrong_hit_rate()},
    }  # fmt: skip
    evidence, _ = await bounded_store.evidence(TENANT, [])
    report["tenant_evidence_by_score_bin"] = {  # bin b: scores in [b/20, (b+1)/20)
        "correct": list(evidence.correct), "wrong": list(evidence.wrong)}
    for run in (bounded, fixed):
        await run.cache.aclose()
    return report


def run_stream_bench_sync(pairs: list[Pair], config: StreamConfig) -> dict[str, Any]:
    """:func:`run_stream_bench` from synchronous code (the CLI)."""
    return asyncio.run(run_stream_bench(pairs, config))


def plot_stream(report: dict[str, Any], path: Path) -> None:
    """Cumulative hit rate and wrong-hit rate over the stream, both caches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, style in (("bounded", "-"), ("fixed_threshold", "--")):
        curve = report[name]["curve"]
        xs = [c["queries"] for c in curve]
        top.plot(xs, [c["hit_rate"] or 0 for c in curve], style, label=name)
        bottom.plot(xs, [c["wrong_hit_rate"] or 0 for c in curve], style, label=name)
    bottom.axhline(report["max_error_rate"], color="grey", linewidth=0.8,
                   label=f"bound {report['max_error_rate']}")  # fmt: skip
    top.set_ylabel("cumulative hit rate")
    bottom.set_ylabel("cumulative wrong-hit rate")
    bottom.set_xlabel("prompts asked")
    top.legend()
    bottom.legend()
    fig.suptitle(f"semantic cache stream: {report['pairs']} pairs, seed {report['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
