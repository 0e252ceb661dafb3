"""HttpUpstream asked for a whole (non-streamed) response, against real servers on free
ports: a kvtoll worker with the tiny engine (the same answer, usage and prompt counts
as streamed) and a scripted OpenAI-compatible server (the body sent, the whole-response
timeout, the status mapping, the tier split)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import derive_tenant_salt
from engine.serving.app import build_worker_app
from kvtoll.openai.responses import TierCachedTokens
from kvtoll.server import serve_in_background
from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamError,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
    answers_whole,
)
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig
from tests.proxy.upstream.upstream_helpers import Script, SpyEngine, scripted_server

pytestmark = pytest.mark.anyio
SALT = derive_tenant_salt(b"secret", "tenant-a")
LONG = "You are a careful assistant. Answer briefly and cite sources. " * 2


def _req(body: dict[str, Any], *, whole: bool = True, kind: str = "chat",
         rid: str = "r1") -> UpstreamRequest:
    return UpstreamRequest(rid, kind, "kvtoll-tiny", body, SALT,  # type: ignore[arg-type]
                           whole=whole)


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "kvtoll-tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


async def _run(up: HttpUpstream, req: UpstreamRequest) -> tuple[list[UpstreamDelta], UpstreamUsage]:
    items = [item async for item in up.stream(req)]
    assert isinstance(items[-1], UpstreamUsage)
    return items[:-1], items[-1]  # type: ignore[return-value]


@pytest.fixture
async def spy() -> AsyncIterator[SpyEngine]:
    engine: AsyncEngine = build_engine(EngineConfig.tiny(max_n=2))
    yield SpyEngine(engine)
    engine.shutdown()


@pytest.fixture
async def worker(spy: SpyEngine) -> AsyncIterator[HttpUpstream]:
    async with serve_in_background(build_worker_app(spy)) as url:
        up = HttpUpstream(HttpUpstreamConfig(url))
        yield up
        await up.aclose()


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
async def third_party(script: Script) -> AsyncIterator[HttpUpstream]:
    async with serve_in_background(scripted_server(script)) as url:
        cfg = HttpUpstreamConfig(url, model="served-name", send_salt=False,
                                 read_timeout_s=0.2, response_timeout_s=5.0)
        up = HttpUpstream(cfg)
        yield up
        await up.aclose()


def _whole(content: str = "Paris.", usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content},
         "finish_reason": "stop"}],
        "usage": usage or {"prompt_tokens": 9, "completion_tokens": 2,
                           "prompt_tokens_details": {"cached_tokens": 0}}}


def test_http_upstreams_answer_whole_and_others_do_not() -> None:
    assert answers_whole(HttpUpstream(HttpUpstreamConfig("http://127.0.0.1:9")))
    assert not answers_whole(object())


async def test_whole_answer_from_a_worker_matches_the_streamed_one(
    worker: HttpUpstream, spy: SpyEngine
) -> None:
    body = _chat(max_tokens=5, ignore_eos=True, n=2, temperature=0)
    streamed, streamed_usage = await _run(worker, _req(body, whole=False, rid="s"))
    whole, whole_usage = await _run(worker, _req(body, rid="w"))
    for index in (0, 1):
        text = "".join(d.text for d in streamed if d.index == index)
        (delta,) = [d for d in whole if d.index == index]
        assert delta.text == text and delta.finish_reason == "length"
    assert (whole_usage.prompt_tokens, whole_usage.completion_tokens) == (
        streamed_usage.prompt_tokens, streamed_usage.completion_tokens)
    assert not whole_usage.extra and worker.usage_problem() is None  # reported, cached too


async def test_first_whole_delta_carries_the_prompt_counts_of_the_usage(
    worker: HttpUpstream,
) -> None:
    body = {"model": "kvtoll-tiny", "prompt": LONG, "max_tokens": 2}
    for attempt in range(2):
        deltas, usage = await _run(worker, _req(body, kind="completion", rid=f"c{attempt}"))
        assert (deltas[0].prompt_tokens, deltas[0].cached_tokens) == (
            usage.prompt_tokens, usage.cached_tokens)
    assert usage.cached_tokens > 0  # the second one hit the worker's prefix cache


async def test_whole_request_body_is_not_streamed(third_party: HttpUpstream,
                                                  script: Script) -> None:
    script.whole_json = _whole()
    body = _chat(stream=False, stream_options={"include_usage": True}, cache_salt="ab")
    deltas, usage = await _run(third_party, _req(body))
    sent = script.received[0]
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["model"] == "served-name" and "cache_salt" not in sent
    assert [(d.text, d.finish_reason) for d in deltas] == [("Paris.", "stop")]
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 2)


async def test_a_whole_answer_may_be_silent_past_the_read_timeout(
    third_party: HttpUpstream, script: Script
) -> None:
    script.whole_json, script.delay_s = _whole(), 0.6  # read timeout 0.2 s
    deltas, _ = await _run(third_party, _req(_chat()))
    assert deltas[0].text == "Paris."


async def test_a_whole_answer_later_than_its_timeout_is_a_retryable_504(
    third_party: HttpUpstream, script: Script
) -> None:
    script.whole_json, script.delay_s = _whole(), 2.0
    short = HttpUpstream(replace(third_party.config, response_timeout_s=0.3))
    with pytest.raises(UpstreamError) as info:
        await _run(short, _req(_chat()))
    assert info.value.status == 504 and info.value.retryable
    await short.aclose()


@pytest.mark.parametrize(("status", "kind", "mapped"), [
    (400, UpstreamRejected, 400), (422, UpstreamRejected, 400), (429, UpstreamError, 502),
    (503, UpstreamError, 502)])
async def test_whole_status_mapping_is_the_streamed_one(
    third_party: HttpUpstream, script: Script, status: int, kind: type, mapped: int
) -> None:
    script.status, script.error_body = status, {"error": {"message": "no", "param": "n"}}
    with pytest.raises(kind) as info:
        await _run(third_party, _req(_chat()))
    assert isinstance(info.value, UpstreamError | UpstreamRejected)
    assert info.value.status == mapped
    if isinstance(info.value, UpstreamError):
        assert info.value.retryable


async def test_whole_usage_keeps_the_tier_split(third_party: HttpUpstream,
                                                script: Script) -> None:
    details = {"cached_tokens": 48, "kvtoll_tier_cached_tokens": {"host": 16, "shared": 32}}
    script.whole_json = _whole(usage={"prompt_tokens": 60, "completion_tokens": 1,
                                      "prompt_tokens_details": details})
    deltas, usage = await _run(third_party, _req(_chat()))
    assert (usage.cached_tokens, usage.tier_cached_tokens) == (48, TierCachedTokens(16, 32))
    assert (deltas[0].prompt_tokens, deltas[0].cached_tokens) == (60, 48)


async def test_whole_usage_without_cached_details_leaves_the_delta_counts_unknown(
    third_party: HttpUpstream, script: Script
) -> None:
    script.whole_json = _whole(usage={"prompt_tokens": 9, "completion_tokens": 2})
    deltas, usage = await _run(third_party, _req(_chat()))
    assert deltas[0].cached_tokens is None
    assert usage.extra == {"cached_tokens_reported": False}
