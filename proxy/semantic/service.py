"""The L3 semantic cache: exact partition -> embedding -> FAISS -> verifier -> hit.

Lookup: the request maps to a tenant partition and a query text (:mod:`keys`); the
query is embedded (micro-batched), the partition's index returns the
``num_candidates`` nearest cached prompts, and the verifier scores each one with a
similarity of at least its ``min_similarity``; the best score at or above the
threshold (per tenant, else the verifier's default) is a hit. With a tenant error bound
(``max_error_rate``) the evidence decides instead, above a recall-first floor, and a
share of would-be hits is explored (:mod:`explore`, :mod:`bound`); the gateway reports
the engine's answers back through ``cache.evidence`` (:mod:`evidence`) and feedback
adds wrong observations (:meth:`SemanticCache.invalidate`). Any store failure is a miss (counted
in ``stats.store_errors``), never an error.

Store: only complete answers (every choice ``finish_reason == "stop"``, or
``"tool_calls"`` when allowed). Entries live in the store (:mod:`store`); this
process keeps a FAISS mirror per partition, rebuilt from the store by :meth:`load`
and kept in sync with other replicas by :meth:`sync` / :meth:`start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proxy.semantic.bound import BoundConfig, ErrorBound
from proxy.semantic.capacity import TenantCapacity
from proxy.semantic.embed_memo import EmbedMemo
from proxy.semantic.embedder import Embedder, MicroBatcher
from proxy.semantic.evidence import EvidenceKeeper
from proxy.semantic.explore import BoundedChooser
from proxy.semantic.follow import Follower
from proxy.semantic.index import FaissIndex
from proxy.semantic.keys import CacheKey, NotCacheable, build_cache_key
from proxy.semantic.mirror import IndexFactory, Mirror, Slot
from proxy.semantic.stats import LookupResult, LookupTiming, SemanticStats
from proxy.semantic.store import CacheEntry, ChangeEvent, EntryId, EntryStore
from proxy.semantic.types import SemanticHit, is_complete
from proxy.semantic.verifier import Verifier, check_pairing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SemanticConfig:
    """Service-wide settings (per-tenant ones come in with each call)."""

    num_candidates: int = 4
    default_threshold: float | None = None  # None: the verifier's calibrated default
    ttl_s: float = 7 * 24 * 3600.0
    allow_tool_calls: bool = False
    default_temperature: float = 1.0  # what an absent temperature means
    embed_memo_size: int = 2048  # per-(tenant, text) embeddings kept between lookup and store
    embed_workers: int = 2  # embedding threads, and torch threads in each (embedder)
    embed_threads_per_worker: int | None = 1
    sync_block_ms: int = 1000
    sweep_interval_s: float = 60.0
    # The error bound (proxy.semantic.bound / explore): share of would-be hits explored,
    # the lowest score considered when the tenant sets no threshold, the rule's figures.
    explore_rate: float = 0.05
    bound_floor: float = 0.5
    bound: BoundConfig = field(default_factory=BoundConfig)


class SemanticCache:
    """Per-tenant semantic cache service (no FastAPI here: routes live in ``routes``)."""

    def __init__(
        self,
        embedder: Embedder,
        store: EntryStore,
        verifier: Verifier,
        config: SemanticConfig | None = None,
        index_factory: IndexFactory | None = None,
        batcher: MicroBatcher | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        check_pairing(embedder.name, verifier)  # ValueError: cosines of another model
        self._embedder = embedder
        self._config = config or SemanticConfig()
        self._batcher = batcher or MicroBatcher(
            embedder,
            workers=self._config.embed_workers,
            threads_per_worker=self._config.embed_threads_per_worker,
        )
        self._store = store
        self._verifier = verifier
        self._index_factory: IndexFactory = index_factory or FaissIndex
        self._clock = clock
        self._mirror = Mirror(embedder.dim, self._index_factory)
        self.stats = SemanticStats()
        self._memo = EmbedMemo(self._config.embed_memo_size, self._batcher.embed_one)
        self._follower = Follower(store, self._mirror, self.stats, embedder.name)
        self._task: asyncio.Task[None] | None = None
        self._chooser = BoundedChooser(store, ErrorBound(self._config.bound),
                                       self._config.explore_rate, rng or random.Random())
        self.evidence = EvidenceKeeper(store, self._batcher, verifier, self.stats,
                                       self._config.default_temperature)  # fmt: skip

    def set_capacity(self, tenant_id: str | int, capacity: TenantCapacity) -> None:
        """Apply a tenant's semantic capacity (its policy) to the store's evictions."""
        self._store.capacity.set(str(tenant_id), capacity)

    @property
    def mirror(self) -> Mirror:
        """This process's FAISS mirror (read it, don't change it)."""
        return self._mirror

    def key_for(
        self, tenant_id: str | int, body: Mapping[str, Any], *, allow_sampled: bool = False
    ) -> CacheKey | NotCacheable:
        """Partition and query text of a request (or why it bypasses the cache)."""
        return build_cache_key(
            tenant_id, body, allow_sampled=allow_sampled,
            default_temperature=self._config.default_temperature,
        )  # fmt: skip

    async def lookup(
        self, tenant_id: str | int, body: Mapping[str, Any], *, allow_sampled: bool = False,
        threshold: float | None = None, request_id: str | None = None,
        max_error_rate: float | None = None,
    ) -> SemanticHit | None:  # fmt: skip
        """The verified cached answer for this request, or None (miss, bypass, failure)."""
        result = await self.lookup_detailed(
            tenant_id, body, allow_sampled=allow_sampled, threshold=threshold,
            request_id=request_id, max_error_rate=max_error_rate,
        )  # fmt: skip
        return result.hit

    async def lookup_detailed(
        self, tenant_id: str | int, body: Mapping[str, Any], *, allow_sampled: bool = False,
        threshold: float | None = None, request_id: str | None = None,
        max_error_rate: float | None = None,
    ) -> LookupResult:  # fmt: skip
        """Like :meth:`lookup`, with timings, the outcome's reason and the probe."""
        key = self.key_for(tenant_id, body, allow_sampled=allow_sampled)
        if isinstance(key, NotCacheable):
            self.stats.bypassed += 1
            return LookupResult(None, LookupTiming(), "bypass")
        self.stats.lookups += 1
        t0 = time.perf_counter()
        try:
            vector = await self._memo.embed(key.tenant_id, key.query)
        except Exception:  # the cache fails open: a broken embedder is a miss, not an error
            log.exception("semantic lookup: embedding failed; treated as a miss")
            self.stats.embed_errors += 1
            return LookupResult(None, LookupTiming(), "embed_error")
        t1 = time.perf_counter()
        candidates = self._mirror.search(
            key.tenant_id, key.partition, vector, self._config.num_candidates
        )
        t2 = time.perf_counter()
        limit = self._threshold(threshold)
        scored = await self._verify(key.query, candidates)
        t3 = time.perf_counter()
        timing = LookupTiming((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
        self.stats.observe(timing)
        if max_error_rate is not None:
            floor = self._config.bound_floor if threshold is None else threshold
            return await self._bounded(key, body, scored, timing, floor, max_error_rate,
                                       request_id)  # fmt: skip
        try:
            hit = await self._first_live(key.tenant_id, scored, limit, request_id)
        except Exception:
            self.stats.store_errors += 1
            self.stats.misses += 1
            return LookupResult(None, timing, "store_error")
        if hit is not None:
            self.stats.hits += 1
            return LookupResult(hit, timing, "hit")
        self.stats.misses += 1
        if scored:
            self.stats.rejections += 1
            return LookupResult(None, timing, "rejected")
        return LookupResult(None, timing, "miss")

    async def _bounded(
        self, key: CacheKey, body: Mapping[str, Any], scored: list[tuple[float, float, Slot]],
        timing: LookupTiming, floor: float, max_error_rate: float, request_id: str | None,
    ) -> LookupResult:  # fmt: skip
        tenant = self.stats.tenant(key.tenant_id)
        tenant.max_error_rate = max_error_rate
        try:
            choice = await self._chooser.choose(key.tenant_id, scored, floor, max_error_rate)
            hit = None
            if choice.serve is not None:
                hit = await self._first_live(key.tenant_id, [choice.serve], 0.0, request_id)
            probe = (None if choice.probe is None
                     else await self.evidence.make_probe(key, body, choice))
        except Exception:
            self.stats.store_errors += 1
            self.stats.misses += 1
            return LookupResult(None, timing, "store_error")
        if hit is not None:
            self.stats.hits += 1
            tenant.hits += 1
            return LookupResult(hit, timing, "hit")
        self.stats.misses += 1
        if probe is not None:
            if probe.explored:
                tenant.explored += 1
            else:
                tenant.held_back += 1
            return LookupResult(None, timing, "explore" if probe.explored else "held_back", probe)
        if scored:
            self.stats.rejections += 1
            return LookupResult(None, timing, "rejected")
        return LookupResult(None, timing, "miss")

    def _threshold(self, tenant_threshold: float | None) -> float:
        if tenant_threshold is not None:
            return tenant_threshold
        if self._config.default_threshold is not None:
            return self._config.default_threshold
        return self._verifier.default_threshold

    async def _verify(
        self, query: str, candidates: list[tuple[Slot, float]]
    ) -> list[tuple[float, float, Slot]]:
        """(score, similarity, slot) of the candidates worth scoring, best score first; a
        verifier with a model (``runs_model``) runs on the embedder's pool, not the loop."""
        worth = [(slot, sim) for slot, sim in candidates if sim >= self._verifier.min_similarity]
        texts = [(slot.prompt, sim) for slot, sim in worth]
        pooled = worth and getattr(self._verifier, "runs_model", False)
        score = self._verifier.score_many
        scores = await self._batcher.run(score, query, texts) if pooled else score(query, texts)
        return sorted(((sc, sim, slot) for sc, (slot, sim) in zip(scores, worth, strict=True)),
                      key=lambda item: -item[0])  # fmt: skip

    async def _first_live(
        self,
        tenant_id: str,
        scored: list[tuple[float, float, Slot]],
        limit: float,
        request_id: str | None,
    ) -> SemanticHit | None:
        for score, sim, slot in scored:
            if score < limit:
                return None
            entry = await self._store.record_hit(tenant_id, slot.entry_id)
            if entry is None:  # expired or deleted by another replica
                self._mirror.remove(slot.entry_id)
                continue
            if request_id is not None:
                await self._store.remember_request(tenant_id, request_id, entry.entry_id, score)
            return SemanticHit.of_entry(entry, sim, score)
        return None

    async def store(
        self, tenant_id: str | int, body: Mapping[str, Any], answer: Mapping[str, Any], *,
        allow_sampled: bool = False, allow_tool_calls: bool | None = None,
    ) -> EntryId | None:  # fmt: skip
        """Cache a complete answer; returns its id, or None when it may not be cached."""
        key = self.key_for(tenant_id, body, allow_sampled=allow_sampled)
        tools_ok = self._config.allow_tool_calls if allow_tool_calls is None else allow_tool_calls
        if isinstance(key, NotCacheable) or not is_complete(answer, tools_ok):
            self.stats.store_skipped += 1
            return None
        try:
            vector = await self._memo.embed(key.tenant_id, key.query)
        except Exception:
            log.exception("semantic store: embedding failed; answer not cached")
            self.stats.embed_errors += 1
            return None
        return await self.store_embedded(key, dict(answer), vector)

    async def store_embedded(
        self, key: CacheKey, answer: dict[str, Any], vector: np.ndarray
    ) -> EntryId | None:
        """Cache ``answer`` under ``key`` with a precomputed embedding (bulk loads, benches)."""
        existing = self._same_prompt(key, vector)
        if existing is not None:
            return existing
        now = self._clock()
        entry = CacheEntry(
            entry_id=EntryId("sem_" + uuid.uuid4().hex), tenant_id=key.tenant_id,
            partition=key.partition, prompt=key.query, answer=answer,
            vector=np.asarray(vector, dtype=np.float32), embedder=self._embedder.name,
            created_at=now,
            expires_at=now + self._config.ttl_s, last_hit_at=now,
        )  # fmt: skip
        try:
            evicted = await self._store.put(entry)
        except Exception:
            self.stats.store_errors += 1
            return None
        for entry_id in evicted:
            self._mirror.remove(entry_id)
        self.stats.evictions += len(evicted)
        if entry.entry_id in evicted:  # larger than the tenant's whole byte limit
            return None
        self._follower.add(entry.entry_id, key.tenant_id, key.partition, key.query, entry.vector)
        self.stats.stored += 1
        return entry.entry_id

    def _same_prompt(self, key: CacheKey, vector: np.ndarray) -> EntryId | None:
        for slot, _ in self._mirror.search(key.tenant_id, key.partition, vector, 1):
            if slot.prompt == key.query:
                return slot.entry_id
        return None

    async def delete(self, tenant_id: str | int, entry_id: str) -> bool:
        """Delete one of ``tenant_id``'s entries; False if it has no such entry."""
        tenant = str(tenant_id)
        slot = self._mirror.slot_of(EntryId(entry_id))
        try:
            deleted = await self._store.delete(tenant, EntryId(entry_id))
        except Exception:
            self.stats.store_errors += 1
            raise
        if slot is not None and slot.tenant_id == tenant:
            self._mirror.remove(slot.entry_id)
            deleted = True
        return deleted

    async def invalidate(
        self, tenant_id: str | int, *, entry_id: str | None = None, request_id: str | None = None
    ) -> EntryId | None:
        """Feedback "wrong": a wrong observation at the score the hit was served at (when
        named by request id: the score is known), then delete the entry served (by entry
        id or by the request id of the hit). Returns the entry id deleted, or None if
        nothing matched."""
        tenant = str(tenant_id)
        target = EntryId(entry_id) if entry_id else None
        score: float | None = None
        if request_id:
            served = await self._store.served_for_request(tenant, request_id)
            if served is not None and (target is None or served[0] == target):
                target, score = served
        if target is None:
            return None
        if score is not None:
            await self._store.observe(tenant, target, score, False)
        if not await self.delete(tenant, target):
            return None
        self.stats.invalidations += 1
        self.stats.tenant(tenant).feedback_wrong += 1
        return target

    async def flush(self, tenant_id: str | int) -> int:
        """Delete every entry of one tenant; returns how many the store held."""
        tenant = str(tenant_id)
        removed = await self._store.flush(tenant)
        self._mirror.remove_tenant(tenant)
        return removed

    # ---- mirror ---------------------------------------------------------------------

    def num_mirrored(self, tenant_id: str | int | None = None) -> int:
        """Entries in the local FAISS mirror (one tenant's, or all)."""
        return self._mirror.count(None if tenant_id is None else str(tenant_id))

    def apply(self, event: ChangeEvent) -> None:
        """Mirror one change made elsewhere."""
        self._follower.apply(event)

    async def load(self) -> int:
        """Rebuild the mirror from the store (on start); returns entries mirrored."""
        return await self._follower.load()

    async def sync(self, block_ms: int = 0) -> int:
        """Apply pending changes from other replicas; returns how many."""
        return await self._follower.sync(block_ms)

    async def sweep(self) -> int:
        """Delete expired entries from the store and the mirror."""
        return await self._follower.sweep()

    async def start(self) -> None:
        """Load the mirror, then follow other replicas' changes in the background."""
        await self.load()
        run = self._follower.run(self._config.sync_block_ms, self._config.sweep_interval_s)
        self._task = asyncio.get_running_loop().create_task(run)

    async def aclose(self) -> None:
        """Stop following, close the store and the embedding thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._store.aclose()
        self._batcher.close()

