"""The worker registry: which engine workers exist, whether they are alive, their load.

Workers come from two places:

* static URLs (``kvtoll serve --worker URL``), kept until the process ends; without
  discovery they are the whole pool, whatever Redis holds;
* Redis announcements, only when discovery is on (``redis`` given: ``kvtoll serve
  --worker-discovery``): each worker keeps a key ``{prefix}workers:{name}`` alive with
  ``announce`` (or a ``Heartbeat`` task), both from :mod:`engine.serving.kv_publish`;
  the wire format is :mod:`engine.api.wire`'s. A record counts only if it is signed
  under the worker token (``registration_token``), made for that name and not
  expired; anything else is ignored (one WARNING per distinct record). The key's TTL
  is the heartbeat deadline, so a worker that stops announcing leaves the pool when
  its key expires. An announced worker starts unhealthy: it becomes a candidate once
  a probe (sent with the worker token) succeeds.

Every ``check_interval_s`` each worker gets ``GET /load`` (kvtoll workers: load and
instance id; they publish KV events) or, when that is 404, ``GET /healthz`` then
``GET /health`` (other OpenAI-compatible servers: no load, no events).
``failures_to_evict`` failed checks in a row, or one failure reported by a request,
take a worker out of the candidates until a check passes again. A worker whose
instance id changed, or that came back after being down, gets a new ``incarnation``
so its KV-event feed restarts from scratch.

Dtypes: on a kvtoll worker's first good ``/load`` (and after it restarts) the registry
reads its ``GET /v1/models`` (``data[i].kvtoll.dtype``). A worker, announced or listed,
that serves a model in another dtype than a worker already in the pool is kept out of
the candidates, with one ERROR naming both workers (the gateway's start-up check,
``proxy.stack.worker_models``, does the same for the listed workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx
from redis.asyncio import Redis

from engine.api.wire import (
    EventTransport,
    announcement_key,
    parse_announcement,
)
from proxy.routing.outage import OutageLog
from proxy.routing.router import WorkerStatus
from proxy.routing.types import WorkerId, WorkerLoad

log = logging.getLogger(__name__)

ProbeKind = Literal["load", "healthz", "health"]


@dataclass(frozen=True)
class RegistryConfig:
    """Timings of discovery and health checks."""

    redis_prefix: str = "kvtoll:"
    check_interval_s: float = 1.0
    check_timeout_s: float = 1.0
    failures_to_evict: int = 2

    def __post_init__(self) -> None:
        if self.check_interval_s <= 0 or self.check_timeout_s <= 0 or self.failures_to_evict < 1:
            raise ValueError("intervals must be positive and failures_to_evict >= 1")


@dataclass(frozen=True)
class WorkerInfo:
    """A snapshot of one known worker."""

    worker_id: WorkerId
    url: str
    source: Literal["static", "redis"]
    kv_events: EventTransport
    healthy: bool
    load: WorkerLoad
    instance_id: str | None
    incarnation: int
    block_size: int | None = None  # as the worker's /load reports it


@dataclass
class _Entry:
    info: WorkerInfo
    failures: int = 0
    probe: ProbeKind = "load"
    last_ok: float = field(default_factory=time.monotonic)
    dtypes: dict[str, str] | None = None  # model -> dtype, from /v1/models (kvtoll workers)
    refused: str | None = None  # why the worker is kept out (a dtype clash), logged once


def parse_load(payload: dict[str, Any]) -> WorkerLoad:
    """A worker's ``GET /load`` body (``engine.api.EngineLoad`` fields)."""
    return WorkerLoad(
        num_running=int(payload.get("num_running", 0)),
        num_waiting=int(payload.get("num_waiting", 0)),
        num_free_blocks=int(payload.get("num_free_blocks", 0)),
        num_total_blocks=int(payload.get("num_total_blocks", 0)),
        shared_load_fraction=_fraction(payload.get("tier_load_fraction")),
        tenant_blocks=_tenant_blocks(payload.get("tenants")),
    )


def _fraction(value: Any) -> float | None:
    """A reported fraction within [0, 1], or None when absent or malformed."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return min(1.0, max(0.0, float(value)))


def _tenant_blocks(raw: object) -> tuple[tuple[str, int, int], ...]:
    """Each tenant's (name, cached, reserved) blocks from ``/load``; malformed rows skipped."""
    rows: list[tuple[str, int, int]] = []
    for item in raw if isinstance(raw, list) else ():
        try:
            rows.append((str(item["tenant"]), int(item["cached_blocks"]),
                         int(item["reserved_blocks"])))
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(rows)


class WorkerRegistry:
    """Known workers with health and load; the router's :class:`WorkerSource`."""

    def __init__(
        self,
        config: RegistryConfig,
        static_workers: Sequence[tuple[str, str]] = (),
        *,
        redis: Redis | None = None,
        http: httpx.AsyncClient | None = None,
        registration_token: str = "",
    ) -> None:
        if redis is not None and not registration_token:
            raise ValueError("worker discovery needs the worker token to verify registrations")
        self.config = config
        self._redis = redis
        self._registration_token = registration_token
        self._refused: dict[str, str] = {}  # worker name -> digest of the record last refused
        self._http = http or httpx.AsyncClient(timeout=config.check_timeout_s)
        self._owns_http = http is None
        self._entries: dict[WorkerId, _Entry] = {}
        for name, url in static_workers:
            self._add(WorkerId(name), url, "static", "http", None)

    def workers(self) -> list[WorkerInfo]:
        """Every known worker, healthy or not."""
        return [e.info for e in self._entries.values()]

    def get(self, worker_id: WorkerId) -> WorkerInfo | None:
        entry = self._entries.get(worker_id)
        return entry.info if entry else None

    def healthy_workers(self) -> list[WorkerStatus]:
        """The candidates: healthy workers, each with its last load."""
        return [
            WorkerStatus(e.info.worker_id, e.info.load, e.info.kv_events != "none")
            for e in self._entries.values()
            if e.info.healthy
        ]

    def report_failure(self, worker_id: WorkerId) -> None:
        """A request could not reach the worker: out of the candidates until a check passes."""
        entry = self._entries.get(worker_id)
        if entry is not None and entry.info.healthy:
            log.info("worker %s marked down after a failed request", worker_id)
            entry.failures = self.config.failures_to_evict
            entry.info = replace(entry.info, healthy=False)

    async def refresh(self) -> None:
        """One round: Redis discovery (if configured), then a health check of everyone."""
        if self._redis is not None:
            await self.discover()
        await asyncio.gather(*(self._check(e) for e in list(self._entries.values())))

    async def discover(self) -> None:
        """Add workers with a valid signed announcement, drop Redis-sourced ones whose
        key expired or no longer verifies."""
        if self._redis is None:
            return
        pattern = announcement_key(self.config.redis_prefix, "*")
        keys = [k async for k in self._redis.scan_iter(match=pattern, count=500)]
        bodies = await self._redis.mget(keys) if keys else []
        start = len(announcement_key(self.config.redis_prefix, ""))
        seen: set[WorkerId] = set()
        now = time.time()
        for key, body in zip(keys, bodies, strict=True):
            name = WorkerId((key.decode() if isinstance(key, bytes) else str(key))[start:])
            announced = parse_announcement(body, name, self._registration_token, now)
            if announced is None:
                self._note_refused(name, body)
                continue
            seen.add(name)
            if name not in self._entries:
                self._add(name, announced.url, "redis", announced.kv_events,
                          announced.instance_id, healthy=False)
        for worker_id in [w for w, e in self._entries.items() if e.info.source == "redis"]:
            if worker_id not in seen:
                log.info("worker %s left (heartbeat expired)", worker_id)
                del self._entries[worker_id]

    def _note_refused(self, name: str, body: bytes | str | None) -> None:
        """One WARNING per distinct refused record (a forged key is re-read every round)."""
        raw = body.encode() if isinstance(body, str) else body or b""
        digest = hashlib.sha256(raw).hexdigest()
        if self._refused.get(name) != digest:
            if len(self._refused) >= 10_000:
                self._refused.clear()
            self._refused[name] = digest
            log.warning("ignored the registration of worker %r: not signed with the worker "
                        "token, made for another name, or expired", name)

    async def run(
        self, stop: asyncio.Event, after_refresh: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Refresh every ``check_interval_s`` until ``stop`` is set, calling
        ``after_refresh`` (the gateway's pool follower) after each round."""
        outage = OutageLog(log, "worker registry refresh")  # one line per Redis outage
        while not stop.is_set():
            try:
                await self.refresh()
                if after_refresh is not None:
                    await after_refresh()
            except Exception as exc:  # a Redis outage must not kill the loop
                outage.failed(exc)
            else:
                outage.ok()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.check_interval_s)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    def _add(
        self,
        worker_id: WorkerId,
        url: str,
        source: Literal["static", "redis"],
        kv_events: EventTransport,
        instance_id: str | None,
        *,
        healthy: bool = True,
    ) -> None:
        info = WorkerInfo(
            worker_id, url.rstrip("/"), source, kv_events, healthy, WorkerLoad(), instance_id, 0
        )
        self._entries[worker_id] = _Entry(info)

    async def _check(self, entry: _Entry) -> None:
        try:
            load, instance_id, block_size = await self._probe(entry)
            restarted = instance_id is not None and instance_id != entry.info.instance_id
            if entry.probe == "load" and (entry.dtypes is None or restarted):
                entry.dtypes = await self._dtypes(entry)
        except (httpx.HTTPError, ValueError, TypeError, KeyError, OSError) as exc:
            entry.failures += 1
            if entry.info.healthy and entry.failures >= self.config.failures_to_evict:
                log.info("worker %s is down: %s", entry.info.worker_id, exc)
                entry.info = replace(entry.info, healthy=False)
            return
        if self._refuse_dtype_clash(entry):
            return
        info = entry.info
        came_back = not info.healthy
        incarnation = info.incarnation + 1 if came_back or restarted else info.incarnation
        entry.failures = 0
        entry.last_ok = time.monotonic()
        entry.info = replace(
            info,
            healthy=True,
            load=load,
            incarnation=incarnation,
            instance_id=instance_id or info.instance_id,
            block_size=block_size or info.block_size,
            kv_events="none" if entry.probe != "load" else info.kv_events,
        )

    async def _dtypes(self, entry: _Entry) -> dict[str, str]:
        """``GET /v1/models``: the dtype each model runs in (``data[i].kvtoll.dtype``)."""
        response = await self._http.get(f"{entry.info.url}/v1/models")
        if response.status_code == 404:  # no model list: nothing to compare
            return {}
        response.raise_for_status()
        found: dict[str, str] = {}
        for item in response.json()["data"]:
            extra = item.get("kvtoll") if isinstance(item, dict) else None
            dtype = extra.get("dtype") if isinstance(extra, dict) else None
            if dtype:
                found[str(item["id"])] = str(dtype)
        return found

    def _refuse_dtype_clash(self, entry: _Entry) -> bool:
        """Keep ``entry`` out of the candidates when it serves a model in another dtype
        than a worker already in the pool (one temperature-0 prompt would get two
        answers); the ERROR names both workers, once per clash. True if refused."""
        clash = None
        for other in self._entries.values():
            if other is entry or other.dtypes is None or other.refused is not None:
                continue
            for model, dtype in (entry.dtypes or {}).items():
                theirs = other.dtypes.get(model)
                if theirs is not None and theirs != dtype:
                    clash = (f"worker {entry.info.worker_id} ({entry.info.url}) serves {model} "
                             f"in {dtype} but worker {other.info.worker_id} ({other.info.url}) "
                             f"serves it in {theirs}: kept out of the pool; start it with "
                             f"--dtype {theirs}")
                    break
            if clash:
                break
        if clash is None:
            entry.refused = None
            return False
        if entry.refused != clash:
            log.error("%s", clash)
        entry.refused = clash
        entry.failures = 0
        if entry.info.healthy:
            entry.info = replace(entry.info, healthy=False)
        return True

    async def _probe(self, entry: _Entry) -> tuple[WorkerLoad, str | None, int | None]:
        """``GET /load``, falling back for servers without it (remembered per worker)."""
        url = entry.info.url
        if entry.probe == "load":
            response = await self._http.get(f"{url}/load")
            if response.status_code != 404:
                response.raise_for_status()
                body = response.json()
                size = body.get("block_size")
                return parse_load(body), body.get("instance_id"), int(size) if size else None
            entry.probe = "healthz"
        for probe in ("healthz", "health"):
            if entry.probe != probe:
                continue
            response = await self._http.get(f"{url}/{probe}")
            if response.status_code == 404 and probe == "healthz":
                entry.probe = "health"
                continue
            response.raise_for_status()
            return WorkerLoad(), None, None
        raise ValueError(f"{url} answers neither /load, /healthz nor /health")

