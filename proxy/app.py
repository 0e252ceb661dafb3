"""The gateway's one ASGI app, built by :func:`create_app` (nothing happens at import):
a FastAPI app (:class:`proxy.http.completions.GatewayApp`) in which every route is
mounted once: the two completion endpoints as raw ASGI routes (called straight away
while the app has no middleware of its own), everything else as FastAPI routes.

The caller builds the expensive parts (settings, database session factory, upstreams,
optional semantic cache and router) and hands them in; the factory wires auth,
admission, rate limiting, spend budgets (:mod:`proxy.budget`), metering with its
outbox, metrics and routes around them,
and serves the web dashboards and usage APIs (:func:`web.app.include_web_routers`)
with the gateway's cached key resolver and a worker-status view of the pool.
Startup bills the streams a killed process left unfinished (:mod:`proxy.progress`,
into the outbox), drains the usage outbox (entries left by a crashed process), checks
every upstream once and starts three background loops: the outbox drainer
(:mod:`proxy.metering`), upstream health checks and the dependency probes behind
``/readyz`` (:mod:`proxy.probes`). Shutdown stops them and
closes the upstreams, the rate limiter and the outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session, sessionmaker

from billing import accounts
from billing.accounts import KeyIdentity, TenantKVPolicy
from billing.errors import BillingError
from engine.api import Tokenizer
from kvtoll.openai.errors import error_response, install_error_handlers
from kvtoll.settings import Settings
from proxy import admin
from proxy.auth import AuthError, KeyAuthenticator
from proxy.budget import BudgetGuard
from proxy.config import ProxyConfig, from_settings
from proxy.hooks import FleetHook, RouterHook, SemanticCacheHook, SemanticReport
from proxy.http import openai as openai_routes
from proxy.http import ops as ops_routes
from proxy.http.completions import CompletionEndpoints, GatewayApp
from proxy.intake import Intake, RateLimited
from proxy.kv_policy_push import KVSharePusher
from proxy.ledger_process import ProcessLedgerSink, shareable_url
from proxy.metering import InProcessLedgerSink, LedgerSink, Meter
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox
from proxy.pool import UpstreamPool
from proxy.probes import DependencyProbes, Probe, database_probe, redis_probe
from proxy.progress import ProgressJournal
from proxy.prompt import PromptCounter
from proxy.ratelimit import LocalRateLimiter, RateLimiter, RedisRateLimiter
from proxy.service import Gateway
from proxy.spend import LocalSpendCounters, RedisSpendCounters, SpendCounters
from proxy.state import ProxyState
from proxy.upstream.base import Upstream
from web.app import include_web_routers
from web.landing import build_landing_router

DEFAULT_RATELIMIT_PREFIX = "kvtoll:rl:"


class Resource(Protocol):
    """Something with a life cycle the app owns (semantic cache, routing stack)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


def _limiter(settings: Settings, config: ProxyConfig, metrics: ProxyMetrics,
             prefix: str) -> RateLimiter:
    if settings.redis_url:
        return RedisRateLimiter.from_url(
            settings.redis_url, config.rate_limits, metrics, prefix=prefix,
            socket_timeout_s=config.redis_socket_timeout_s,
        )
    return LocalRateLimiter(burst_s=config.rate_limits.burst_s)


def _budget_guard(settings: Settings, config: ProxyConfig, metrics: ProxyMetrics,
                  factory: sessionmaker[Session], prefix: str) -> BudgetGuard:
    """Budget counters in the rate limits' store (Redis when configured), refreshed
    from the database on the key cache's TTL."""
    counters: SpendCounters = (
        RedisSpendCounters.from_url(settings.redis_url, metrics, config.redis_socket_timeout_s)
        if settings.redis_url
        else LocalSpendCounters()
    )
    return BudgetGuard(factory, counters, metrics, prefix=f"{prefix}budget:",
                       refresh_s=config.auth_cache_ttl_s)


async def _on_rate_limited(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RateLimited)
    return error_response(exc, headers={"Retry-After": str(exc.retry_after_s)})


def create_app(
    settings: Settings,
    *,
    upstreams: Sequence[Upstream],
    session_factory: sessionmaker[Session],
    models: Sequence[str],
    tokenizer: Tokenizer | None = None,
    context_len: int | None = None,
    config: ProxyConfig | None = None,
    semantic: SemanticCacheHook | None = None,
    router: RouterHook | None = None,
    limiter: RateLimiter | None = None,
    ratelimit_prefix: str = DEFAULT_RATELIMIT_PREFIX,
    resources: Sequence[Resource] = (),
    extra_routers: Sequence[APIRouter] = (),
    fleet: FleetHook | None = None,
    web: bool = True,
) -> FastAPI:
    """Build the gateway app. Raises ``ValueError`` if the settings are unsafe to serve
    with (admin token empty or well known, or no server secret, outside dev mode).

    ``resources`` (e.g. the semantic cache, the routing stack) are started in order at
    startup and closed in reverse order at shutdown; ``extra_routers`` are included
    as they are (their dependencies can use :mod:`proxy.deps`); ``fleet`` (the routing
    stack) is bound to the upstream pool and the metrics registry; ``web`` adds the
    dashboards and usage APIs."""
    problem = settings.admin_token_problem()
    if problem:
        raise ValueError(problem)
    settings.server_secret()  # raises ValueError without one (outside dev mode)
    if not models:
        raise ValueError("at least one model name is required")
    config = config or from_settings(settings)
    metrics = ProxyMetrics.create()
    limiter = limiter or _limiter(settings, config, metrics, ratelimit_prefix)
    budgets = _budget_guard(settings, config, metrics, session_factory, ratelimit_prefix)
    gateway_parts = _GatewayParts(tokenizer, context_len, semantic, router, budgets)
    state = _build_state(settings, config, metrics, upstreams, session_factory, models,
                         limiter, gateway_parts)
    app = GatewayApp(title="kvtoll", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.kvtoll = state
    app.state.kvtoll_budgets = budgets
    app.state.kvtoll_resources = (budgets, *resources)  # budgets loaded before serving
    install_error_handlers(app)
    app.add_exception_handler(RateLimited, _on_rate_limited)
    app.add_exception_handler(BillingError, admin.on_billing_error)
    app.mount_completions(CompletionEndpoints(state.intake, state.gateway))
    app.include_router(openai_routes.router)
    app.include_router(ops_routes.router)
    app.include_router(admin.router)
    for extra in extra_routers:
        app.include_router(extra)
    if fleet is not None:
        fleet.bind(state.pool, metrics)
    report = semantic if isinstance(semantic, SemanticReport) else None
    if report is not None:
        report.bind_metrics(metrics.registry)
    if web:
        app.include_router(build_landing_router(dev_mode=settings.dev_mode))
        include_web_routers(
            app, session_factory, settings, resolver=_key_resolver(state.intake.authenticator),
            worker_status=fleet.worker_rows if fleet is not None else _pool_rows(state.pool),
            semantic_status=report.bound_rows if report is not None else None,
        )
    return app


def _key_resolver(authenticator: KeyAuthenticator) -> Callable[[str], KeyIdentity | None]:
    """Dashboard sign-in through the gateway's cached key lookup (same revocation TTL)."""

    def resolve(plaintext: str) -> KeyIdentity | None:
        try:
            return authenticator.authenticate(f"Bearer {plaintext}")
        except AuthError as exc:
            if exc.status >= 500:
                raise
            return None

    return resolve


def _pool_rows(pool: UpstreamPool) -> Callable[[], list[Mapping[str, object]]]:
    """Worker status for the admin dashboard when no fleet manager describes them."""

    def rows() -> list[Mapping[str, object]]:
        return [{"name": u.name, "healthy": pool.is_healthy(u.name)} for u in pool.upstreams]

    return rows


@dataclass(frozen=True)
class _GatewayParts:
    tokenizer: Tokenizer | None
    context_len: int | None
    semantic: SemanticCacheHook | None
    router: RouterHook | None
    budgets: BudgetGuard


def _ledger_sink(settings: Settings, factory: sessionmaker[Session]) -> LedgerSink | None:
    """The writer process (``KVTOLL_LEDGER_WRITER=process``, when another process can open
    the database), else None: the drainer's thread writes."""
    url = shareable_url(factory) if settings.ledger_writer == "process" else None
    return None if url is None else ProcessLedgerSink(url, InProcessLedgerSink(factory))


def _build_state(
    settings: Settings, config: ProxyConfig, metrics: ProxyMetrics,
    upstreams: Sequence[Upstream], session_factory: sessionmaker[Session],
    models: Sequence[str], limiter: RateLimiter, parts: _GatewayParts,
) -> ProxyState:
    """Wire auth, intake, metering, the upstream pool and the gateway together."""
    outbox = Outbox.in_dir(settings.data_dir, fsync_every_put=config.outbox_fsync)
    metrics.outbox_depth.set(outbox.depth())
    meter = Meter(session_factory, outbox, metrics,
                  retry_interval_s=config.ledger_retry_interval_s,
                  batch_delay_s=config.ledger_batch_delay_s,
                  sink=_ledger_sink(settings, session_factory))
    pool = UpstreamPool(upstreams, metrics)
    authenticator = KeyAuthenticator(
        session_factory, ttl_s=config.auth_cache_ttl_s, max_entries=config.auth_cache_size,
        wait_s=config.auth_wait_s,
    )
    progress = ProgressJournal.in_dir(settings.data_dir, every_tokens=config.progress_every_tokens,
                                      every_s=config.progress_every_s)
    intake = Intake(config, authenticator, limiter, PromptCounter(parts.tokenizer), metrics,
                    models=models, context_len=parts.context_len, budgets=parts.budgets)
    pusher = _share_pusher(settings, config, session_factory, pool)
    gateway = Gateway(pool=pool, meter=meter, metrics=metrics, config=config,
                      server_secret=settings.server_secret(), tokenizer=parts.tokenizer,
                      semantic=parts.semantic, router=parts.router, budgets=parts.budgets,
                      progress=progress, shares=pusher)
    return ProxyState(settings=settings, config=config, session_factory=session_factory,
                      metrics=metrics, intake=intake, gateway=gateway, pool=pool, meter=meter,
                      outbox=outbox, limiter=limiter, models=tuple(models),
                      probes=_probes(settings, config, session_factory), progress=progress,
                      share_pusher=pusher)


def _probes(settings: Settings, config: ProxyConfig,
            session_factory: sessionmaker[Session]) -> DependencyProbes:
    """The database probe, and Redis's when configured (clients made at first use)."""
    probes: dict[str, Probe] = {"database": database_probe(session_factory)}
    if settings.redis_url:
        url = settings.redis_url
        probes["redis"] = _lazy(lambda: redis_probe(url, config.redis_socket_timeout_s)[0])
    return DependencyProbes(probes, interval_s=config.probe_interval_s,
                            timeout_s=config.probe_timeout_s)


def _lazy(make: Callable[[], Probe]) -> Probe:
    """A probe built at its first call (no thread or client before the app starts)."""
    made: list[Probe] = []

    async def probe() -> None:
        if not made:
            made.append(make())
        await made[0]()

    return probe


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ProxyState = app.state.kvtoll
    resources: tuple[Resource, ...] = app.state.kvtoll_resources
    async with contextlib.AsyncExitStack() as stack:
        for resource in resources:
            await resource.start()
            stack.push_async_callback(resource.aclose)
        await stack.enter_async_context(_running(state))
        yield


@contextlib.asynccontextmanager
async def _running(state: ProxyState) -> AsyncIterator[None]:
    _bill_cut_streams(state)  # streams a killed process left unfinished, into the outbox
    await state.meter.drain()  # usage a previous process left in the outbox
    await state.pool.check_all()  # a worker down at start is down from the first request
    config = state.config
    tasks: list[asyncio.Task[Any]] = [
        asyncio.create_task(state.meter.run_drainer()),
        asyncio.create_task(state.pool.run_health_checks(config.health_check_interval_s,
                                                         config.worker_probe_min_s)),
        asyncio.create_task(state.probes.run()),
        asyncio.create_task(state.share_pusher.run()),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await state.probes.aclose()
        state.intake.authenticator.close()
        await state.gateway.aclose()
        await state.meter.drain()  # a graceful stop leaves nothing behind if the DB is up
        await state.meter.close()
        await state.limiter.aclose()
        await state.pool.aclose()
        await asyncio.to_thread(state.outbox.close)
        state.progress.close()


def _share_pusher(settings: Settings, config: ProxyConfig,
                  factory: sessionmaker[Session], pool: UpstreamPool) -> KVSharePusher:
    """What keeps the workers' tenant KV shares in step with the database (its task runs
    while the app does; the gateway reads each request's share from it)."""

    def read() -> list[TenantKVPolicy]:
        with factory() as session:
            return accounts.kv_policies(session)

    return KVSharePusher(read, pool, settings.server_secret(),
                         interval_s=config.kv_share_push_interval_s)


def _bill_cut_streams(state: ProxyState) -> None:
    """Put the provisional rows of streams a killed process never finished into the
    outbox (each request id once: a final row already queued or written wins)."""
    log = logging.getLogger(__name__)
    left = state.progress.recover()
    try:
        for request_id, payload in left:
            state.outbox.put(request_id, payload)
    except OSError as exc:  # the file stays: the next start tries again (ids once)
        log.error("cannot queue the cut streams' rows (%s); kept for the next start", exc)
        return
    if left:
        log.warning("billed %d stream(s) cut by the previous process's end", len(left))
    state.progress.forget_recovered()
