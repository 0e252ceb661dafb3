"""InProcessUpstream over the real tiny engine (a spy records what reached it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import TenantSalt, derive_tenant_salt
from kvtoll.openai.protocol import parse_request
from proxy.upstream.base import (
    UpstreamDelta,
    UpstreamRejected,
    UpstreamRequest,
    UpstreamUsage,
)
from proxy.upstream.inprocess import InProcessUpstream
from tests.proxy.upstream.upstream_helpers import SpyEngine

pytestmark = pytest.mark.anyio
SALT_A = derive_tenant_salt(b"secret", 1)
SALT_B = derive_tenant_salt(b"secret", 2)
LONG = "Shared system prompt that is long enough to fill several KV blocks. " * 2


@pytest.fixture
async def spy() -> AsyncIterator[SpyEngine]:
    engine = build_engine(EngineConfig.tiny(max_n=2))
    yield SpyEngine(engine)
    engine.shutdown()


@pytest.fixture
def upstream(spy: SpyEngine) -> InProcessUpstream:
    return InProcessUpstream(spy, name="embedded")


def _req(
    body: dict[str, Any], salt: TenantSalt = SALT_A, kind: str = "chat", **kw: Any
) -> UpstreamRequest:
    return UpstreamRequest("rid-1", kind, "kvtoll-tiny", body, salt, **kw)  # type: ignore[arg-type]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "kvtoll-tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


async def _run(
    up: InProcessUpstream, req: UpstreamRequest
) -> tuple[list[UpstreamDelta], UpstreamUsage]:
    items = [i async for i in up.stream(req)]
    assert isinstance(items[-1], UpstreamUsage)
    return items[:-1], items[-1]  # type: ignore[return-value]


async def test_chat_deltas_and_usage(upstream: InProcessUpstream, spy: SpyEngine) -> None:
    deltas, usage = await _run(upstream, _req(_chat(max_tokens=4, ignore_eos=True, n=2)))
    assert upstream.name == "embedded" and await upstream.health()
    assert sorted(d.finish_reason for d in deltas if d.finish_reason) == ["length", "length"]
    assert usage.completion_tokens == 8
    sent = spy.requests[0]
    assert sent.salt == SALT_A and sent.request_id == "rid-1"
    expected = spy.tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert sent.prompt_token_ids == tuple(expected) and usage.prompt_tokens == len(expected)


async def test_salt_comes_from_the_request_not_the_body(
    upstream: InProcessUpstream, spy: SpyEngine
) -> None:
    body = {"model": "kvtoll-tiny", "prompt": LONG, "max_tokens": 1, "cache_salt": "ee" * 8}
    first = (await _run(upstream, _req(body, SALT_A, "completion")))[1]
    again = (await _run(upstream, _req(body, SALT_A, "completion")))[1]
    other = (await _run(upstream, _req(body, SALT_B, "completion")))[1]
    assert first.cached_tokens == 0 and again.cached_tokens > 0 and other.cached_tokens == 0
    assert [r.salt for r in spy.requests] == [SALT_A, SALT_A, SALT_B]


async def test_pre_tokenized_prompt_is_used(upstream: InProcessUpstream, spy: SpyEngine) -> None:
    ids = (5, 6, 7, 8, 9)
    usage = (await _run(upstream, _req(_chat(max_tokens=1), prompt_token_ids=ids)))[1]
    assert spy.requests[0].prompt_token_ids == ids and usage.prompt_tokens == 5


async def test_the_gateway_parsed_request_is_not_validated_again(
    upstream: InProcessUpstream,
) -> None:
    """The gateway parses a body once (intake): the request it hands over is used as it
    is (an empty ``body`` here would be a 400 if it were validated again)."""
    parsed = parse_request("chat", _chat(max_tokens=3, ignore_eos=True))
    deltas, usage = await _run(upstream, _req({}, parsed=parsed))
    assert usage.completion_tokens == 3 and deltas[-1].finish_reason == "length"
    with pytest.raises(UpstreamRejected):
        await _run(upstream, _req({}))


async def test_logprobs_in_openai_shape(upstream: InProcessUpstream) -> None:
    deltas, _ = await _run(upstream, _req(_chat(max_tokens=2, logprobs=True, top_logprobs=2)))
    content = [c for d in deltas if d.logprobs for c in d.logprobs["content"]]
    assert len(content) == 2 and all(len(c["top_logprobs"]) == 2 for c in content)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(max_tokens=10_000), "max_tokens"),
        (_chat(n=3), "n"),
        (_chat(presence_penalty=1.0), "presence_penalty"),
        (_chat(temperature=-1.0), "temperature"),
        ({"model": "kvtoll-tiny", "messages": []}, "messages"),
    ],
)
async def test_rejections(upstream: InProcessUpstream, body: dict[str, Any], param: str) -> None:
    with pytest.raises(UpstreamRejected) as info:
        await _run(upstream, _req(body))
    assert info.value.status == 400 and info.value.param == param


async def test_closing_the_stream_aborts(upstream: InProcessUpstream, spy: SpyEngine) -> None:
    spy.chunk_delay_s = 0.01
    stream = upstream.stream(_req(_chat(max_tokens=200, ignore_eos=True)))
    assert isinstance(await anext(stream), UpstreamDelta)
    await stream.aclose()
    assert spy.closed_early == ["rid-1"]
    for _ in range(500):
        load = spy.load()
        if load.num_running == 0 and load.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert (load.num_running, load.num_waiting) == (0, 0)


async def test_first_delta_carries_prompt_and_cached_tokens(upstream: InProcessUpstream) -> None:
    body = {"model": "kvtoll-tiny", "prompt": "a prompt long enough to fill blocks " * 3,
            "max_tokens": 2}
    for _ in range(2):
        deltas, usage = await _run(upstream, _req(body, kind="completion"))
        assert (deltas[0].prompt_tokens, deltas[0].cached_tokens) == (
            usage.prompt_tokens, usage.cached_tokens)
        assert all(d.cached_tokens is None for d in deltas[1:])
    assert usage.cached_tokens > 0
