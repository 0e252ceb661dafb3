"""The gateway's KV share pusher (proxy.kv_policy_push): what it sends, to whom and
when, with a fake clock and fake workers; then end to end, a reservation set in the
database reaching a real tiny worker whose tenant sends nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from billing import accounts
from billing.accounts import KeyIdentity, TenantKVPolicy
from billing.db import make_engine, session_factory
from billing.migrate import upgrade
from billing.models import ApiKeyId, TenantId
from engine.api import KVShare
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import derive_tenant_salt
from engine.serving.app import build_worker_app
from kvtoll.server import serve_in_background
from proxy.kv_policy_push import KVSharePusher, request_share
from proxy.metrics import ProxyMetrics
from proxy.pool import UpstreamPool
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig

pytestmark = pytest.mark.anyio
SECRET = b"push-test-secret"


class _Worker:
    def __init__(self, name: str, answer: bool | None = True) -> None:
        self._name = name
        self.answer = answer
        self.pushes: list[list[dict[str, Any]]] = []

    @property
    def name(self) -> str:
        return self._name

    def stream(self, request: object) -> Any:
        raise NotImplementedError

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None

    async def push_kv_shares(self, shares: list[dict[str, Any]]) -> bool | None:
        self.pushes.append(shares)
        return self.answer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _salt(tenant_id: int) -> str:
    return derive_tenant_salt(SECRET, tenant_id).hex()


def _pusher(workers: list[_Worker], table: list[list[TenantKVPolicy]],
            clock: _Clock) -> KVSharePusher:
    pool = UpstreamPool(workers, ProxyMetrics.create())  # type: ignore[arg-type]
    return KVSharePusher(lambda: table[0], pool, SECRET, refresh_s=5.0, clock=clock)


async def test_pushes_on_change_and_every_refresh_and_resets_a_dropped_tenant() -> None:
    w1, w2 = _Worker("w1"), _Worker("w2")
    clock = _Clock()
    table = [[TenantKVPolicy(TenantId(1), "acme", 8, None)]]
    pusher = _pusher([w1, w2], table, clock)
    await pusher.tick()
    acme = {"cache_salt": _salt(1), "tenant": "acme", "reserved_blocks": 8, "max_blocks": None}
    assert w1.pushes == w2.pushes == [[acme]]
    clock.now += 1
    await pusher.tick()  # unchanged, not due
    assert len(w1.pushes) == 1
    table[0] = [TenantKVPolicy(TenantId(2), "bolt", 2, 4)]
    await pusher.tick()  # changed: acme goes back to the default, bolt joins
    bolt = {"cache_salt": _salt(2), "tenant": "bolt", "reserved_blocks": 2, "max_blocks": 4}
    expected = sorted([{**acme, "reserved_blocks": 0}, bolt], key=lambda e: e["cache_salt"])
    assert w1.pushes[-1] == w2.pushes[-1] == expected
    clock.now += 4.9
    await pusher.tick()
    assert len(w1.pushes) == 2
    clock.now += 0.1  # refresh_s since the last accepted push: a restarted worker gets it
    await pusher.tick()
    assert len(w1.pushes) == 3 and w1.pushes[-1] == expected


def _identity(tenant_id: int, name: str, reserved: int, cap: int | None) -> KeyIdentity:
    return KeyIdentity(ApiKeyId("key-1"), TenantId(tenant_id), name, None, None, None, False,
                       reserved, cap)  # fmt: skip


async def test_a_request_carries_the_pushed_share_not_an_older_cached_one() -> None:
    """The key's policy may be cached for the auth TTL (seconds); the table is read every
    interval: where the table has the tenant, its reading wins, so a request never puts
    back on a worker a share older than the pushed one."""
    clock = _Clock()
    table = [[TenantKVPolicy(TenantId(1), "acme", 8, 16)]]
    pusher = _pusher([_Worker("w1")], table, clock)
    salt_1, salt_2 = (derive_tenant_salt(SECRET, t) for t in (1, 2))
    stale = _identity(1, "acme", 2, None)  # the policy as the auth cache last saw it
    assert request_share(stale, salt_1, pusher) == KVShare("acme", 2, None)  # nothing read
    await pusher.tick()
    assert pusher.share_of(salt_1) == (8, 16)
    assert request_share(stale, salt_1, pusher) == KVShare("acme", 8, 16)
    table[0] = []  # acme set back to the default
    await pusher.tick()
    assert request_share(stale, salt_1, pusher) == KVShare("acme", 0, None)
    bolt = _identity(2, "bolt", 3, 5)  # a tenant the table never had: the key's policy
    assert pusher.share_of(salt_2) is None
    assert request_share(bolt, salt_2, pusher) == KVShare("bolt", 3, 5)
    assert request_share(bolt, salt_2, None) == KVShare("bolt", 3, 5)


async def test_a_failed_push_is_retried_and_a_non_kvtoll_upstream_is_left_alone() -> None:
    flaky, other = _Worker("flaky", answer=False), _Worker("vllm", answer=None)
    clock = _Clock()
    pusher = _pusher([flaky, other], [[TenantKVPolicy(TenantId(1), "acme", 8, None)]], clock)
    await pusher.tick()
    await pusher.tick()
    assert len(flaky.pushes) == 2 and len(other.pushes) == 1
    flaky.answer = True
    await pusher.tick()
    await pusher.tick()
    assert len(flaky.pushes) == 3


async def test_nothing_to_push_sends_nothing() -> None:
    worker = _Worker("w")
    pusher = _pusher([worker], [[]], _Clock())
    await pusher.tick()
    assert worker.pushes == []


async def test_a_reservation_reaches_an_idle_tenants_worker(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvtoll.db'}"
    upgrade(url)
    factory = session_factory(make_engine(url))
    with factory.begin() as s:
        tenant = accounts.create_tenant(s, "acme")
        accounts.set_tenant_policy(s, "acme", semantic_threshold=None,
                                   semantic_allow_sampled=False, kv_reserved_blocks=6)
        tenant_id = tenant.id

    def read() -> list[TenantKVPolicy]:
        with factory() as session:
            return accounts.kv_policies(session)

    assert read() == [TenantKVPolicy(TenantId(tenant_id), "acme", 6, None)]
    engine = build_engine(EngineConfig.tiny(num_kv_blocks=32))
    try:
        async with serve_in_background(build_worker_app(engine)) as base:
            upstream = HttpUpstream(HttpUpstreamConfig(base))
            pool = UpstreamPool([upstream], ProxyMetrics.create())
            await KVSharePusher(read, pool, SECRET).tick()
            for _ in range(1000):  # the step thread applies it before its next step
                if engine.load().tenants:
                    break
                await asyncio.sleep(0.01)
            [load] = engine.load().tenants
            assert (load.tenant, load.reserved_blocks) == ("acme", 6)
            salt = derive_tenant_salt(SECRET, tenant_id)
            assert engine.engine.kv.pool.tenants.get(salt).share.reserved_blocks == 6
            await upstream.aclose()
    finally:
        engine.shutdown()


