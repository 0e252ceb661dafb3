"""Tool calls from a third-party OpenAI-compatible upstream pass through the gateway in
OpenAI's shape: streamed deltas as they came, a whole response's ``message.tool_calls``
rebuilt from them (read back with the official SDK), a server that ignores
``stream: true`` read whole, malformed tool calls refused as an upstream error (502),
and tool-call deltas counted when the usage never arrives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus
from kvtoll.settings import Settings
from proxy.tally import Tally
from proxy.upstream.base import UpstreamDelta
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig
from tests.proxy.helpers import MODEL, LiveServer, Tenants, build_app, settled_rows
from tests.proxy.upstream.upstream_helpers import Script, scripted_server

USAGE = {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30,
         "prompt_tokens_details": {"cached_tokens": 0}}
WEATHER_ARGS = '{"city": "Paris"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _event(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "up", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def tool_call_events() -> list[Any]:
    """Two tool calls streamed as OpenAI does: id, type and name first, then the
    arguments in pieces; an extra field the gateway does not pass on."""
    return [
        _event({"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_w", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}]}),
        _event({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _event({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _event({"tool_calls": [{"index": 1, "id": "call_t", "type": "function",
                                "function": {"name": "get_time", "arguments": "{}"},
                                "vendor_extra": 1}]}),
        _event({}, "tool_calls"),
        {"id": "up", "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
    ]


@pytest.fixture
def script() -> Script:
    return Script(events=tool_call_events())


@pytest.fixture
def gateway(settings: Settings, db: sessionmaker[Session], tenants: Tenants,
            script: Script) -> Iterator[LiveServer]:
    with LiveServer(scripted_server(script)) as upstream:
        app = build_app(settings, db, upstreams=[HttpUpstream(HttpUpstreamConfig(upstream.url))])
        with LiveServer(app) as live:
            yield live


def _ask(gateway: LiveServer, key: str, stream: bool) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": TOOLS, "stream": stream}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def test_whole_response_carries_the_tool_calls(
    gateway: LiveServer, tenants: Tenants, db: sessionmaker[Session], script: Script
) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=tenants.key_a, max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}],
        tools=TOOLS,  # type: ignore[arg-type]
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.model_dump() for c in calls] == [
        {"id": "call_w", "type": "function",
         "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
        {"id": "call_t", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert script.received[0]["tools"] == TOOLS  # the tools went upstream as sent
    [row] = settled_rows(db, 1)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (RequestStatus.OK, 21, 9)


def test_streamed_deltas_pass_through(gateway: LiveServer, tenants: Tenants) -> None:
    response = _ask(gateway, tenants.key_a, stream=True)
    assert response.status_code == 200
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    sent = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    expected = [[{k: v for k, v in call.items() if k != "vendor_extra"}
                 for call in event["choices"][0]["delta"]["tool_calls"]]
                for event in tool_call_events()[:4]]
    assert sent == expected  # every delta as the upstream sent it, vendor fields dropped
    assert all("content" not in d for d in deltas if "tool_calls" in d)
    assert deltas[0]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == (
        "tool_calls")


@pytest.mark.parametrize("script", [Script(whole_json={
    "id": "up", "object": "chat.completion", "created": 0, "model": MODEL, "usage": USAGE,
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_w", "type": "function",
             "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]}}]})])
def test_upstream_answering_whole_json_with_tool_calls(
    gateway: LiveServer, tenants: Tenants
) -> None:
    message = _ask(gateway, tenants.key_a, stream=False).json()["choices"][0]["message"]
    assert message["tool_calls"] == [{"id": "call_w", "type": "function", "function": {
        "name": "get_weather", "arguments": WEATHER_ARGS}}]
    assert message["content"] is None


@pytest.mark.parametrize("script", [Script(events=[
    _event({"tool_calls": "get_weather(Paris)"}), _event({}, "stop"),
    {"choices": [], "usage": USAGE}])])
def test_malformed_tool_calls_are_an_upstream_error(
    gateway: LiveServer, tenants: Tenants, db: sessionmaker[Session]
) -> None:
    response = _ask(gateway, tenants.key_a, stream=False)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unavailable"
    [row] = settled_rows(db, 1)
    assert row.status is RequestStatus.UPSTREAM_ERROR


def test_tally_counts_tool_call_deltas_and_never_caches_them() -> None:
    tally = Tally()
    for event in tool_call_events()[:4]:
        tally.add(UpstreamDelta(0, tool_calls=event["choices"][0]["delta"]["tool_calls"]))
    tally.add(UpstreamDelta(0, finish_reason="stop"))  # some servers say stop after a call
    assert tally.produced_anything
    assert tally.completion_tokens() == 4  # no usage: one token per non-empty delta
    assert tally.first_token_at is not None
    assert not tally.all_stopped()  # a tool call is not a cacheable text answer
    calls = tally.tool_calls(0)
    assert calls is not None
    assert [c["function"]["arguments"] for c in calls] == [WEATHER_ARGS, "{}"]
