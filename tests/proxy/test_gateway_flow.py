"""The request flow around upstreams and hooks: retries only before the first byte,
failures metered once, semantic-cache and router hooks called as documented, metrics."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import httpx
import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus, ServedBy
from kvtoll.settings import Settings
from proxy.config import ProxyConfig
from proxy.semantic.types import SemanticAnswer, SemanticHit, SemanticQuery
from proxy.upstream.base import Upstream, UpstreamRequest, UpstreamUsage
from tests.proxy.helpers import ADMIN, MODEL, LiveServer, Tenants, build_app, settled_rows
from tests.proxy.scripted import ScriptedUpstream

BODY: dict[str, object] = {"model": MODEL,
                           "messages": [{"role": "user", "content": "hello there"}]}


def _post(server: LiveServer, key: str, body: dict[str, object] = BODY,
          headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def test_retry_on_next_upstream_before_first_byte(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    down = ScriptedUpstream("down-0", fail_before_first=True)
    up = ScriptedUpstream("up-1")
    with LiveServer(build_app(settings, db, upstreams=[down, up])) as server:
        response = _post(server, tenants.key_a)
        assert response.status_code == 200
        assert response.headers["x-kvtoll-worker"] == "up-1"
        assert len(down.seen) == 1 and len(up.seen) == 1
        assert down.seen[0].request_id == up.seen[0].request_id  # same request, retried
        second = _post(server, tenants.key_a)  # the failed one is now marked unhealthy
        assert second.headers["x-kvtoll-worker"] == "up-1" and len(down.seen) == 1
        metrics = httpx.get(server.url + "/metrics", headers=ADMIN).text
        assert 'kvtoll_upstream_healthy{upstream="down-0"} 0.0' in metrics
    rows = settled_rows(db, 2)
    assert {r.worker for r in rows} == {"up-1"}


def test_no_retry_after_first_byte_and_row_with_tokens_so_far(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    broken = ScriptedUpstream("broken-0", num_words=10, fail_after_words=3)
    spare = ScriptedUpstream("spare-1")
    app = build_app(settings, db, upstreams=[broken, spare])
    with LiveServer(app) as server:
        plain = _post(server, tenants.key_a)
        assert plain.status_code == 502
        assert plain.json()["error"]["code"] == "upstream_error"
        assert plain.headers["x-request-id"] == plain.headers["x-kvtoll-request-id"]
        assert plain.headers["retry-after"] == "1"
        assert spare.seen == []  # not retried once tokens flowed
        # the worker that failed mid-request is down at once: the next one goes around it
        assert not app.state.kvtoll.pool.is_healthy("broken-0")
        assert _post(server, tenants.key_a).status_code == 200
        assert len(spare.seen) == 1
    rows = settled_rows(db, 2)
    cut = next(r for r in rows if r.status is RequestStatus.UPSTREAM_ERROR)
    assert (cut.completion_tokens, cut.cut) == (3, True)
    assert cut.prompt_tokens > 0


def test_stream_cut_mid_way_ends_with_error_event_and_done(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    broken = ScriptedUpstream("broken-0", num_words=10, fail_after_words=3)
    with LiveServer(build_app(settings, db, upstreams=[broken])) as server:
        streamed = _post(server, tenants.key_a, {**BODY, "stream": True})
        assert streamed.status_code == 200
        assert '"code":"upstream_error"' in streamed.text
        assert streamed.text.endswith("data: [DONE]\n\n")
        assert streamed.text.count("word") == 3
    [row] = settled_rows(db, 1)
    assert row.status is RequestStatus.UPSTREAM_ERROR
    assert (row.completion_tokens, row.cut) == (3, True)


def test_all_upstreams_down_is_502_with_one_unbilled_row(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    upstreams = [ScriptedUpstream(f"down-{i}", fail_before_first=True) for i in range(2)]
    with LiveServer(build_app(settings, db, upstreams=upstreams)) as server:
        response = _post(server, tenants.key_a)
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_unavailable"
        assert httpx.get(server.url + "/readyz").status_code == 503
    [row] = settled_rows(db, 1)
    assert row.status is RequestStatus.UPSTREAM_ERROR
    assert (row.prompt_tokens, row.completion_tokens, row.billed_pico) == (0, 0, 0)


class FakeSemantic:
    """Stands in for the semantic cache: answers prompts it was given to store."""

    def __init__(self) -> None:
        self.answers: dict[tuple[int, str], SemanticAnswer] = {}
        self.lookups: list[SemanticQuery] = []

    @staticmethod
    def _key(query: SemanticQuery) -> tuple[int, str]:
        return query.tenant_id, str(query.body["messages"])

    async def lookup(self, query: SemanticQuery) -> SemanticHit | None:
        self.lookups.append(query)
        found = self.answers.get(self._key(query))
        if found is None:
            return None
        return SemanticHit(choices=found.choices, similarity=0.97,
                           completion_tokens=found.completion_tokens)

    async def store(self, query: SemanticQuery, answer: SemanticAnswer) -> None:
        self.answers[self._key(query)] = answer


def test_semantic_hook_hit_miss_and_cache_control(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    semantic, upstream = FakeSemantic(), ScriptedUpstream()
    with LiveServer(build_app(settings, db, upstreams=[upstream], semantic=semantic)) as server:
        first = _post(server, tenants.key_a)
        assert first.headers["x-kvtoll-cache"] == "miss"
        settled_rows(db, 1)  # stores happen after metering, in the background
        hit = _post(server, tenants.key_a)
        assert hit.headers["x-kvtoll-cache"] == "semantic"
        assert hit.headers["x-kvtoll-similarity"] == "0.9700"
        assert "x-kvtoll-worker" not in hit.headers
        assert hit.json()["choices"][0]["message"]["content"] == "word0 word1 word2 word3 word4 "
        usage = hit.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
        other_tenant = _post(server, tenants.key_b)
        assert other_tenant.headers["x-kvtoll-cache"] == "miss"
        bypass = _post(server, tenants.key_a, headers={"Cache-Control": "no-cache"})
        assert bypass.headers["x-kvtoll-cache"] == "bypass"
        streamed = _post(server, tenants.key_a, {**BODY, "stream": True})
        assert streamed.headers["x-kvtoll-cache"] == "semantic"
        assert "word4" in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
        metrics = httpx.get(server.url + "/metrics", headers=ADMIN).text
    assert len(upstream.seen) == 3
    assert len(semantic.lookups) == 4  # no lookup for no-cache
    assert all(q.tenant_id in (tenants.tenant_a, tenants.tenant_b) for q in semantic.lookups)
    rows = settled_rows(db, 5)
    semantic_rows = [r for r in rows if r.served_by is ServedBy.SEMANTIC]
    assert len(semantic_rows) == 2 and all(r.similarity == 0.97 for r in semantic_rows)
    engine_row = next(r for r in rows if r.served_by is ServedBy.ENGINE)
    assert semantic_rows[0].billed_pico < engine_row.billed_pico  # 10% of list
    assert semantic_rows[0].billed_pico == semantic_rows[0].list_pico // 10
    assert 'kvtoll_cache_hit_ratio{layer="semantic"} 0.5' in metrics
    assert 'kvtoll_tokens_total{kind="completion",layer="semantic"} 10.0' in metrics


class StalledSemantic(FakeSemantic):
    """A semantic cache whose stores wait until released (embedding falling behind)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = 0

    async def store(self, query: SemanticQuery, answer: SemanticAnswer) -> None:
        self.started += 1
        while not self.release.is_set():
            await asyncio.sleep(0.005)
        await super().store(query, answer)


def test_stores_beyond_the_pending_cap_are_shed_and_the_answers_still_served(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    semantic, upstream = StalledSemantic(), ScriptedUpstream()
    app = build_app(settings, db, upstreams=[upstream], semantic=semantic,
                    config=ProxyConfig(max_pending_cache_stores=2))
    with LiveServer(app) as server:
        try:
            for n in range(5):
                body = {**BODY, "messages": [{"role": "user", "content": f"question {n}"}]}
                assert _post(server, tenants.key_a, body).status_code == 200
            metrics = httpx.get(server.url + "/metrics", headers=ADMIN).text
            assert semantic.started == 2 and not semantic.answers
            assert "kvtoll_semantic_stores_shed_total 3.0" in metrics
        finally:
            semantic.release.set()
        for _ in range(200):  # the two waiting stores complete once released
            if len(semantic.answers) == 2:
                break
            time.sleep(0.01)
        assert len(semantic.answers) == 2
    assert len(settled_rows(db, 5)) == 5  # every answer metered once


class RecordingRouter:
    """Stands in for the prefix router: reverses the order and records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def rank(self, candidates: Sequence[Upstream],
             request: UpstreamRequest) -> list[Upstream]:
        self.calls.append(("rank", ",".join(u.name for u in candidates)))
        return list(reversed(candidates))

    def started(self, upstream: Upstream, request: UpstreamRequest) -> None:
        self.calls.append(("started", upstream.name))

    def release(self, upstream: Upstream, request: UpstreamRequest,
                usage: UpstreamUsage | None = None) -> None:
        self.calls.append(("release", f"{upstream.name}:{usage and usage.completion_tokens}"))


def test_router_hook_orders_upstreams(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    router = RecordingRouter()
    upstreams = [ScriptedUpstream("a"), ScriptedUpstream("b")]
    with LiveServer(build_app(settings, db, upstreams=upstreams, router=router)) as server:
        assert _post(server, tenants.key_a).headers["x-kvtoll-worker"] == "b"
    assert router.calls == [("rank", "a,b"), ("started", "b"), ("release", "b:5")]


def test_metrics_exposition(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    with LiveServer(build_app(settings, db, upstreams=[ScriptedUpstream()])) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=tenants.key_a,
                               max_retries=0)
        list(client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "x"}], stream=True))
        client.completions.create(model=MODEL, prompt="x")
        text = httpx.get(server.url + "/metrics", headers=ADMIN).text
    for needle in (
        'kvtoll_requests_total{cache="miss",endpoint="chat",outcome="ok"} 1.0',
        'kvtoll_requests_total{cache="miss",endpoint="completions",outcome="ok"} 1.0',
        'kvtoll_tokens_total{kind="completion",layer="compute"} 10.0',
        'kvtoll_request_latency_seconds_count{endpoint="chat"} 1.0',
        'kvtoll_time_to_first_token_seconds_count{endpoint="completions"} 1.0',
        "kvtoll_ratelimit_fallback 0.0",
        "kvtoll_outbox_depth",
        'kvtoll_cache_hit_ratio{layer="prefix"} 0.0',
    ):
        assert needle in text, needle


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_health_endpoints(settings: Settings, db: sessionmaker[Session], path: str) -> None:
    with LiveServer(build_app(settings, db, upstreams=[ScriptedUpstream()])) as server:
        response = httpx.get(server.url + path)
    assert response.status_code == 200


def test_every_upstream_silent_is_504_with_retry_after(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    silent = [ScriptedUpstream(f"silent-{i}", delay_s=5.0) for i in range(2)]
    config = ProxyConfig(upstream_first_byte_timeout_s=0.1)
    with LiveServer(build_app(settings, db, upstreams=silent, config=config)) as server:
        response = _post(server, tenants.key_a)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert response.headers["retry-after"] == "1"
    assert all(len(u.seen) == 1 for u in silent)  # each tried once, then marked down
