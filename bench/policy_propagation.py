"""How long a tenant policy change takes to reach every gateway and worker (issue 26: 5 s).

Two gateways (the real gateway app, each on its own port) share one billing database
(SQLite in a temporary directory, or ``--database-url``); each sends to its own kvtoll
worker (the real worker app and a tiny engine). Each trial, at a random moment, the
tenant's KV reservation is changed in the database
(:func:`billing.accounts.set_tenant_policy`, what ``kvtoll tenant policy NAME
--kv-reserved-blocks N`` runs) and the time is taken from that commit until each
worker's ``GET /load`` names the new ``reserved_blocks`` for the tenant.

By default tenant ``acme`` sends nothing (an idle tenant: the share can only arrive by
the gateways' push, :mod:`proxy.kv_policy_push`, one read and push a second).
``--traffic``: it keeps sending a small completion through each gateway every
``--interval`` seconds, so the share also travels with its requests
(``kvtoll_kv_share``, as fresh as the gateway's key cache, ``auth_cache_ttl_s``).

Prints one JSON object: every trial's two delays, their maximum, and the gateways'
key-cache lifetime.

    .venv/bin/python bench/policy_propagation.py --trials 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from billing import accounts, pricing
from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.serving.app import build_worker_app
from kvtoll.server import serve_in_background
from kvtoll.settings import load_settings
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig

TENANT = "acme"
ADMIN_TOKEN = "policy-propagation-admin-token-0123456789abcdef"


def _seed(factory: sessionmaker[Session], model: str) -> str:
    with factory.begin() as s:
        accounts.create_tenant(s, TENANT)
        _, key = accounts.create_key(s, TENANT)
        pricing.set_price(s, model, "1", "0.5", "2", "0.1")
        return key


def _set_reserved(factory: sessionmaker[Session], reserved: int) -> float:
    """Commit the new reservation; the clock reading right after the commit."""
    with factory.begin() as s:
        tenant = accounts.require_tenant(s, TENANT)
        accounts.set_tenant_policy(
            s, TENANT, semantic_threshold=tenant.semantic_threshold,
            semantic_allow_sampled=tenant.semantic_allow_sampled, kv_reserved_blocks=reserved,
            kv_max_blocks=tenant.kv_max_blocks,
        )
    return time.monotonic()


async def _reserved_on(worker: httpx.AsyncClient) -> int | None:
    load = (await worker.get("/load")).json()
    for t in load.get("tenants", []):
        if t.get("tenant") == TENANT:
            return int(t["reserved_blocks"])
    return None


async def _traffic(gateway: httpx.AsyncClient, key: str, model: str, interval: float,
                   offset: float, failures: list[str]) -> None:
    """After ``offset`` seconds, one small completion every ``interval`` seconds until
    cancelled (gateways offset from each other keep their key caches out of step)."""
    await asyncio.sleep(offset)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "prompt": "policy", "max_tokens": 1, "temperature": 0}
    while True:
        resp = await gateway.post("/v1/completions", json=body, headers=headers)
        if resp.status_code != 200:
            failures.append(f"{resp.status_code}: {resp.text[:200]}")
        await asyncio.sleep(interval)


async def _delay_until(worker: httpx.AsyncClient, reserved: int, since: float,
                       timeout_s: float) -> float | None:
    while time.monotonic() - since < timeout_s:
        if await _reserved_on(worker) == reserved:
            return time.monotonic() - since
        await asyncio.sleep(0.01)
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = ProxyConfig()
    with tempfile.TemporaryDirectory(prefix="kvtoll-policy-") as tmp:
        url = args.database_url or f"sqlite:///{Path(tmp) / 'kvtoll.db'}"
        upgrade(url)
        db_engine = make_engine(url)
        factory = session_factory(db_engine)
        engines = [build_engine(EngineConfig.tiny()) for _ in range(2)]
        model = engines[0].model_name
        key = _seed(factory, model)
        trials: list[list[float | None]] = []
        failures: list[str] = []
        try:
            async with AsyncExitStack() as stack:
                workers, gateways = [], []
                for i, engine in enumerate(engines):
                    worker_url = await stack.enter_async_context(
                        serve_in_background(build_worker_app(engine)))
                    settings = load_settings(
                        database_url=url, admin_token=ADMIN_TOKEN, secret="policy-bench",
                        data_dir=str(Path(tmp) / f"gateway{i}"), redis_url=None)
                    app = create_app(settings, session_factory=factory, models=[model],
                                     upstreams=[HttpUpstream(HttpUpstreamConfig(worker_url))],
                                     config=config, web=False)
                    # as deployed: the gateway's background loops (the share push) run
                    await stack.enter_async_context(app.router.lifespan_context(app))
                    gateway_url = await stack.enter_async_context(serve_in_background(app))
                    workers.append(await stack.enter_async_context(
                        httpx.AsyncClient(base_url=worker_url, timeout=30)))
                    gateways.append(await stack.enter_async_context(
                        httpx.AsyncClient(base_url=gateway_url, timeout=30)))
                half = config.auth_cache_ttl_s / 2
                senders = [asyncio.create_task(
                    _traffic(g, key, model, args.interval, i * half, failures))
                    for i, g in enumerate(gateways)] if args.traffic else []
                try:
                    await asyncio.sleep(len(gateways) * half)
                    for trial in range(args.trials):
                        await asyncio.sleep(rng.uniform(0, 2 * config.auth_cache_ttl_s))
                        since = _set_reserved(factory, trial + 1)
                        delays = await asyncio.gather(*(
                            _delay_until(w, trial + 1, since, args.timeout) for w in workers))
                        trials.append([None if d is None else round(d, 3) for d in delays])
                finally:
                    for task in senders:
                        task.cancel()
                    await asyncio.gather(*senders, return_exceptions=True)
        finally:
            for engine in engines:
                engine.shutdown()
            db_engine.dispose()
    seen = [d for t in trials for d in t if d is not None]
    return {
        "trials": trials,
        "max_s": max(seen) if seen else None,
        "all_reached": all(d is not None for t in trials for d in t),
        "auth_cache_ttl_s": config.auth_cache_ttl_s,
        "push_interval_s": config.kv_share_push_interval_s,
        "traffic": args.traffic,
        "request_interval_s": args.interval if args.traffic else None,
        "failed_requests": failures[:5],
        "num_failed_requests": len(failures),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--traffic", action="store_true", help="the tenant keeps sending")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between requests")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait per trial")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--database-url", default="", help="default: SQLite in a temporary dir")
    return ap


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(asyncio.run(run(build_parser().parse_args(argv))), indent=2))


if __name__ == "__main__":
    main()
