"""Assemble the whole gateway from settings: what ``kvtoll serve`` runs.

::

    settings ─► billing DB (SQLite: migrated on start; PostgreSQL: must be at head)
             ─► upstreams: --worker URL … → HttpUpstream each (+ prefix router; with
                           --worker-discovery, workers with a signed registration
                           in Redis join the pool; the workers' tokenizer, see
                           engine.api.tokenizers); every worker call carries the
                           worker token (proxy.upstream.link)
                           none          → the in-process engine (bundled SmolLM2)
             ─► semantic cache (MiniLM + FAISS; Redis-shared when KVTOLL_REDIS_URL)
             ─► proxy.app.create_app(...)

Every caller mistake raises :class:`StackError` (one line) before anything heavy
is loaded where possible; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, FastAPI
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from billing import migrate
from billing.accounts import get_tenant_by_name
from billing.db import DbTimeouts, make_engine, session_factory
from billing.schema import SCHEMA_REVISION, schema_revision
from engine.api import Tokenizer
from kvtoll.progress import start_phase
from kvtoll.settings import Settings
from proxy.app import Resource, create_app
from proxy.config import db_timeouts, from_settings
from proxy.hooks import FleetHook, RouterHook, SemanticCacheHook
from proxy.upstream.base import Upstream
from proxy.upstream.link import WorkerLink

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from proxy.semantic.service import SemanticCache


class StackError(ValueError):
    """A configuration problem the operator must fix (printed as one line, exit 2)."""


@dataclass(frozen=True)
class ServeOptions:
    workers: tuple[str, ...] = ()
    semantic: bool = True
    routing_policy: str = "cache_aware"
    tokenizer: str = "auto"  # remote mode: see engine.api.tokenizers


@dataclass
class Stack:
    """The built app plus what must be shut down after the server stops."""

    app: FastAPI
    model_names: tuple[str, ...]
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


@dataclass
class _Parts:
    upstreams: list[Upstream]
    models: list[str]
    tokenizer: Tokenizer | None = None
    context_len: int | None = None
    semantic: SemanticCacheHook | None = None
    router: RouterHook | None = None
    fleet: FleetHook | None = None
    resources: list[Resource] = field(default_factory=list)
    routers: list[APIRouter] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)


def check_worker_url(url: str) -> str:
    """``url`` if it is an absolute http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StackError(f"--worker must be an http(s) URL like http://host:8001, got {url!r}")
    return url.rstrip("/")


def prepare_database(url: str, timeouts: DbTimeouts | None = None) -> sessionmaker[Session]:
    """SQLite is migrated to head on start; another database must already be at head."""
    try:
        if make_url(url).get_backend_name() == "sqlite":
            migrate.upgrade(url)
        engine = make_engine(url, timeouts=timeouts)
        if schema_revision(engine) != SCHEMA_REVISION:
            engine.dispose()
            raise StackError("the billing database is not migrated: run `kvtoll db upgrade`")
    except StackError:
        raise
    except Exception as exc:
        raise StackError(f"cannot use the database {url!r}: {str(exc).splitlines()[0]}") from exc
    return session_factory(engine)


def worker_models(urls: tuple[str, ...], link: WorkerLink | None = None,
                  timeout_s: float = 10.0) -> list[str]:
    """Model ids the workers serve (``GET /v1/models``), in first-seen order. A worker
    that cannot be reached is skipped with a warning (it starts down; the pool's
    probes bring it in once it answers), as long as one worker answers.
    :class:`StackError` when workers serve one model in different dtypes (kvtoll workers
    name theirs in ``data[i].kvtoll.dtype``), since one prompt would then get different
    answers depending on the worker."""
    found: list[str] = []
    dtypes: dict[str, dict[str, list[str]]] = {}  # model -> dtype -> worker urls
    options = (link or WorkerLink()).httpx_options()
    problems: list[str] = []
    for url in urls:
        try:
            response = httpx.get(url.removesuffix("/v1") + "/v1/models", timeout=timeout_s,
                                 **options)
            refused = response.status_code == 401
            if not refused:
                response.raise_for_status()
                listed = response.json()["data"]
                ids = [str(m["id"]) for m in listed]
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            log.warning("worker %s is unreachable at start (%s); it starts down", url, exc)
            problems.append(f"{url}: {exc}")
            continue
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise StackError(f"cannot list the models of worker {url}: {exc}") from exc
        if refused:
            raise StackError(f"worker {url} refused the worker token (401): give the gateway "
                             "the token the workers accept (KVTOLL_WORKER_TOKEN)")
        for model_id, entry in zip(ids, listed, strict=True):
            dtype = _listed_dtype(entry)
            if dtype is not None:
                dtypes.setdefault(model_id, {}).setdefault(dtype, []).append(url)
        found += [m for m in ids if m not in found]
    if not found and problems:
        raise StackError("no worker could be reached to list its models: "
                         + "; ".join(problems))
    check_one_dtype_per_model(dtypes)
    return found


def _listed_dtype(entry: object) -> str | None:
    extra = entry.get("kvtoll") if isinstance(entry, dict) else None
    dtype = extra.get("dtype") if isinstance(extra, dict) else None
    return str(dtype) if dtype else None


def check_one_dtype_per_model(dtypes: dict[str, dict[str, list[str]]]) -> None:
    """:class:`StackError` naming the workers of a model served in more than one dtype."""
    for model_id, by_dtype in dtypes.items():
        if len(by_dtype) > 1:
            parts = "; ".join(f"{d} on {', '.join(urls)}" for d, urls in sorted(by_dtype.items()))
            raise StackError(f"workers serve {model_id} in different dtypes ({parts}): one "
                             "prompt would get different answers; start them with one --dtype")


def worker_link(settings: Settings) -> WorkerLink:
    """The worker token and TLS trust; :class:`StackError` when unsafe or unreadable."""
    try:
        token = settings.worker_tokens().current
        link = WorkerLink(token, settings.worker_tls_ca)
        link.ssl_context()  # a bad CA bundle fails here, not at the first request
    except ValueError as exc:
        raise StackError(str(exc)) from None
    if settings.worker_discovery and not (settings.redis_url and token):
        raise StackError("--worker-discovery needs KVTOLL_REDIS_URL and a worker token "
                         "(registrations are signed with it)")
    return link


def _remote_parts(settings: Settings, options: ServeOptions) -> _Parts:
    from proxy.routing.hook import RoutingOptions, RoutingStack
    from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig

    link = worker_link(settings)
    context = link.ssl_context()
    upstreams: list[Upstream] = [
        HttpUpstream(HttpUpstreamConfig(base_url=u, api_key=link.token or None,
                                        ssl_context=context,
                                        connect_timeout_s=settings.worker_connect_timeout_s,
                                        read_timeout_s=settings.worker_read_timeout_s,
                                        response_timeout_s=settings.worker_response_timeout_s))
        for u in options.workers
    ]
    parts = _Parts(upstreams, worker_models(options.workers, link,
                                            settings.worker_connect_timeout_s))
    parts.tokenizer = _worker_tokenizer(parts.models, options.tokenizer)
    redis = None
    if settings.worker_discovery and settings.redis_url:  # opt-in: --worker is authoritative
        from redis.asyncio import Redis

        redis = Redis.from_url(settings.redis_url)
    stack = RoutingStack(RoutingOptions(policy=options.routing_policy, link=link),
                         [(u.name, u.name) for u in upstreams], redis=redis)
    parts.router = stack.hook
    parts.fleet = stack.fleet
    parts.resources.append(stack)
    return parts


def _worker_tokenizer(models: list[str], choice: str) -> Tokenizer | None:
    from engine.api.tokenizers import worker_tokenizer

    try:
        return worker_tokenizer(models, choice)
    except (OSError, ValueError) as exc:
        raise StackError(f"cannot load the workers' tokenizer: {exc}") from exc


def _local_parts(settings: Settings) -> _Parts:
    from engine.api.local import start_local_engine
    from proxy.upstream.inprocess import InProcessUpstream

    try:
        engine = start_local_engine(settings)
    except (OSError, ValueError) as exc:
        raise StackError(f"cannot load the model: {exc}") from exc
    parts = _Parts([InProcessUpstream(engine)], [engine.model_name],
                   tokenizer=engine.tokenizer(), context_len=engine.max_model_len)
    parts.closers.append(engine.shutdown)
    return parts


def _load_semantic_cache(settings: Settings) -> SemanticCache:
    """The semantic cache with its embedder loaded (run beside the engine's load)."""
    from proxy.semantic.factory import build_semantic_cache
    from proxy.semantic.service import SemanticConfig

    config = SemanticConfig(explore_rate=settings.semantic_explore_rate)
    with start_phase("semantic cache (embedder load)"):
        return build_semantic_cache(
            settings.redis_url, config=config, verifier=settings.semantic_verifier
        )


def _add_semantic(parts: _Parts, settings: Settings, factory: sessionmaker[Session],
                  cache: SemanticCache) -> None:
    from proxy.deps import get_key, require_admin
    from proxy.semantic.gateway import SemanticCacheAdapter
    from proxy.semantic.routes import build_admin_cache_router, build_cache_router

    def resolve_tenant(name: str) -> int | None:
        with factory() as session:
            tenant = get_tenant_by_name(session, name)
            return None if tenant is None else tenant.id

    adapter = SemanticCacheAdapter(cache, follow=bool(settings.redis_url))
    parts.semantic = adapter
    parts.resources.append(adapter)
    parts.routers += [build_cache_router(cache, get_key),
                      build_admin_cache_router(cache, require_admin, resolve_tenant)]


def build_stack(settings: Settings, options: ServeOptions, **app_kwargs: Any) -> Stack:
    """Everything ``kvtoll serve`` runs, ready for uvicorn (see module doc)."""
    problem = settings.admin_token_problem()
    if problem:
        raise StackError(problem)
    try:
        settings.server_secret()
    except ValueError as exc:
        raise StackError(str(exc)) from None
    workers = tuple(check_worker_url(u) for u in options.workers)
    if settings.worker_discovery and not workers:
        raise StackError("--worker-discovery adds registered workers to a --worker list: "
                         "give at least one --worker")
    options = ServeOptions(workers, options.semantic, options.routing_policy, options.tokenizer)
    remote = _remote_parts(settings, options) if workers else None  # workers answer first
    # The embedder loads in a second thread while the database and the engine get ready
    # (both mostly wait on torch, which releases the GIL): a start takes the longer of
    # the two, not their sum.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtoll-start") as loader:
        semantic = loader.submit(_load_semantic_cache, settings) if options.semantic else None
        with start_phase("database"):
            factory = prepare_database(settings.database_url, db_timeouts(settings))
        parts = remote or _local_parts(settings)
        if semantic is not None:
            _add_semantic(parts, settings, factory, semantic.result())
    app = create_app(
        settings, upstreams=parts.upstreams, session_factory=factory, models=parts.models,
        tokenizer=parts.tokenizer, context_len=parts.context_len, semantic=parts.semantic,
        router=parts.router, fleet=parts.fleet, resources=parts.resources,
        extra_routers=parts.routers,
        **{"config": from_settings(settings), **app_kwargs},
    )
    return Stack(app, tuple(parts.models), parts.closers)
