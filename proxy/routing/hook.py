"""Wiring for the gateway: the :class:`RoutingHook` (``proxy.hooks.RouterHook``) and
:class:`RoutingStack`, which builds registry, event feeds, router and hook together,
plus the :class:`~proxy.routing.fleet.FleetSync` (``proxy.hooks.FleetHook``) that
turns workers announced in Redis into the gateway's upstreams.

The gateway hands the hook its healthy upstreams; the hook ranks them with the
:class:`PrefixRouter` (upstream ``name`` = worker id) and tracks each request until
``release``. Upstreams the registry does not know (an in-process engine) rank with
zero load and no cache prediction; ones it knows to be down rank last.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from engine.kv.hashing import hash_prompt_blocks
from kvtoll import fastjson
from proxy.routing.events import EventFeeds, RedisEventConsumer
from proxy.routing.fleet import FleetSync, UpstreamFactory
from proxy.routing.index import ApproxIndex
from proxy.routing.policy import Policy, make_policy
from proxy.routing.registry import RegistryConfig, WorkerRegistry
from proxy.routing.router import PrefixRouter, RoutePlan
from proxy.routing.types import WorkerId
from proxy.upstream.base import Upstream, UpstreamRequest, UpstreamUsage
from proxy.upstream.h1 import H1Client
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig, make_client
from proxy.upstream.link import WorkerLink

BYTES_PER_TOKEN = 4  # for prompts known only as text


def prompt_bytes(body: dict[str, Any]) -> bytes:
    """A prefix-stable byte rendering of a request's prompt: chat messages one JSON
    line each (an earlier turn's rendering is a prefix of the next turn's), or the
    completion prompt's UTF-8 (empty for several prompts)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return b"".join(fastjson.dumps(m, sort_keys=True) + b"\n" for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt.encode() if isinstance(prompt, str) else b""


def routing_key_of(request: UpstreamRequest) -> str:
    """Tenant (its salt) plus the client's ``user`` field when given: a session key."""
    user = request.body.get("user")
    return f"{request.salt.hex()}:{user}" if isinstance(user, str) and user else request.salt.hex()


class RoutingHook:
    """``RouterHook`` over a :class:`PrefixRouter`."""

    def __init__(
        self,
        router: PrefixRouter,
        registry: WorkerRegistry | None = None,
        *,
        max_open_plans: int = 10_000,
    ) -> None:
        self.router = router
        self._registry = registry
        self._plans: dict[str, RoutePlan] = {}  # request id -> plan, until release
        self._max_open_plans = max_open_plans

    def rank(
        self, candidates: Sequence[Upstream], request: UpstreamRequest
    ) -> list[Upstream]:
        """``candidates`` best first; the first choice is recorded as dispatched. A single
        candidate is planned too (its blocks and load are tracked), but not scored."""
        if len(candidates) == 1:  # up or down, it is the one to try
            self._plan(request, [WorkerId(candidates[0].name)])
            return list(candidates)
        by_name = {u.name: u for u in candidates}
        down = self._known_down()
        names = [WorkerId(u.name) for u in candidates if u.name not in down]
        if not names:  # every candidate looks down to the registry: rank them anyway
            names, down = [WorkerId(u.name) for u in candidates], set()
        plan = self._plan(request, names)
        ranked = [by_name[c.worker_id] for c in plan.choices if c.worker_id in by_name]
        return ranked + [u for u in candidates if u.name in down]  # last resort

    def _plan(self, request: UpstreamRequest, names: Sequence[WorkerId]) -> RoutePlan:
        """The router's plan over ``names``; its first choice recorded as dispatched."""
        key = routing_key_of(request)
        if request.prompt_token_ids is not None:
            plan = self.router.plan(request.prompt_token_ids, request.salt, key, only=names)
        else:
            plan = self._plan_text(request, key, names)
        if plan.choices:
            self.router.dispatched(request.request_id, plan, plan.choices[0].worker_id)
            self._remember(request.request_id, plan)
        return plan

    def _plan_text(
        self, request: UpstreamRequest, key: str, names: Sequence[WorkerId]
    ) -> RoutePlan:
        """No token ids (a remote server whose tokenizer the gateway lacks): hash the
        prompt's bytes in blocks of ``4 × block_size`` (≈ ``block_size`` tokens). Such
        hashes never match a worker's KV events, but they give the approximate index
        (servers without events) real prefix affinity."""
        text = prompt_bytes(request.body)
        if not text:
            return self.router.plan_blocks((), 0, key, only=names)
        size = self.router.block_size * BYTES_PER_TOKEN
        hashes = hash_prompt_blocks(list(text), size, request.salt)
        num_tokens = -(-len(text) // BYTES_PER_TOKEN)
        return self.router.plan_blocks(hashes, num_tokens, key, only=names)

    def _known_down(self) -> set[str]:
        if self._registry is None:
            return set()
        return {w.worker_id for w in self._registry.workers() if not w.healthy}

    def started(self, upstream: Upstream, request: UpstreamRequest) -> None:
        """The upstream produced its first item (its prefill is done). If the gateway
        had moved past the first choice, that one failed before streaming: it is
        reported down and the request re-attributed to ``upstream``."""
        self._move_to(upstream, request)
        self.router.first_token(request.request_id)

    def failed(self, upstream: Upstream, request: UpstreamRequest) -> None:
        """The upstream failed before streaming: mark it down, forget the attempt."""
        self.router.failed(request.request_id, worker_failed=True)

    def _move_to(self, upstream: Upstream, request: UpstreamRequest) -> None:
        plan = self._plans.get(request.request_id)
        current = self.router.inflight_worker(request.request_id)
        if plan is None or current == upstream.name:
            return
        if current is not None:
            self.router.failed(request.request_id, worker_failed=True)
        self.router.dispatched(request.request_id, plan, WorkerId(upstream.name))

    def _remember(self, request_id: str, plan: RoutePlan) -> None:
        self._plans[request_id] = plan
        while len(self._plans) > self._max_open_plans:  # a release the gateway never sent
            del self._plans[next(iter(self._plans))]

    def release(
        self, upstream: Upstream, request: UpstreamRequest, usage: UpstreamUsage | None = None
    ) -> None:
        """The request finished on ``upstream``; ``usage`` (when given) feeds calibration."""
        self._move_to(upstream, request)
        self._plans.pop(request.request_id, None)
        self.router.completed(request.request_id, usage.cached_tokens if usage else None)


@dataclass(frozen=True)
class RoutingOptions:
    """What ``kvtoll serve`` decides about routing."""

    policy: str = "cache_aware"
    block_size: int = 16
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    events_interval_s: float = 0.1
    approx_max_blocks_per_worker: int = 100_000  # servers without KV events: LRU bound
    approx_ttl_s: float = 600.0  # ... and how long a prefix sent there is assumed kept
    link: WorkerLink = field(default_factory=WorkerLink)  # worker token and TLS for every call


class RoutingStack:
    """Registry + event feeds + router + hook, with their background tasks. With
    ``redis``, workers registered there join (signed under ``options.link.token``)."""

    def __init__(
        self,
        options: RoutingOptions,
        static_workers: Sequence[tuple[str, str]],
        redis: Redis | None = None,
        policy: Policy | None = None,
        make_upstream: UpstreamFactory | None = None,
    ) -> None:
        self.options = options
        self._http = options.link.async_client(options.registry.check_timeout_s)
        self._upstream_http: H1Client | None = None  # shared by announced workers
        self.registry = WorkerRegistry(
            options.registry, static_workers, redis=redis, http=self._http,
            registration_token=options.link.token,
        )
        approx = ApproxIndex(options.approx_max_blocks_per_worker, options.approx_ttl_s)
        self.router = PrefixRouter(
            policy or make_policy(options.policy),
            self.registry,
            options.block_size,
            approx=approx,
        )
        consumer = (
            RedisEventConsumer(redis, self.router.precise, prefix=options.registry.redis_prefix)
            if redis is not None
            else None
        )
        self.feeds = EventFeeds(self.registry, self.router.precise, self._http, consumer)
        self.hook = RoutingHook(self.router, self.registry)
        self.fleet = FleetSync(self.registry, self.router, make_upstream or self._http_upstream)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """First refresh now (so the pool is known), then the background loops."""
        await self.registry.refresh()
        sizes = {w.block_size for w in self.registry.workers() if w.block_size}
        if len(sizes) > 1:
            raise ValueError(f"workers disagree on the KV block size: {sorted(sizes)}")
        if sizes:
            self.router.block_size = sizes.pop()  # hash prompts exactly as the workers do
        await self.fleet.sync()
        self._stop.clear()
        self._tasks = [
            asyncio.create_task(self.registry.run(self._stop, self.fleet.sync)),
            asyncio.create_task(self.feeds.run(self._stop, self.options.events_interval_s)),
        ]

    async def aclose(self) -> None:
        """Stop the loops and close the HTTP client."""
        self._stop.set()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=5)
        self._tasks = []
        await self._http.aclose()
        if self._upstream_http is not None:
            await self._upstream_http.aclose()

    def _http_upstream(self, worker_id: WorkerId, url: str) -> Upstream:
        """An announced kvtoll worker as an upstream named by its worker id (all of them
        share one connection pool, closed with the stack)."""
        link = self.options.link
        config = HttpUpstreamConfig(base_url=url, name=worker_id, api_key=link.token or None,
                                    ssl_context=link.ssl_context())
        if self._upstream_http is None:
            self._upstream_http = make_client(config)
        return HttpUpstream(config, client=self._upstream_http)
