"""HttpUpstream against real servers on free ports: a kvtoll worker with the tiny
engine, and a scripted OpenAI-compatible server for third-party behaviour."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from engine.api import KVShare
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import TenantSalt, derive_tenant_salt
from engine.serving.app import build_worker_app
from kvtoll.openai.responses import TierCachedTokens
from kvtoll.server import serve_in_background
from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamError,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
)
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig
from tests.proxy.upstream.upstream_helpers import Script, SpyEngine, chat_event, scripted_server

pytestmark = pytest.mark.anyio
SALT_A = derive_tenant_salt(b"secret", "tenant-a")
SALT_B = derive_tenant_salt(b"secret", "tenant-b")
LONG = "You are a careful assistant. Answer briefly and cite sources. " * 2


def _req(
    body: dict[str, Any], salt: TenantSalt = SALT_A, kind: str = "chat", rid: str = "r1"
) -> UpstreamRequest:
    return UpstreamRequest(rid, kind, "kvtoll-tiny", body, salt)  # type: ignore[arg-type]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "kvtoll-tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


async def _run(up: HttpUpstream, req: UpstreamRequest) -> tuple[list[UpstreamDelta], UpstreamUsage]:
    items = [item async for item in up.stream(req)]
    assert isinstance(items[-1], UpstreamUsage)
    assert all(isinstance(i, UpstreamDelta) for i in items[:-1])
    return items[:-1], items[-1]  # type: ignore[return-value]


@pytest.fixture
async def spy() -> AsyncIterator[SpyEngine]:
    engine: AsyncEngine = build_engine(EngineConfig.tiny(max_n=2))
    yield SpyEngine(engine)
    engine.shutdown()


@pytest.fixture
async def worker(spy: SpyEngine) -> AsyncIterator[HttpUpstream]:
    async with serve_in_background(build_worker_app(spy)) as url:
        up = HttpUpstream(HttpUpstreamConfig(url + "/v1/"))
        yield up
        await up.aclose()


async def test_chat_stream_from_worker(worker: HttpUpstream, spy: SpyEngine) -> None:
    deltas, usage = await _run(worker, _req(_chat(max_tokens=5, ignore_eos=True, n=2)))
    assert {d.index for d in deltas} == {0, 1}
    assert sorted(d.finish_reason for d in deltas if d.finish_reason) == ["length", "length"]
    assert usage.completion_tokens == 10 and usage.prompt_tokens > 0 and usage.extra == {}
    assert spy.requests[0].salt == SALT_A
    assert worker.name.endswith(str(worker.config.root().rsplit(":", 1)[1]))


async def test_completion_kind(worker: HttpUpstream) -> None:
    body = {"model": "kvtoll-tiny", "prompt": "abc", "max_tokens": 3, "ignore_eos": True}
    deltas, usage = await _run(worker, _req(body, kind="completion"))
    assert usage.completion_tokens == 3 and deltas[-1].finish_reason == "length"


async def test_salt_isolation_and_client_salt_ignored(worker: HttpUpstream, spy: SpyEngine) -> None:
    body = {"model": "kvtoll-tiny", "prompt": LONG, "max_tokens": 1, "cache_salt": "ff" * 16}

    async def cached(salt: TenantSalt) -> int:
        return (await _run(worker, _req(body, salt, "completion")))[1].cached_tokens

    assert await cached(SALT_A) == 0
    assert await cached(SALT_A) > 0
    assert await cached(SALT_B) == 0
    assert {r.salt for r in spy.requests} == {SALT_A, SALT_B}


async def test_worker_rejections_are_upstream_rejected(worker: HttpUpstream) -> None:
    with pytest.raises(UpstreamRejected) as info:
        await _run(worker, _req(_chat(max_tokens=1000)))
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    with pytest.raises(UpstreamRejected) as info:
        await _run(worker, _req(_chat(n=3)))
    assert info.value.param == "n"


async def test_closing_the_stream_aborts_the_worker_request(
    worker: HttpUpstream, spy: SpyEngine
) -> None:
    spy.chunk_delay_s = 0.02
    stream = worker.stream(_req(_chat(max_tokens=200, ignore_eos=True)))
    first = await anext(stream)
    assert isinstance(first, UpstreamDelta)
    await stream.aclose()
    for _ in range(500):
        if spy.closed_early:
            break
        await asyncio.sleep(0.01)
    assert spy.closed_early == [spy.requests[0].request_id]


async def test_health(worker: HttpUpstream) -> None:
    assert await worker.health() is True
    dead = HttpUpstream(HttpUpstreamConfig("http://127.0.0.1:9", connect_timeout_s=1))
    assert await dead.health() is False
    with pytest.raises(UpstreamError) as info:
        await _run(dead, _req(_chat()))
    assert info.value.retryable and info.value.status == 502
    await dead.aclose()


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
async def third_party(script: Script) -> AsyncIterator[HttpUpstream]:
    async with serve_in_background(scripted_server(script)) as url:
        cfg = HttpUpstreamConfig(
            url, api_key="sk-up", model="served-name", send_salt=False, read_timeout_s=0.5
        )
        up = HttpUpstream(cfg)
        yield up
        await up.aclose()


async def test_request_body_forces_streaming_usage_and_overrides(
    third_party: HttpUpstream, script: Script
) -> None:
    script.events = [chat_event(0, None), chat_event(0, "Hi"), chat_event(0, "", "stop")]
    await _run(third_party, _req(_chat(stream=False, cache_salt="ab")))
    sent = script.received[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["model"] == "served-name" and "cache_salt" not in sent
    assert script.headers[0]["authorization"] == "Bearer sk-up"
    assert script.headers[0]["x-request-id"] == "r1"


async def test_salt_sent_as_hex_by_default(worker: HttpUpstream) -> None:
    assert worker.request_body(_req(_chat(cache_salt="00")))["cache_salt"] == SALT_A.hex()


async def test_kv_share_travels_beside_the_salt_and_a_client_one_is_dropped(
    worker: HttpUpstream, third_party: HttpUpstream
) -> None:
    forged = {"tenant": "x", "reserved_blocks": 10**6}
    req = replace(_req(_chat(kvtoll_kv_share=forged)), kv_share=KVShare("acme", 64, 128))
    sent = worker.request_body(req)
    assert sent["kvtoll_kv_share"] == {"tenant": "acme", "reserved_blocks": 64, "max_blocks": 128}
    assert "kvtoll_kv_share" not in third_party.request_body(req)  # send_salt=False
    assert "kvtoll_kv_share" not in worker.request_body(_req(_chat(kvtoll_kv_share=forged)))


async def test_missing_usage_is_estimated(third_party: HttpUpstream, script: Script) -> None:
    script.events = [
        chat_event(0, None),
        chat_event(0, "Hel"),
        chat_event(0, "lo"),
        chat_event(0, None, "stop"),
    ]
    body = _chat(messages=[{"role": "user", "content": "x" * 40}])
    deltas, usage = await _run(third_party, _req(body))
    assert [d.text for d in deltas] == ["Hel", "lo", ""]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (10, 2, 0)
    assert usage.extra["estimated"] is True
    req = UpstreamRequest("r", "chat", "m", body, SALT_A, prompt_token_ids=(1, 2, 3))
    assert (await _run(third_party, req))[1].prompt_tokens == 3


async def test_text_that_is_not_utf8_reads_as_replacement_characters(
    third_party: HttpUpstream, script: Script
) -> None:
    """A malformed UTF-8 sequence in an event is U+FFFD, as a replacing text decoder
    reads it, not a broken stream."""
    script.events = [b'{"choices": [{"index": 0, "delta": {"content": "a\xffb"}}]}',
                     chat_event(0, "\u00e9", "stop")]
    deltas, _ = await _run(third_party, _req(_chat()))
    assert [d.text for d in deltas] == ["a\ufffdb", "\u00e9"]


async def test_reported_usage_without_cached_details(
    third_party: HttpUpstream, script: Script
) -> None:
    script.events = [
        chat_event(0, "a", "stop"),
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}},
    ]
    usage = (await _run(third_party, _req(_chat())))[1]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (7, 1, 0)
    assert usage.extra == {"cached_tokens_reported": False}


async def test_an_upstream_without_cached_details_is_warned_about_once(
    third_party: HttpUpstream, script: Script, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM without --enable-prompt-tokens-details (SGLang without --enable-cache-report):
    one WARNING naming the flags at the first such response, and the finding stays."""
    with_details = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1,
                                             "prompt_tokens_details": {"cached_tokens": 0}}}
    script.events = [chat_event(0, "a", "stop"), with_details]
    await _run(third_party, _req(_chat()))
    assert third_party.usage_problem() is None
    script.events = [chat_event(0, "a", "stop"),
                     {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}]
    with caplog.at_level("WARNING", logger="proxy.upstream.usage_report"):
        for _ in range(3):
            await _run(third_party, _req(_chat()))
    warned = [r.getMessage() for r in caplog.records if r.name == "proxy.upstream.usage_report"]
    assert len(warned) == 1 and "--enable-prompt-tokens-details" in warned[0]
    assert "--enable-cache-report" in warned[0] and third_party.name in warned[0]
    assert third_party.usage_problem() == warned[0]


async def test_kvtoll_workers_report_cached_details(worker: HttpUpstream) -> None:
    await _run(worker, _req(_chat(max_tokens=2)))
    assert worker.usage_problem() is None


@pytest.mark.parametrize(
    ("tier", "expected"),
    [
        ({"host": 16, "shared": 32}, TierCachedTokens(16, 32)),
        ({"host": 64, "shared": 64}, TierCachedTokens(48, 0)),  # clamped to cached_tokens
        ({"host": "16"}, None),  # malformed: ignored, the request is still billed
        (None, None),
    ],
)
async def test_reported_tier_cached_tokens(
    third_party: HttpUpstream, script: Script, tier: object, expected: TierCachedTokens | None
) -> None:
    details: dict[str, object] = {"cached_tokens": 48}
    if tier is not None:
        details["kvtoll_tier_cached_tokens"] = tier
    script.events = [
        chat_event(0, "a", "stop"),
        {"choices": [], "usage": {"prompt_tokens": 60, "completion_tokens": 1,
                                  "prompt_tokens_details": details}},
    ]
    usage = (await _run(third_party, _req(_chat())))[1]
    assert (usage.cached_tokens, usage.tier_cached_tokens) == (48, expected)


@pytest.mark.parametrize(
    ("status", "body", "kind", "mapped"),
    [
        (400, {"error": {"message": "bad n", "param": "n"}}, UpstreamRejected, 400),
        (422, {"detail": "wrong type"}, UpstreamRejected, 400),
        (413, {"error": {"message": "too big"}}, UpstreamRejected, 413),
        (401, {"error": {"message": "no key"}}, UpstreamError, 502),
        (404, {"detail": "Not Found"}, UpstreamError, 502),
        (429, {"error": {"message": "slow down"}}, UpstreamError, 502),
        (500, "boom", UpstreamError, 502),
        (503, {"object": "error", "message": "overloaded"}, UpstreamError, 502),
    ],
)
async def test_status_mapping(
    third_party: HttpUpstream, script: Script, status: int, body: Any, kind: type, mapped: int
) -> None:
    script.status, script.error_body = status, body
    with pytest.raises(kind) as info:
        await _run(third_party, _req(_chat()))
    err = info.value
    assert isinstance(err, UpstreamError | UpstreamRejected)
    assert err.status == mapped
    if isinstance(err, UpstreamError):
        assert err.retryable is True
    if status == 400:
        assert isinstance(err, UpstreamRejected)
        assert err.param == "n" and str(err) == "bad n"


@pytest.mark.parametrize(
    ("events", "send_done", "retryable"),
    [
        ([chat_event(0, "a"), {"error": {"message": "engine died"}}], True, False),
        ([{"error": {"message": "engine died"}}], True, True),
        ([chat_event(0, "a"), "{not json"], True, False),
        ([chat_event(0, "a")], False, False),  # cut: no finish, no [DONE]
        ([], False, True),
        # wrongly typed fields: the upstream's fault, never an escaping TypeError/ValueError
        ([{"choices": [{"index": None, "delta": {"content": "a"}}]}], True, True),
        ([chat_event(0, "a", "stop"), {"choices": [], "usage": {"prompt_tokens": "lots"}}],
         True, False),
    ],
)
async def test_broken_streams_are_upstream_errors(
    third_party: HttpUpstream, script: Script, events: list[Any], send_done: bool, retryable: bool
) -> None:
    script.events, script.send_done = events, send_done
    with pytest.raises(UpstreamError) as info:
        await _run(third_party, _req(_chat()))
    assert info.value.retryable is retryable


async def test_read_timeout(third_party: HttpUpstream, script: Script) -> None:
    script.events, script.delay_s = [chat_event(0, "late", "stop")], 2.0
    with pytest.raises(UpstreamError) as info:
        await _run(third_party, _req(_chat()))
    assert info.value.status == 504 and info.value.retryable


async def test_health_falls_back_to_models(third_party: HttpUpstream, script: Script) -> None:
    script.has_healthz = False
    assert await third_party.health() is True


async def test_server_ignoring_stream_true_is_read_whole(
    third_party: HttpUpstream, script: Script
) -> None:
    script.whole_json = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris."},
                "finish_reason": "stop",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
                "finish_reason": "tool_calls",
            },
        ],
        "usage": {
            "prompt_tokens": 9,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
    deltas, usage = await _run(third_party, _req(_chat()))
    assert [(d.index, d.text, d.finish_reason) for d in deltas] == [
        (0, "Paris.", "stop"),
        (1, "", "tool_calls"),
    ]
    assert deltas[1].tool_calls == [{"id": "t"}]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (9, 2, 8)
    script.whole_json = {"unexpected": True}
    with pytest.raises(UpstreamError):
        await _run(third_party, _req(_chat()))


async def test_first_delta_carries_the_workers_prompt_counts(worker: HttpUpstream) -> None:
    body = {"model": "kvtoll-tiny", "prompt": LONG, "max_tokens": 2}
    for attempt in range(2):
        deltas, usage = await _run(worker, _req(body, kind="completion", rid=f"c{attempt}"))
        first = deltas[0]
        assert (first.prompt_tokens, first.cached_tokens) == (
            usage.prompt_tokens, usage.cached_tokens)
        assert all(d.cached_tokens is None for d in deltas[1:])
    assert usage.cached_tokens > 0  # the second attempt hit, and its first delta said so
