"""Intake: everything between the raw HTTP request and an admitted request.

Order: authenticate (401 before anything is parsed) → read the body with a size cap
→ strict JSON → OpenAI schema (the shared serving models; fields that try to pick an
upstream are refused) → client salt fields dropped → model served? (404) → prompt
tokens → admission limits → per-key rate limit (429) and monthly budgets (429
``budget_exceeded``; :mod:`proxy.budget`), checked together when a budget applies
(their Redis round trips overlap; whichever refuses, the other's charge is handed
back). The result is an immutable :class:`Prepared` request with a fresh server-side
request id.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from billing.accounts import KeyIdentity
from kvtoll.fastjson import fast_loads
from kvtoll.openai.errors import INVALID_REQUEST, OpenAIError, decode_json_body
from kvtoll.openai.protocol import (
    SALT_FIELDS,
    ChatCompletionRequest,
    OpenAIRequest,
    parse_request,
)
from proxy.admission import Admitted, admit
from proxy.auth import KeyAuthenticator
from proxy.budget import BudgetGuard, BudgetHold
from proxy.config import ProxyConfig
from proxy.metrics import ProxyMetrics
from proxy.prompt import PromptCount, PromptCounter
from proxy.ratelimit import KeyLimits, RateDecision, RateLimiter

Kind = Literal["chat", "completion"]


# What admission settles in the parsed request: no client salt, one max_tokens.
_ADMITTED_FIELDS: dict[str, Any] = {
    "cache_salt": None, "kvtoll_kv_share": None, "max_completion_tokens": None
}


def _admitted_request(request: OpenAIRequest, max_tokens: int) -> OpenAIRequest:
    """``request`` with admission's fields settled; a copy only when one of them changes
    (most requests already carry their admitted ``max_tokens`` and nothing else)."""
    changes = {name: value for name, value in _ADMITTED_FIELDS.items()
               if getattr(request, name, None) != value}
    if request.max_tokens != max_tokens:
        changes["max_tokens"] = max_tokens
    return request.model_copy(update=changes) if changes else request


@dataclass(frozen=True)
class Prepared:
    """An authenticated, validated, admitted request: the body was parsed once, here;
    every later layer reads ``request`` (typed) or ``body`` (the same request as the
    JSON object sent upstream and keyed by the semantic cache), never the raw bytes."""

    request_id: str
    kind: Kind
    identity: KeyIdentity
    request: OpenAIRequest  # as admitted: max_tokens filled in, no salt
    body: dict[str, Any]  # client body minus salt fields, max_tokens filled in
    admitted: Admitted
    prompt: PromptCount
    arrived_at: datetime
    started: float  # perf_counter at arrival
    no_cache: bool  # Cache-Control: no-cache -> skip the semantic lookup
    no_store: bool  # Cache-Control: no-store -> do not store the answer
    budget: BudgetHold | None = None  # the reservation against the key's budgets, if any
    rate: RateDecision | None = None  # what the rate limiter counted (refunded on failure)

    @property
    def model(self) -> str:
        return self.request.model


class RateLimited(OpenAIError):
    def __init__(self, limit: str, retry_after_s: int) -> None:
        super().__init__(
            f"Rate limit reached for {limit} per minute; retry after {retry_after_s} s",
            status=429, type=limit, code="rate_limit_exceeded",
        )
        self.retry_after_s = retry_after_s


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """:func:`kvtoll.openai.errors.decode_json_body` (strict UTF-8 and JSON, an object,
    no lone surrogate), with a fast path for the common body: orjson accepts only
    strict UTF-8 and strict JSON without lone surrogates, and gives ``json``'s values
    (:func:`kvtoll.fastjson.fast_loads`). Anything the fast path does not accept goes
    through the strict decoder, which raises the exact error."""
    try:
        data = fast_loads(raw)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        return data
    return decode_json_body(raw)


# the RFC 4122 variant's first hex digit (binary 10xx) for any random hex digit
_VARIANT_DIGIT = {f"{n:x}": "89ab"[n & 3] for n in range(16)}


def new_request_id() -> str:
    """A random version-4 UUID (what ``str(uuid.uuid4())`` gives, without building a
    ``UUID`` object) from the OS's random source. The ledger and outbox drop a repeated
    request id as a retry, so ids must never repeat, also across forked workers (a
    PRNG seeded once would repeat in every child of a pre-forking server)."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT_DIGIT[h[16]]}{h[17:20]}-{h[20:]}"


def cache_directives(header: str | None) -> tuple[bool, bool]:
    """``(no_cache, no_store)`` from a ``Cache-Control`` header."""
    if not header:
        return False, False
    tokens = {t.strip().lower() for t in (header or "").split(",")}
    return "no-cache" in tokens, "no-store" in tokens


class Intake:
    """Turns raw requests into :class:`Prepared` ones (see module doc)."""

    def __init__(
        self,
        config: ProxyConfig,
        authenticator: KeyAuthenticator,
        limiter: RateLimiter,
        counter: PromptCounter,
        metrics: ProxyMetrics,
        *,
        models: Collection[str],
        context_len: int | None,
        budgets: BudgetGuard | None = None,
    ) -> None:
        self._config = config
        self._budgets = budgets
        self._auth = authenticator
        self._limiter = limiter
        self._counter = counter
        self._metrics = metrics
        self._models = frozenset(models)
        self._context_len = context_len

    @property
    def authenticator(self) -> KeyAuthenticator:
        """The cached key lookup (the dashboards sign in through it too)."""
        return self._auth

    def _new_request_id(self) -> str:
        """A random (version 4) UUID from the OS, as :func:`new_request_id`."""
        return new_request_id()

    async def authenticate(self, authorization: str | None) -> KeyIdentity:
        """The caller's identity; a key seen before never waits on the database
        (:meth:`KeyAuthenticator.resolve`)."""
        identity = self._auth.cached(authorization)
        if identity is not None:
            return identity
        return await self._auth.resolve(authorization)

    async def prepare(
        self,
        kind: Kind,
        identity: KeyIdentity,
        read_body: Callable[[int], Awaitable[bytes]],
        cache_control: str | None,
    ) -> Prepared:
        """Validate and admit one request of ``identity`` (raises :class:`OpenAIError`)."""
        started = time.perf_counter()
        arrived_at = datetime.now(UTC)
        data = decode_json_object(await read_body(self._config.limits.max_body_bytes))
        request = parse_request(kind, data)
        if request.model not in self._models:
            raise OpenAIError(
                f"The model '{request.model}' does not exist or you do not have access to it.",
                status=404, type=INVALID_REQUEST, param="model", code="model_not_found",
            )
        prompt = self._counter.count(request)
        wanted = (
            request.requested_max_tokens()
            if isinstance(request, ChatCompletionRequest)
            else request.max_tokens
        )
        admitted = admit(
            prompt.num_tokens, wanted, request.n, self._config.limits,
            context_len=self._context_len,
        )
        request_id = self._new_request_id()
        rate, budget = await self._limit(identity, request.model, admitted, request_id,
                                         arrived_at)
        body = data  # parsed above for this request alone: settled in place, not copied
        for name in SALT_FIELDS:
            body.pop(name, None)
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = admitted.max_tokens
        normalized = _admitted_request(request, admitted.max_tokens)
        no_cache, no_store = cache_directives(cache_control)
        return Prepared(
            request_id=request_id, kind=kind, identity=identity, request=normalized,
            body=body, admitted=admitted, prompt=prompt, arrived_at=arrived_at,
            started=started, no_cache=no_cache, no_store=no_store, budget=budget, rate=rate,
        )

    async def refund(self, prep: Prepared) -> None:
        """Hand ``prep``'s rate-limit charge back: it failed before anything was served."""
        if prep.rate is not None:
            await self._limiter.refund(prep.identity.key_id, prep.rate,
                                       prep.admitted.cost_tokens)

    async def _limit(self, identity: KeyIdentity, model: str, admitted: Admitted,
                     request_id: str, arrived_at: datetime,
                     ) -> tuple[RateDecision, BudgetHold | None]:
        """The rate limit and, when a budget applies to the key, the budget hold, run
        together: with Redis their two round trips overlap instead of following each
        other. Whichever refuses, the other's charge is handed back (a refused request
        costs neither its rate limit nor its budget); a rate limit refusal wins."""
        budgets = self._budgets
        rate_check = self._rate_check(identity, admitted)
        if budgets is None or not budgets.applies(identity):
            return self._admit_rate(await rate_check), None
        hold = budgets.hold(identity, model, admitted.prompt_tokens,
                            admitted.max_tokens * admitted.n, request_id, arrived_at)
        rate, budget = await asyncio.gather(rate_check, hold, return_exceptions=True)
        if isinstance(rate, BaseException) or not rate.allowed:
            if isinstance(budget, BudgetHold):
                budgets.release(budget)
        elif isinstance(budget, BaseException):
            await self._limiter.refund(identity.key_id, rate, admitted.cost_tokens)
            raise budget
        if isinstance(rate, BaseException):
            raise rate
        return self._admit_rate(rate), budget if isinstance(budget, BudgetHold) else None

    def _rate_check(self, identity: KeyIdentity, admitted: Admitted) -> Awaitable[RateDecision]:
        defaults = self._config.rate_limits
        limits = KeyLimits(
            identity.requests_per_minute or defaults.requests_per_minute,
            identity.tokens_per_minute or defaults.tokens_per_minute,
        )
        return self._limiter.check(identity.key_id, limits, admitted.cost_tokens)

    def _admit_rate(self, decision: RateDecision) -> RateDecision:
        """``decision``, or :class:`RateLimited` if it refused."""
        if not decision.allowed:
            limit = decision.limit or "requests"
            self._metrics.ratelimited.labels(limit).inc()
            raise RateLimited(limit, decision.retry_after_s)
        return decision
