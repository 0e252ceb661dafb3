"""One admitted request's state through the flow of :mod:`proxy.service`, and the ledger
row it bills: the tokens (:func:`billable_tokens`), the row itself (:func:`ledger_entry`)
and, while it streams, its provisional row in the progress journal
(:func:`journal_progress`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from billing.ledger import LedgerEntry
from billing.models import RequestStatus, ServedBy
from proxy.intake import Prepared
from proxy.metering import entry_to_json
from proxy.progress import ProgressJournal
from proxy.semantic.types import SemanticHit, SemanticProbe, SemanticQuery
from proxy.tally import Tally
from proxy.upstream.base import Upstream, UpstreamRequest


@dataclass
class Flight:
    """What the gateway knows of one request in flight (metered once: ``metered``)."""

    prep: Prepared
    endpoint: str
    tally: Tally
    served_by: ServedBy
    upstream: Upstream | None = None
    upstream_request: UpstreamRequest | None = None
    hit: SemanticHit | None = None
    query: SemanticQuery | None = None
    probe: SemanticProbe | None = None  # a would-be hit answered here to check it
    metered: bool = field(default=False)
    relayed: bool = field(default=False)  # the relay started: its finally meters
    # the upstream answered in one piece (a non-streamed request asked whole): its first
    # token was never seen, so the row's ttft_ms is unknown (None), not the whole answer's
    whole: bool = field(default=False)
    # crash-safe metering (proxy.progress): completion tokens and time last journaled
    journaled_tokens: int = field(default=0)
    journaled_at: float = field(default=0.0)


def billable_tokens(flight: Flight) -> tuple[int, int, int]:
    """(prompt, cached, completion) to bill; see the module doc of :mod:`proxy.tally`."""
    if flight.hit is not None:
        prompt = flight.prep.prompt.num_tokens
        return prompt, prompt, flight.hit.completion_tokens
    usage = flight.tally.usage
    if usage is not None:
        return usage.prompt_tokens, min(usage.cached_tokens, usage.prompt_tokens), (
            usage.completion_tokens)
    if flight.tally.produced_anything:  # the usage never came: the deltas' counts
        tally = flight.tally
        prompt = tally.prompt_tokens if tally.prompt_tokens is not None else (
            flight.prep.prompt.num_tokens)
        return prompt, min(tally.prompt_cached(), prompt), tally.completion_tokens()
    return 0, 0, 0


def ledger_entry(flight: Flight, status: RequestStatus, prompt: int, cached: int,
                  completion: int, *, cut: bool = False) -> LedgerEntry:
    prep = flight.prep
    now = time.perf_counter()
    first = flight.tally.first_token_at
    return LedgerEntry(
        request_id=prep.request_id, tenant_id=prep.identity.tenant_id,
        api_key_id=prep.identity.key_id, model=prep.model, served_by=flight.served_by,
        status=status, prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=completion,
        similarity=flight.hit.similarity if flight.hit else None,
        worker=flight.upstream.name if flight.upstream else None,
        created_at=prep.arrived_at,
        latency_ms=round((now - prep.started) * 1000, 3),
        ttft_ms=None if first is None or flight.whole else round(
            (first - prep.started) * 1000, 3),
        cut=cut,
        **_tier_fields(flight, cached),
    )


def journal_progress(progress: ProgressJournal, flight: Flight) -> None:
    """Journal ``flight``'s tokens so far, as the row a cut stream bills, once one
    journal interval has passed since the last time (:mod:`proxy.progress`)."""
    if flight.metered:
        return
    tokens = flight.tally.completion_tokens()
    if not progress.due(tokens, flight.journaled_tokens, flight.journaled_at):
        return
    prompt, cached, completion = billable_tokens(flight)
    entry = ledger_entry(flight, RequestStatus.UPSTREAM_ERROR, prompt, cached, completion,
                         cut=True)
    progress.note(entry.request_id, entry_to_json(entry))
    flight.journaled_tokens = tokens
    flight.journaled_at = progress.now()


def _tier_fields(flight: Flight, cached: int) -> dict[str, int | None]:
    """The ledger's tier layers: of the billed ``cached`` tokens, those the worker's
    KV tier loaded, as its usage said (None when it has no tier or no usage came)."""
    usage = flight.tally.usage
    tier = None if flight.hit is not None or usage is None else usage.tier_cached_tokens
    if tier is None:
        return {"tier_host_cached_tokens": None, "tier_shared_cached_tokens": None}
    tier = tier.clamped(cached)
    return {"tier_host_cached_tokens": tier.host, "tier_shared_cached_tokens": tier.shared}
