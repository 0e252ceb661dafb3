"""Key authentication: 401s in OpenAI's shape, the TTL cache and revocation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing import accounts
from billing.keys import generate_key
from kvtoll.settings import Settings
from proxy.auth import AuthError, KeyAuthenticator
from proxy.config import ProxyConfig
from tests.proxy.helpers import MODEL, LiveServer, Tenants, build_app
from tests.proxy.scripted import ScriptedUpstream


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingFactory:
    """Wraps a session factory to count (or fail) the lookups auth makes."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self.calls = 0
        self.fail = False

    def __call__(self) -> Session:
        self.calls += 1
        if self.fail:
            raise ConnectionError("database unreachable")
        return self.factory()


def _auth(factory: CountingFactory, clock: Clock, ttl_s: float = 5.0) -> KeyAuthenticator:
    return KeyAuthenticator(factory, ttl_s=ttl_s, clock=clock)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "header",
    [None, "", "Basic abc", "Bearer", "Bearer kvt_short", "Bearer sk-" + "a" * 46],
)
def test_missing_or_malformed_never_queries(
    db: sessionmaker[Session], header: str | None
) -> None:
    counting = CountingFactory(db)
    with pytest.raises(AuthError) as err:
        _auth(counting, Clock()).authenticate(header)
    assert err.value.status == 401
    assert counting.calls == 0


def test_checksum_typo_is_rejected_before_lookup(
    db: sessionmaker[Session], tenants: Tenants
) -> None:
    typo = tenants.key_a[:10] + ("A" if tenants.key_a[10] != "A" else "B") + tenants.key_a[11:]
    counting = CountingFactory(db)
    with pytest.raises(AuthError):
        _auth(counting, Clock()).authenticate(f"Bearer {typo}")
    assert counting.calls == 0


def test_unknown_key_is_401_and_cached(db: sessionmaker[Session], tenants: Tenants) -> None:
    counting, clock = CountingFactory(db), Clock()
    auth = _auth(counting, clock)
    unknown = f"Bearer {generate_key()}"
    for _ in range(3):
        with pytest.raises(AuthError):
            auth.authenticate(unknown)
    assert counting.calls == 1


def test_revoked_key_stops_within_ttl(db: sessionmaker[Session], tenants: Tenants) -> None:
    counting, clock = CountingFactory(db), Clock()
    auth = _auth(counting, clock, ttl_s=5.0)
    header = f"Bearer {tenants.key_a}"
    assert auth.authenticate(header).tenant_id == tenants.tenant_a
    with db.begin() as session:
        accounts.revoke_key(session, tenants.key_a_id)
    clock.now += 4.9
    assert auth.authenticate(header).key_id == tenants.key_a_id  # still cached (documented)
    clock.now += 0.2
    with pytest.raises(AuthError):
        auth.authenticate(header)


class SlowFactory(CountingFactory):
    """A lookup that takes ``lag_s`` of the (fake) clock to answer."""

    def __init__(self, factory: sessionmaker[Session], clock: Clock, lag_s: float) -> None:
        super().__init__(factory)
        self.clock, self.lag_s = clock, lag_s

    def __call__(self) -> Session:
        self.clock.now += self.lag_s
        return super().__call__()


def test_ttl_counts_from_when_the_lookup_started(
    db: sessionmaker[Session], tenants: Tenants
) -> None:
    """The gateway's path (resolve): a slow database answer is as old as the query that
    fetched it, so a revocation or policy change reaches it within ttl_s of the query,
    not ttl_s after the answer landed."""
    clock = Clock()
    slow = SlowFactory(db, clock, lag_s=1.5)
    auth = _auth(slow, clock, ttl_s=5.0)
    header = f"Bearer {tenants.key_a}"
    started = clock.now
    assert asyncio.run(auth.resolve(header)).tenant_id == tenants.tenant_a
    with db.begin() as session:
        accounts.revoke_key(session, tenants.key_a_id)
    slow.lag_s = 0.0
    clock.now = started + 5.01  # 3.5 s after the answer landed, 5 s after it was asked
    with pytest.raises(AuthError):
        asyncio.run(auth.resolve(header))


def test_database_outage_uses_last_known_answer(
    db: sessionmaker[Session], tenants: Tenants
) -> None:
    counting, clock = CountingFactory(db), Clock()
    auth = _auth(counting, clock)
    known = f"Bearer {tenants.key_a}"
    auth.authenticate(known)
    counting.fail = True
    clock.now += 60
    assert auth.authenticate(known).tenant_id == tenants.tenant_a
    with pytest.raises(AuthError) as err:
        auth.authenticate(f"Bearer {tenants.key_b}")
    assert err.value.status == 503


@pytest.fixture
def server(settings: Settings, db: sessionmaker[Session], tenants: Tenants) -> Iterator[LiveServer]:
    config = ProxyConfig(auth_cache_ttl_s=0.0)
    with LiveServer(build_app(settings, db, upstreams=[ScriptedUpstream()], config=config)) as s:
        yield s


def test_http_401_cases(server: LiveServer, db: sessionmaker[Session], tenants: Tenants) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    url = server.url + "/v1/chat/completions"
    cases = {
        "missing": {},
        "malformed": {"Authorization": "Bearer kvt_nope"},
        "unknown": {"Authorization": f"Bearer {generate_key()}"},
    }
    for headers in cases.values():
        response = httpx.post(url, json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    good = {"Authorization": f"Bearer {tenants.key_a}"}
    assert httpx.post(url, json=body, headers=good).status_code == 200
    with db.begin() as session:
        accounts.revoke_key(session, tenants.key_a_id)
    revoked = httpx.post(url, json=body, headers=good)
    assert revoked.status_code == 401
    assert revoked.json()["error"]["type"] == "invalid_request_error"
    other = {"Authorization": f"Bearer {tenants.key_b}"}
    assert httpx.post(url, json=body, headers=other).status_code == 200


class BlockingFactory(CountingFactory):
    """A key store that hangs (as a blackholed database does) until released."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        super().__init__(factory)
        import threading

        self.hang = False
        self.release = threading.Event()

    def __call__(self) -> Session:
        if self.hang:
            self.calls += 1
            self.release.wait(30)
            raise ConnectionError("no answer")
        return super().__call__()


def test_concurrent_lookups_of_one_key_are_single_flight(
    db: sessionmaker[Session], tenants: Tenants
) -> None:
    counting = CountingFactory(db)
    auth = KeyAuthenticator(counting, clock=Clock())  # type: ignore[arg-type]

    async def many() -> set[int]:
        found = await asyncio.gather(*(auth.resolve(f"Bearer {tenants.key_a}")
                                       for _ in range(20)))
        return {identity.tenant_id for identity in found}

    assert asyncio.run(many()) == {tenants.tenant_a}
    assert counting.calls == 1


def test_hanging_store_serves_known_keys_and_503s_unknown(
    db: sessionmaker[Session], tenants: Tenants
) -> None:
    store, clock = BlockingFactory(db), Clock()
    auth = KeyAuthenticator(store, ttl_s=5.0, clock=clock, wait_s=0.2,  # type: ignore[arg-type]
                            revalidate_wait_s=0.05)
    known = f"Bearer {tenants.key_a}"

    async def scenario() -> None:
        assert (await auth.resolve(known)).tenant_id == tenants.tenant_a
        store.hang = True
        clock.now += 60  # expired: the re-check hangs, the last answer is served
        for _ in range(5):
            assert (await auth.resolve(known)).tenant_id == tenants.tenant_a
        with pytest.raises(AuthError) as refused:
            await auth.resolve(f"Bearer {tenants.key_b}")
        assert refused.value.status == 503
        auth.close()

    try:
        asyncio.run(scenario())
    finally:
        store.release.set()
    assert store.calls == 3  # the first lookup, one re-check shared by five, one unknown
