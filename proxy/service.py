"""The request flow after intake: semantic lookup → upstream choice → relay → meter.

::

    Prepared ──► semantic.lookup ──hit──► cached answer ─────────────┐
                     │ miss / no-cache / no cache configured          │
                     ▼                                                ▼
    candidates (healthy, router.rank) ─► first item of upstream 1 ─► relay items ─► client
                     │ fails before its first item: next candidate    │ usage item:
                     ▼                                                ▼ ledger row (OK)
                 502 + ledger row (upstream_error, 0 tokens)     stream ends early:
                                                                  ledger row (client_disconnect
                                                                  / upstream_error, tokens so far)

Retries happen only while opening (nothing has reached the client); an upstream that
fails (refused, cut, silent past its timeout) is marked down in the pool at once,
before or during the relay, so the next requests go around it. A non-streamed request
is asked of an HTTP upstream whole (:attr:`UpstreamRequest.whole`): its first item comes
with the complete answer, so the wait for it is bounded by ``upstream_response_timeout_s``
instead of the first-byte timeout; everything after (tally, usage, row) is as streamed,
except that the row's ``ttft_ms`` is unknown (no first token was seen on its own).
Exactly one
ledger row is written per admitted request, from the relay's ``finally`` (shielded
from cancellation), before the usage item is passed on. A request cancelled before
its relay ran (while waiting for the upstream's first item, or after it but before
the response started: an async generator that never started runs no ``finally``)
gets its row from :meth:`Reply.aclose` or from :meth:`Gateway.open` itself, status
``client_disconnect`` with what the upstream had produced; a semantic answer that
completed with ``stop`` everywhere is offered to the cache afterwards in the
background. While a stream runs, its tokens so far are journaled
(:mod:`proxy.progress`), so a gateway killed mid-stream bills them at its next start;
a stream cut by its upstream is billed what it delivered, its row marked ``cut``.
Services never import FastAPI; the routes render what this yields.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from functools import partial

import anyio

from billing.ledger import LedgerEntry
from billing.models import RequestStatus, ServedBy, TenantId
from engine.api import Tokenizer
from engine.kv.hashing import TenantSalt, derive_tenant_salt
from kvtoll.openai.errors import OpenAIError
from proxy.budget import BudgetGuard
from proxy.cache_stores import BackgroundStores
from proxy.config import ProxyConfig
from proxy.flight import Flight, billable_tokens, journal_progress, ledger_entry
from proxy.hooks import RouterHook, SemanticCacheHook
from proxy.intake import Prepared
from proxy.kv_policy_push import KVSharePusher, request_share
from proxy.metering import Meter
from proxy.metrics import ProxyMetrics
from proxy.pool import UpstreamPool
from proxy.progress import ProgressJournal
from proxy.reply import Reply, UpstreamUnavailable
from proxy.semantic.types import SemanticHit, SemanticProbe, SemanticQuery
from proxy.semantic_exchange import cache_answer, replay_hit, semantic_query
from proxy.steptimer import StepTimer
from proxy.tally import Item, Tally
from proxy.upstream.base import (
    Upstream,
    UpstreamError,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
    answers_whole,
)

log = logging.getLogger(__name__)
MAX_CACHED_SALTS = 100_000


class Gateway:
    """Runs admitted requests (see module doc)."""

    def __init__(
        self,
        *,
        pool: UpstreamPool,
        meter: Meter,
        metrics: ProxyMetrics,
        config: ProxyConfig,
        server_secret: bytes,
        tokenizer: Tokenizer | None = None,
        semantic: SemanticCacheHook | None = None,
        router: RouterHook | None = None,
        budgets: BudgetGuard | None = None,
        progress: ProgressJournal | None = None,
        shares: KVSharePusher | None = None,
    ) -> None:
        self._pool = pool
        self._shares = shares
        self._progress = progress
        self._budgets = budgets
        self._meter = meter
        self._metrics = metrics
        self._config = config
        self._secret = server_secret
        self._tokenizer = tokenizer
        self._semantic = semantic
        self._router = router
        self._stores = None if semantic is None else BackgroundStores(
            semantic, config.max_pending_cache_stores, metrics.cache_stores_shed.inc)
        self._salts: dict[TenantId, TenantSalt] = {}

    def _salt(self, tenant_id: TenantId) -> TenantSalt:
        """The tenant's engine salt (an HMAC of the server secret), derived once."""
        salt = self._salts.get(tenant_id)
        if salt is None:
            if len(self._salts) >= MAX_CACHED_SALTS:
                self._salts.clear()
            salt = self._salts[tenant_id] = derive_tenant_salt(self._secret, tenant_id)
        return salt

    async def open(self, prep: Prepared, endpoint: str) -> Reply:
        """Start answering ``prep``; raises :class:`OpenAIError` if no upstream can (then a
        budget hold that no ledger row settled is released: nothing was billed)."""
        try:
            reply = await self._open(prep, endpoint)
        except BaseException:
            if self._budgets is not None and prep.budget is not None:
                self._budgets.release(prep.budget)  # no-op once its row settled it
            raise
        if prep.budget is not None:
            reply.budget_alert = prep.budget.alert_header
        return reply

    async def _open(self, prep: Prepared, endpoint: str) -> Reply:
        probe: SemanticProbe | None = None
        if self._semantic is not None:
            query = semantic_query(prep)
            if not prep.no_cache:
                found = await self._semantic.lookup(query)
                self._metrics.record_semantic_lookup(isinstance(found, SemanticHit))
                if isinstance(found, SemanticHit):
                    return self._semantic_reply(prep, endpoint, query, found)
                probe = found  # explored or held back: the engine answers, billed as a miss
        else:
            query = None
        return await self._upstream_reply(prep, endpoint, query, probe)

    def _semantic_reply(
        self, prep: Prepared, endpoint: str, query: SemanticQuery, hit: SemanticHit
    ) -> Reply:
        flight = Flight(prep, endpoint, Tally(self._tokenizer), ServedBy.SEMANTIC, hit=hit,
                         query=query)
        source = replay_hit(hit, prep.prompt.num_tokens)
        items = self._relay(flight, source)
        return Reply(prep.request_id, None, True, prep.no_cache, items, flight.tally,
                     similarity=hit.similarity, abandon=partial(self._abandon, flight, source))

    async def _upstream_reply(
        self, prep: Prepared, endpoint: str, query: SemanticQuery | None,
        probe: SemanticProbe | None = None,
    ) -> Reply:  # fmt: skip
        salt = self._salt(prep.identity.tenant_id)
        request = UpstreamRequest(
            request_id=prep.request_id, kind=prep.kind, model=prep.model, body=prep.body,
            salt=salt, prompt_token_ids=prep.prompt.token_ids, parsed=prep.request,
            kv_share=request_share(prep.identity, salt, self._shares),
            whole=not prep.request.stream,
        )
        flight = Flight(prep, endpoint, Tally(self._tokenizer), ServedBy.ENGINE,
                         upstream_request=request, query=query, probe=probe)
        timer = StepTimer()
        try:
            upstream, first, stream = await self._connect(flight, request, timer)
        except UpstreamRejected as exc:
            timer.close()
            raise OpenAIError(str(exc), status=exc.status, param=exc.param,
                              code="upstream_rejected") from exc
        except BaseException as exc:  # no upstream, cancelled while waiting, or a bug
            timer.close()
            status = (RequestStatus.CLIENT_DISCONNECT if isinstance(exc, asyncio.CancelledError)
                      else RequestStatus.UPSTREAM_ERROR)
            with anyio.CancelScope(shield=True):
                await self._finish(flight, status)
            raise
        flight.upstream = upstream
        flight.whole = request.whole and answers_whole(upstream)
        flight.tally.note_prompt(first)  # the prompt counts, before the headers are sent
        items = self._relay(flight, stream, first=first, timer=timer)
        return Reply(prep.request_id, upstream.name, False, prep.no_cache, items, flight.tally,
                     abandon=partial(self._abandon, flight, stream, first, timer))

    def _candidates(self, request: UpstreamRequest) -> Sequence[Upstream]:
        candidates = self._pool.candidates()
        if self._router is not None:
            return self._router.rank(candidates, request)
        return candidates

    def _first_item_s(self, upstream: Upstream, request: UpstreamRequest) -> float:
        """How long ``upstream``'s first item may take: the whole answer's timeout when it
        answers ``request`` in one piece, else the first-byte timeout."""
        if request.whole and answers_whole(upstream):
            return self._config.upstream_response_timeout_s
        return self._config.upstream_first_byte_timeout_s

    async def _connect(
        self, flight: Flight, request: UpstreamRequest, timer: StepTimer
    ) -> tuple[Upstream, Item, AsyncIterator[Item]]:
        """The first upstream that produces a first item, that item and the rest. If
        cancelled while an upstream works on it, that upstream's stream is closed and
        ``flight.upstream`` names it (so its router slot is released with the row)."""
        problems: list[str] = []
        timeouts = 0
        for upstream in self._candidates(request):
            stream = upstream.stream(request)
            try:
                with timer(self._first_item_s(upstream, request)):
                    first = await anext(stream)
            except asyncio.CancelledError:
                flight.upstream = upstream
                with anyio.CancelScope(shield=True):
                    await _close(stream)
                raise
            except UpstreamRejected:
                await _close(stream)
                raise
            except (UpstreamError, TimeoutError, OSError, StopAsyncIteration) as exc:
                await _close(stream)
                problems.append(f"{upstream.name}: {exc or type(exc).__name__}")
                timeouts += isinstance(exc, TimeoutError) or (
                    isinstance(exc, UpstreamError) and exc.status == 504)
                if isinstance(exc, UpstreamError) and not exc.retryable:
                    break
                self._pool.mark(upstream, False)  # silent too: the probes bring it back
                continue
            if self._router is not None:
                self._router.started(upstream, request)
            return upstream, first, stream
        raise UpstreamUnavailable("; ".join(problems) or "no upstream configured",
                                  timed_out=bool(problems) and timeouts == len(problems))

    async def _relay(
        self, flight: Flight, source: AsyncIterator[Item], *, first: Item | None = None,
        timer: StepTimer | None = None,
    ) -> AsyncGenerator[Item, None]:
        """``first`` (when given) then ``source``'s items, each folded into the tally;
        the ledger row is written when the usage item passes, else when the stream
        ends or is closed. With ``timer``, waiting longer than the idle timeout for an
        item is an :class:`UpstreamError` ("upstream stalled")."""
        flight.relayed = True
        status = RequestStatus.CLIENT_DISCONNECT
        ended = False
        item = first
        try:
            while True:
                if item is None:
                    try:
                        if timer is None:
                            item = await anext(source)
                        else:
                            with timer(self._config.upstream_idle_timeout_s):
                                item = await anext(source)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        raise UpstreamError("upstream stalled", retryable=False) from None
                flight.tally.add(item)
                if isinstance(item, UpstreamUsage):
                    await self._finish(flight, RequestStatus.OK)
                yield item
                if self._progress is not None and flight.prep.request.stream:
                    journal_progress(self._progress, flight)  # after the item went out
                item = None
            ended = True
            if not flight.metered:
                status = RequestStatus.UPSTREAM_ERROR
                raise UpstreamError("upstream ended without usage", retryable=False)
        except (UpstreamError, OSError):
            status = RequestStatus.UPSTREAM_ERROR
            if flight.upstream is not None:
                self._pool.mark(flight.upstream, False)
            raise
        finally:
            if timer is not None:
                timer.close()
            if not (ended and flight.metered):  # else: source exhausted, row written
                with anyio.CancelScope(shield=True):
                    await _close(source)
                    if not flight.metered:
                        await self._finish(flight, status)

    async def _abandon(self, flight: Flight, source: AsyncIterator[Item],
                       first: Item | None = None, timer: StepTimer | None = None) -> None:
        """The reply was closed before its relay started: close the upstream and bill
        what it produced (``first``) as a client disconnect."""
        if flight.relayed or flight.metered:
            return
        flight.relayed = True
        if timer is not None:
            timer.close()
        if first is not None:
            flight.tally.add(first)
        with anyio.CancelScope(shield=True):
            await _close(source)
            await self._finish(flight, RequestStatus.CLIENT_DISCONNECT)

    async def _finish(self, flight: Flight, status: RequestStatus) -> None:
        """Write the request's one ledger row and update metrics, hooks and caches. The
        awaits that can suspend are shielded from cancellation (the usual path, an
        outbox append, does not suspend: no cancel scope costs it time)."""
        if flight.metered:
            return
        flight.metered = True
        prompt, cached, completion = billable_tokens(flight)
        cut = status is RequestStatus.UPSTREAM_ERROR and completion > 0  # after its first token
        entry = ledger_entry(flight, status, prompt, cached, completion, cut=cut)
        if not self._meter.record_nowait(entry):  # the outbox failed: to the ledger now
            with anyio.CancelScope(shield=True):
                await self._meter.record_directly(entry)
        if self._progress is not None and flight.journaled_tokens:
            self._progress.done(entry.request_id)
        if self._budgets is not None and flight.prep.budget is not None:
            self._budgets.settle(flight.prep.budget, entry)
        # Metrics after the response is on its way: the client waits for nothing here.
        asyncio.get_running_loop().call_soon(
            self._observe, flight, status, entry, prompt, cached, completion
        )
        if self._router is not None and flight.upstream and flight.upstream_request:
            self._router.release(flight.upstream, flight.upstream_request, flight.tally.usage)
        if status is RequestStatus.OK and flight.served_by is ServedBy.ENGINE:
            self._maybe_store(flight)

    def _observe(self, flight: Flight, status: RequestStatus, entry: LedgerEntry,
                 prompt: int, cached: int, completion: int) -> None:
        layer = "semantic" if flight.served_by is ServedBy.SEMANTIC else (
            "prefix" if cached else "miss")
        if flight.served_by is ServedBy.SEMANTIC:
            self._metrics.record_semantic_tokens(prompt, completion)
        else:
            self._metrics.record_upstream_tokens(prompt, cached, completion)
        self._metrics.record_request(
            flight.endpoint, layer, status.value,
            None if entry.latency_ms is None else entry.latency_ms / 1000,
            None if entry.ttft_ms is None else entry.ttft_ms / 1000,
        )

    def _maybe_store(self, flight: Flight) -> None:
        if self._stores is None or flight.query is None or not flight.tally.all_stopped():
            return
        answer = cache_answer(flight.tally, flight.prep.admitted.prompt_tokens)
        if flight.probe is not None:  # evidence for the error bound, even under no-store
            self._stores.check(flight.query, flight.probe, answer)
        if not flight.prep.no_store:
            self._stores.offer(flight.query, answer)

    async def aclose(self) -> None:
        """Wait for background cache stores to finish."""
        if self._stores is not None:
            await self._stores.aclose()


async def _close(stream: AsyncIterator[Item]) -> None:
    closer = getattr(stream, "aclose", None)
    if closer is not None:
        try:
            await closer()
        except Exception:
            log.debug("closing an upstream stream failed", exc_info=True)
