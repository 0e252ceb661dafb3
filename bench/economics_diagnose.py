"""Why the semantic layer missed what perfect caches would serve (:mod:`bench.economics`).

The ledger says *that* a cacheable paraphrase went to the engine, not *which stage* of
L3 turned it away. This replays the run's requests, in order, through a fresh semantic
cache built by the gateway's own factory (same embedder, index, verifier and default
threshold), looking each one up with :meth:`SemanticCache.lookup_detailed` and storing
each answer the engine completed, as the gateway does. The lookup's reason names the
stage: ``miss`` (no stored entry was similar enough to be a candidate: the embedding
stage), ``rejected`` (candidates were found and the verifier turned them all down) or
``hit``. Also reported: how often the replay agrees with what the gateway did.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.economics_accounting import COMPLETE, SEMANTIC, Joined, SentRequest
from bench.economics_load import PlannedRequest


def _answer(model: str, content: str, finish_reason: str | None) -> dict[str, Any]:
    return {"object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": finish_reason}]}


async def _replay(load: Sequence[PlannedRequest], sent: Sequence[SentRequest],
                  model: str) -> dict[str, str]:
    from proxy.semantic.factory import build_semantic_cache

    cache = build_semantic_cache(None)
    reasons: dict[str, str] = {}
    try:
        await cache.load()
        for planned, s in zip(load, sent, strict=True):
            body = planned.body(model)
            reasons[s.request_id] = (await cache.lookup_detailed(s.tenant, body)).reason
            if s.cache != SEMANTIC and s.finish_reason == COMPLETE:
                await cache.store(s.tenant, body, _answer(model, s.answer, s.finish_reason))
    finally:
        await cache.aclose()
    return reasons


def replay_semantic(load: Sequence[PlannedRequest], sent: Sequence[SentRequest],
                    joined: Sequence[Joined], model: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Each request's replayed lookup reason (by request id), and a summary: the reasons
    of the cacheable requests the gateway did not serve, and the agreement with it."""
    reasons = asyncio.run(_replay(load, sent, model))
    missed = Counter(reasons[j.sent.request_id] for j in joined
                     if j.ideal.semantic and not j.actual_semantic)
    agree = sum((reasons[j.sent.request_id] == "hit") == j.actual_semantic for j in joined)
    return reasons, {"cacheable_missed_by_reason": dict(missed),
                     "replay_agrees_with_gateway": agree, "requests": len(joined)}
