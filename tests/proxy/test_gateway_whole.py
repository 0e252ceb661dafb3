"""A non-streamed client's request through the gateway to HTTP upstreams (scripted
OpenAI-compatible servers in threads of their own) asked whole: the upstream gets
``stream: false``; usage, cached tokens, tier split, finish_reason, the ledger row, the
semantic store, error mapping and retries behave as on the streamed path; the wait is
bounded by the whole-response timeout, not the first-byte one."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus, ServedBy
from kvtoll.settings import Settings
from proxy.config import ProxyConfig
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig
from tests.proxy.helpers import MODEL, LiveServer, Tenants, build_app, settled_rows
from tests.proxy.test_gateway_flow import FakeSemantic
from tests.proxy.upstream.upstream_helpers import Script, chat_event, scripted_server

BODY: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "capital?"}]}
USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
         "prompt_tokens_details": {"cached_tokens": 4,
                                   "kvtoll_tier_cached_tokens": {"host": 4, "shared": 0}}}


def _whole(finish: str = "stop") -> dict[str, Any]:
    return {"id": "up", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                         "finish_reason": finish}], "usage": USAGE}


def _post(server: LiveServer, key: str, body: dict[str, Any] = BODY) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def _upstreams(stack: ExitStack, *scripts: Script) -> list[HttpUpstream]:
    """One HTTP upstream per script, each a scripted server on a free port."""
    return [HttpUpstream(HttpUpstreamConfig(stack.enter_context(
        LiveServer(scripted_server(s))).url, name=f"up-{i}")) for i, s in enumerate(scripts)]



def test_whole_answer_billed_and_rendered_as_streamed(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    script = Script(whole_json=_whole())
    semantic = FakeSemantic()
    with ExitStack() as stack:
        app = build_app(settings, db, upstreams=_upstreams(stack, script), semantic=semantic)
        with LiveServer(app) as server:
            response = _post(server, tenants.key_a)
            settled_rows(db, 1)  # the store runs after metering, in the background
            hit = _post(server, tenants.key_a)
    assert script.received[0]["stream"] is False and "stream_options" not in script.received[0]
    assert response.status_code == 200
    assert response.headers["x-kvtoll-cache"] == "prefix"
    assert response.headers["x-kvtoll-worker"] == "up-0"
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (9, 2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4
    assert usage["prompt_tokens_details"]["kvtoll_tier_cached_tokens"] == {"host": 4, "shared": 0}
    assert hit.headers["x-kvtoll-cache"] == "semantic"  # the complete answer was stored
    assert len(script.received) == 1
    rows = settled_rows(db, 2)
    row = next(r for r in rows if r.served_by is ServedBy.ENGINE)
    assert (row.status, row.worker) == (RequestStatus.OK, "up-0")
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (9, 4, 2)
    assert (row.tier_host_cached_tokens, row.tier_shared_cached_tokens) == (4, 0)
    assert row.ttft_ms is None and row.latency_ms  # no first token was seen on its own


def test_an_incomplete_whole_answer_is_not_stored(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    script = Script(whole_json=_whole(finish="length"))
    semantic = FakeSemantic()
    with ExitStack() as stack:
        app = build_app(settings, db, upstreams=_upstreams(stack, script), semantic=semantic)
        with LiveServer(app) as server:
            assert _post(server, tenants.key_a).json()["choices"][0]["finish_reason"] == "length"
            settled_rows(db, 1)
            assert _post(server, tenants.key_a).headers["x-kvtoll-cache"] != "semantic"
    assert semantic.answers == {} and len(script.received) == 2


def test_streamed_clients_still_stream_from_the_upstream(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    script = Script(events=[chat_event(0, "Paris."), chat_event(0, "", "stop"),
                            {"choices": [], "usage": USAGE}])
    with ExitStack() as stack:
        app = build_app(settings, db, upstreams=_upstreams(stack, script))
        server = stack.enter_context(LiveServer(app))
        response = _post(server, tenants.key_a, {**BODY, "stream": True})
    assert script.received[0]["stream"] is True
    assert script.received[0]["stream_options"] == {"include_usage": True}
    assert "Paris." in response.text and response.text.endswith("data: [DONE]\n\n")
    [row] = settled_rows(db, 1)
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (9, 4, 2)
    assert row.ttft_ms is not None


def test_a_whole_answer_may_take_longer_than_the_first_byte_timeout(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    slow = Script(whole_json=_whole(), delay_s=0.5)
    config = ProxyConfig(upstream_first_byte_timeout_s=0.1, upstream_response_timeout_s=10)
    with ExitStack() as stack:
        app = build_app(settings, db, upstreams=_upstreams(stack, slow), config=config)
        with LiveServer(app) as server:
            assert _post(server, tenants.key_a).status_code == 200
    [row] = settled_rows(db, 1)
    assert row.status is RequestStatus.OK


def test_a_silent_upstream_is_retried_on_the_next_before_anything_was_answered(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    silent, quick = Script(whole_json=_whole(), delay_s=3.0), Script(whole_json=_whole())
    config = ProxyConfig(upstream_response_timeout_s=0.3)
    with ExitStack() as stack:
        app = build_app(settings, db, upstreams=_upstreams(stack, silent, quick), config=config)
        with LiveServer(app) as server:
            response = _post(server, tenants.key_a)
            assert not app.state.kvtoll.pool.is_healthy("up-0")
    assert response.status_code == 200 and response.headers["x-kvtoll-worker"] == "up-1"
    assert silent.received[0] == quick.received[0]  # the same request, retried
    [row] = settled_rows(db, 1)
    assert (row.status, row.worker, row.completion_tokens) == (RequestStatus.OK, "up-1", 2)


def test_every_upstream_past_the_whole_response_timeout_is_504(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    silent = [Script(whole_json=_whole(), delay_s=3.0) for _ in range(2)]
    config = ProxyConfig(upstream_response_timeout_s=0.3)
    with ExitStack() as stack:
        app = build_app(settings, db, upstreams=_upstreams(stack, *silent), config=config)
        with LiveServer(app) as server:
            response = _post(server, tenants.key_a)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert response.headers["retry-after"] == "1"
    assert all(len(s.received) == 1 for s in silent)
    [row] = settled_rows(db, 1)
    assert row.status is RequestStatus.UPSTREAM_ERROR
    assert (row.prompt_tokens, row.completion_tokens, row.billed_pico) == (0, 0, 0)


def test_an_upstream_error_status_is_a_502_with_retry_after(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants
) -> None:
    failing = Script(status=503, error_body={"error": {"message": "overloaded"}})
    with ExitStack() as stack:
        app = build_app(settings, db, upstreams=_upstreams(stack, failing))
        server = stack.enter_context(LiveServer(app))
        response = _post(server, tenants.key_a)
    assert response.status_code == 502 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "upstream_unavailable"
    [row] = settled_rows(db, 1)
    assert (row.status, row.completion_tokens) == (RequestStatus.UPSTREAM_ERROR, 0)
