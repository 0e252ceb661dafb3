"""The accounting of :mod:`bench.economics`: what perfect caches would have billed, the
join of the requests sent with their ledger rows, and the per-tenant summary.

Perfect caches, per tenant, over the requests in the order they were sent (the tenant's
own history only; tenants never share a cache):

* prefix: request ``i``'s cached tokens are the longest common prefix of its prompt
  token ids with any earlier prompt of the same tenant, rounded down to whole KV blocks
  of ``block_size`` tokens (what a paged prefix cache can hold; the token-level length
  is kept beside it to show what the block rounding costs);
* semantic: request ``i`` is a hit when an earlier request of the same tenant asked the
  same question (same ``question_class``: a repeat, or a paraphrase by the data's label)
  and got a complete answer (``finish_reason == "stop"``; only those are cacheable).

Perfect billing rates each ledger row's own token counts at the price in force with the
ideal cached tokens, or as a semantic hit where the ideal has one and that bills less.
Savings are ``list - billed``; ``savings_fraction_of_perfect`` = actual savings / perfect
savings. A semantic hit is *wrong* when the answer it served is not one given earlier to
a request of the same question class (the answer text names its source entry).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from billing.models import ServedBy
from billing.rating import PriceTerms, Usage, rate

SEMANTIC = "semantic"
COMPLETE = "stop"


@dataclass(frozen=True)
class SentRequest:
    """One request the bench sent and what it got back."""

    request_id: str  # x-kvtoll-request-id
    tenant: str
    prompt_ids: tuple[int, ...]  # the chat prompt as the engine tokenizes it
    question_class: str  # equal classes: the same question (repeat or paraphrase)
    cache: str  # x-kvtoll-cache
    finish_reason: str | None
    answer: str


@dataclass(frozen=True)
class LedgerRow:
    """The fields of one ``usage_ledger`` row the accounting reads."""

    request_id: str
    tenant: str
    served_by: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    billed_pico: int
    list_pico: int


@dataclass(frozen=True)
class Ideal:
    """What perfect caches would have done with one request."""

    cached_tokens: int  # whole blocks
    cached_tokens_token_level: int
    semantic: bool
    repeat: bool = False  # the same prompt got a complete answer before (an exact entry)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def perfect_caches(requests: Sequence[SentRequest], block_size: int) -> list[Ideal]:
    """The ideal of every request, in send order (see the module doc)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    earlier: dict[str, list[tuple[int, ...]]] = defaultdict(list)
    answered: dict[str, set[str]] = defaultdict(set)
    complete_prompts: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    out: list[Ideal] = []
    for r in requests:
        lcp = max((common_prefix(r.prompt_ids, p) for p in earlier[r.tenant]), default=0)
        out.append(Ideal(lcp // block_size * block_size, lcp,
                         r.question_class in answered[r.tenant],
                         r.prompt_ids in complete_prompts[r.tenant]))
        earlier[r.tenant].append(r.prompt_ids)
        if r.finish_reason == COMPLETE:
            answered[r.tenant].add(r.question_class)
            complete_prompts[r.tenant].add(r.prompt_ids)
    return out


def wrong_semantic_hits(requests: Sequence[SentRequest]) -> list[bool]:
    """Per request: a semantic hit whose answer was not given earlier to the same
    question class of the same tenant (False for every other request)."""
    given: dict[tuple[str, str], set[str]] = defaultdict(set)  # (tenant, answer) -> classes
    out: list[bool] = []
    for r in requests:
        key = (r.tenant, r.answer)
        out.append(r.cache == SEMANTIC and r.question_class not in given[key])
        if r.finish_reason == COMPLETE:
            given[key].add(r.question_class)
    return out


def uuid_hex(request_id: str) -> str:
    """The same id however it is spelled (the ledger may store UUIDs without dashes)."""
    try:
        return uuid.UUID(request_id).hex
    except ValueError:
        return request_id


def _billed(row: LedgerRow, cached: int, semantic: bool, price: PriceTerms) -> int:
    served = ServedBy.SEMANTIC if semantic else ServedBy.ENGINE
    cached = 0 if semantic else min(cached, row.prompt_tokens)
    usage = Usage(row.prompt_tokens, cached, row.completion_tokens, served)
    return rate(usage, price).billed_pico


@dataclass(frozen=True)
class Joined:
    """One request with its ledger row, its ideal and the perfect bills."""

    sent: SentRequest
    row: LedgerRow
    ideal: Ideal
    wrong_hit: bool
    perfect_billed_pico: int  # block-level prefix ideal
    perfect_billed_token_level_pico: int

    @property
    def actual_semantic(self) -> bool:
        return self.row.served_by == SEMANTIC


def join(requests: Sequence[SentRequest], rows: Iterable[LedgerRow], block_size: int,
         price: PriceTerms) -> tuple[list[Joined], list[str]]:
    """The requests joined with their ledger rows by request id, and the ids of the
    requests that have no row."""
    by_id = {uuid_hex(r.request_id): r for r in rows}
    ideals = perfect_caches(requests, block_size)
    wrong = wrong_semantic_hits(requests)
    joined: list[Joined] = []
    missing: list[str] = []
    for sent, ideal, is_wrong in zip(requests, ideals, wrong, strict=True):
        row = by_id.get(uuid_hex(sent.request_id))
        if row is None:
            missing.append(sent.request_id)
            continue
        prefix_block = _billed(row, ideal.cached_tokens, False, price)
        prefix_token = _billed(row, ideal.cached_tokens_token_level, False, price)
        hit = _billed(row, 0, True, price) if ideal.semantic else None
        joined.append(Joined(
            sent, row, ideal, is_wrong,
            min(prefix_block, hit) if hit is not None else prefix_block,
            min(prefix_token, hit) if hit is not None else prefix_token,
        ))
    return joined, missing


def _fraction(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def summarize(joined: Sequence[Joined]) -> dict[str, Any]:
    """Billed vs list, the perfect bills, the fraction of perfect savings, the semantic
    hits (served, cacheable, wrong) and where the missing savings went."""
    list_pico = sum(j.row.list_pico for j in joined)
    billed = sum(j.row.billed_pico for j in joined)
    perfect = sum(j.perfect_billed_pico for j in joined)
    perfect_token = sum(j.perfect_billed_token_level_pico for j in joined)
    hits = [j for j in joined if j.actual_semantic]
    wrong = sum(j.wrong_hit for j in hits)
    cacheable = [j for j in joined if j.ideal.semantic]
    engine_rows = [j for j in joined if not j.actual_semantic]
    missed_semantic = [j for j in cacheable if not j.actual_semantic]
    prefix_rows = [j for j in engine_rows if not j.ideal.semantic]

    def lost(rows: Sequence[Joined]) -> int:  # perfect savings minus actual savings
        return sum(j.row.billed_pico - j.perfect_billed_pico for j in rows)

    return {
        "requests": len(joined),
        "list_pico": list_pico,
        "billed_pico": billed,
        "savings_pico": list_pico - billed,
        "perfect_billed_pico": perfect,
        "perfect_savings_pico": list_pico - perfect,
        "savings_fraction_of_perfect": _fraction(list_pico - billed, list_pico - perfect),
        "savings_fraction_of_perfect_token_level": _fraction(
            list_pico - billed, list_pico - perfect_token),
        "prompt_tokens": sum(j.row.prompt_tokens for j in joined),
        "cached_tokens": sum(j.row.cached_tokens for j in engine_rows),
        "perfect_cached_tokens_of_engine_rows": sum(
            min(j.ideal.cached_tokens, j.row.prompt_tokens) for j in engine_rows),
        "perfect_cached_tokens_token_level_of_engine_rows": sum(
            min(j.ideal.cached_tokens_token_level, j.row.prompt_tokens) for j in engine_rows),
        "semantic_hits": len(hits),
        "semantic_cacheable": len(cacheable),
        "semantic_cacheable_served": sum(j.actual_semantic for j in cacheable),
        "semantic_cacheable_repeats": sum(j.ideal.repeat for j in cacheable),
        "semantic_cacheable_repeats_served": sum(
            j.ideal.repeat and j.actual_semantic for j in cacheable),
        "wrong_semantic_hits": wrong,
        "wrong_semantic_hit_share": _fraction(wrong, len(hits)),
        "missing_savings_pico": {
            "semantic_missed": lost(missed_semantic),
            "prefix_shortfall": lost(prefix_rows),
            "semantic_hits_served": lost(hits),  # negative: a hit saved more than perfect
        },
    }


def report(joined: Sequence[Joined]) -> dict[str, Any]:
    """:func:`summarize` per tenant and over all of them."""
    tenants = sorted({j.sent.tenant for j in joined})
    out: dict[str, Any] = {
        "tenants": {t: summarize([j for j in joined if j.sent.tenant == t]) for t in tenants},
        "total": summarize(joined),
    }
    return out
