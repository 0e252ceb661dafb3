"""Evidence for the error bound: probes of would-be hits, the check of the engine's
fresh answer against the stored one, and the observations that come of it.

The owner of every evidence write: :class:`EvidenceKeeper` makes the probe for a held
back or explored hit (:mod:`explore` chose it), compares the answers the gateway brings
back (the verifier on the two answers; exact match at temperature 0) and records the
outcome with the entry in the store, where every replica reads it (:mod:`bound`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.semantic.embedder import MicroBatcher
from proxy.semantic.explore import Choice, answers_agree, cosine
from proxy.semantic.keys import CacheKey
from proxy.semantic.stats import SemanticStats
from proxy.semantic.store import EntryId, EntryStore
from proxy.semantic.types import SemanticHit, SemanticProbe
from proxy.semantic.verifier import Verifier


class EvidenceKeeper:
    """Makes probes and records whether answering from an entry was right."""

    def __init__(self, store: EntryStore, batcher: MicroBatcher, verifier: Verifier,
                 stats: SemanticStats, default_temperature: float) -> None:  # fmt: skip
        self._store = store
        self._batcher = batcher
        self._verifier = verifier
        self._stats = stats
        self._default_temperature = default_temperature

    async def make_probe(self, key: CacheKey, body: Mapping[str, Any], choice: Choice
                         ) -> SemanticProbe | None:  # fmt: skip
        """The probe for ``choice``'s entry: its stored answer and how to compare; None if
        the entry is gone."""
        assert choice.probe is not None
        score, sim, slot = choice.probe
        entry = await self._store.get(key.tenant_id, slot.entry_id)
        if entry is None:
            return None
        temperature = body.get("temperature")
        if temperature is None:
            temperature = self._default_temperature
        texts = tuple(c.text for c in SemanticHit.of_entry(entry, sim).choices)
        return SemanticProbe(entry.entry_id, score, sim, texts, choice.explored,
                             exact_compare=temperature == 0)  # fmt: skip

    async def observe(
        self, tenant_id: str | int, entry_id: str | None, score: float, correct: bool
    ) -> None:
        """Add one observation (an entry answering at ``score`` was right or not)."""
        await self._store.observe(str(tenant_id), EntryId(entry_id) if entry_id else None,
                                  score, correct)  # fmt: skip

    async def check_probe(
        self, tenant_id: str | int, probe: SemanticProbe, fresh_texts: tuple[str, ...]
    ) -> bool:
        """Compare the engine's answer with the probe's stored one and record it."""
        sims = None
        if not probe.exact_compare:
            sims = [cosine(await self._batcher.embed_one(a), await self._batcher.embed_one(b))
                    for a, b in zip(probe.stored_texts, fresh_texts, strict=False)]  # fmt: skip
        correct = answers_agree(probe.stored_texts, fresh_texts, exact=probe.exact_compare,
                                verifier=self._verifier, similarities=sims)  # fmt: skip
        await self.record_check(tenant_id, probe, correct)
        return correct

    async def record_check(
        self, tenant_id: str | int, probe: SemanticProbe, correct: bool
    ) -> None:
        """Record the outcome of a probe's check (whoever compared the answers)."""
        await self.observe(tenant_id, probe.entry_id, probe.score, correct)
        tenant = self._stats.tenant(str(tenant_id))
        if probe.explored:
            tenant.explored_checked += 1
            tenant.explored_wrong += not correct
        else:
            tenant.held_back_wrong += not correct
