"""The worker app over a fake engine (the engine is another part): routes, shapes,
streaming, salts, bad input. End-to-end checks with the real engine are in
test_worker_e2e.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine.api import GenerationChunk, GenerationRequest, KVShare
from engine.serving.app import WorkerConfig, build_worker_app
from tests.engine.serving.serving_fakes import REPLY, ByteTokenizer, FakeEngine

pytestmark = pytest.mark.anyio
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_worker_app(engine, WorkerConfig(max_body_bytes=8192))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        yield c


def _frames(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


async def test_chat_completion_whole(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    resp = await client.post(
        "/v1/chat/completions", json={"model": "fake-model", "messages": MSGS, "max_tokens": 5}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY[:5]}
    assert choice["finish_reason"] == "length"
    prompt_len = len(ByteTokenizer().apply_chat_template([{"role": "user", "content": "hello"}]))
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 5,
        "total_tokens": prompt_len + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    sent = engine.requests[0]
    assert sent.salt is None
    assert sent.sampling.max_tokens == 5 and sent.sampling.temperature == 1.0


async def test_sampling_fields_reach_the_engine(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {
        "model": "fake-model",
        "messages": MSGS,
        "max_completion_tokens": 3,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": -1,
        "seed": 7,
        "stop": ["xyz"],
        "stop_token_ids": [9],
        "logprobs": True,
        "top_logprobs": 1,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    s = engine.requests[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (3, 0.0, 0.5, 0, 7)
    assert (s.stop, s.stop_token_ids, s.logprobs) == (("xyz",), (9,), 1)
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == list(REPLY[:3])
    assert content[0]["top_logprobs"][0]["token"] == REPLY[0]


async def test_completions_batch_of_prompts_with_n(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": ["abcd", "efghij"], "n": 2, "max_tokens": 4},
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][1]["text"] == REPLY[1:5]
    assert body["usage"]["prompt_tokens"] == 4 + 6
    assert body["usage"]["completion_tokens"] == 16


async def test_completion_default_max_tokens_is_16(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"model": "fake-model", "prompt": [1, 2]})
    assert resp.json()["usage"]["completion_tokens"] == 16


async def test_chat_stream_with_usage(client: httpx.AsyncClient) -> None:
    body = {
        "model": "fake-model",
        "messages": MSGS,
        "max_tokens": 6,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = _frames(resp.text)
    assert frames[-1] == "[DONE]"
    usage = frames[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    chunks = frames[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in m["delta"] for m in mine[1:])
        assert "".join(m["delta"]["content"] for m in mine) == REPLY[index : index + 6]
        assert mine[-1]["finish_reason"] == "length"
    assert len({c["id"] for c in frames[:-1]}) == 1


async def test_completion_stream_without_usage(client: httpx.AsyncClient) -> None:
    body = {"model": "fake-model", "prompt": "abc", "max_tokens": 3, "stream": True}
    frames = _frames((await client.post("/v1/completions", json=body)).text)
    assert frames[-1] == "[DONE]"
    assert all("usage" not in f for f in frames[:-1])
    assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == REPLY[:3]


async def test_cached_tokens_follow_the_cache_salt(client: httpx.AsyncClient) -> None:
    prompt = "a long shared system prompt " * 4

    async def cached(salt: str | None) -> int:
        body: dict[str, Any] = {"model": "fake-model", "prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        resp = await client.post("/v1/completions", json=body)
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached("aa01") == 0
    assert await cached("aa01") > 0
    assert await cached("bb02") == 0
    assert await cached(None) == 0


async def test_salt_reaches_engine_only_from_cache_salt(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": 1, "cache_salt": "0a0b"}
    await client.post("/v1/chat/completions", json=body, headers={"x-tenant-salt": "ffff"})
    assert engine.requests[-1].salt == b"\x0a\x0b"


async def test_kv_share_reaches_the_engine_beside_the_salt(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    share = {"tenant": "acme", "reserved_blocks": 8, "max_blocks": 16}
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": 1, "cache_salt": "0a0b",
            "kvtoll_kv_share": share}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert engine.requests[-1].kv_share == KVShare("acme", 8, 16)
    for bad in ({**share, "reserved_blocks": -1}, {**share, "max_blocks": "many"}, {"x": 1}):
        resp = await client.post("/v1/chat/completions", json={**body, "kvtoll_kv_share": bad})
        _assert_error(resp, 400)


async def test_kv_events_ordering_and_cursor(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    for p in ("abcdefgh", "ijklmnop"):
        await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": p, "max_tokens": 1}
        )
    engine.evict_all()
    first = (await client.get("/kv/events")).json()
    assert [e["seq"] for e in first["events"]] == [0, 1, 2]
    assert [e["kind"] for e in first["events"]] == ["stored", "stored", "removed"]
    assert all(len(h) == 32 for e in first["events"] for h in e["block_hashes"])
    assert first["next_cursor"] == 3 and first["block_size"] == 4
    page = (await client.get("/kv/events", params={"cursor": 1, "limit": 1})).json()
    assert [e["seq"] for e in page["events"]] == [1] and page["next_cursor"] == 2
    empty = (await client.get("/kv/events", params={"cursor": 3})).json()
    assert empty["events"] == [] and empty["next_cursor"] == 3
    assert empty["instance_id"] == first["instance_id"]
    _assert_error(await client.get("/kv/events", params={"cursor": -1}), 400, "cursor")
    _assert_error(await client.get("/kv/events", params={"cursor": "x"}), 400, "cursor")


async def test_load_health_models(client: httpx.AsyncClient) -> None:
    load = (await client.get("/load")).json()
    assert load["num_total_blocks"] == 64 and load["block_size"] == 4
    assert {"num_running", "num_waiting", "num_free_blocks"} <= set(load)
    assert (await client.get("/healthz")).json()["status"] == "ok"
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MSGS, "max_tokens": 2, **fields}


BAD_JSON_BODIES = [
    (b"{not json", "invalid_json"),
    (
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "\xff"}]}',
        "invalid_encoding",
    ),
    (b'{"model": "fake-model", "messages": [], "temperature": NaN}', "invalid_json"),
    (b"[]", "invalid_json"),
    (
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\udc00"}]}',
        "invalid_encoding",
    ),
    (b'{"model": "fake-model", "messages": [], "seed": 1' + b"0" * 5000 + b"}", "invalid_json"),
    (b"", "invalid_json"),
]


@pytest.mark.parametrize(("raw", "code"), BAD_JSON_BODIES)
async def test_malformed_bodies_are_400_and_next_request_is_served(
    client: httpx.AsyncClient, raw: bytes, code: str
) -> None:
    resp = await client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert _assert_error(resp, 400)["code"] == code
    assert (await client.post("/v1/chat/completions", json=_chat())).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", _chat(temperature=-1), "temperature"),
        ("/v1/chat/completions", _chat(top_p=0), "top_p"),
        ("/v1/chat/completions", _chat(top_p=1.5), "top_p"),
        ("/v1/chat/completions", _chat(n=5), "n"),  # over the engine's cap (4)
        ("/v1/chat/completions", _chat(n=1000), "n"),
        ("/v1/chat/completions", {"model": "fake-model", "messages": []}, "messages"),
        ("/v1/chat/completions", _chat(max_tokens=250), "max_tokens"),
        (
            "/v1/chat/completions",
            _chat(messages=[{"role": "user", "content": "x" * 300}]),
            "messages",
        ),
        ("/v1/chat/completions", _chat(presence_penalty=0.5), "presence_penalty"),
        ("/v1/chat/completions", _chat(response_format={"type": "json_object"}), "response_format"),
        ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), "tools"),
        ("/v1/chat/completions", _chat(api_base="http://elsewhere"), "api_base"),
        ("/v1/chat/completions", _chat(extra_field=1), "extra_field"),
        ("/v1/completions", {"model": "fake-model", "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": "fake-model", "prompt": [300]}, "prompt"),
        ("/v1/completions", {"model": "fake-model", "prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"model": "fake-model", "prompt": "x" * 256}, "messages"),
    ],
)
async def test_bad_requests_are_400_and_next_request_is_served(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    for stream in (False, True):
        resp = await client.post(path, json={**body, "stream": stream})
        _assert_error(resp, 400, param)
    assert (await client.post("/v1/chat/completions", json=_chat())).status_code == 200


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    err = _assert_error(await client.post("/v1/chat/completions", json=_chat(model="gpt-9")), 404)
    assert err["code"] == "model_not_found"


async def test_oversized_body_is_413(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=_chat(user="u" * 10_000))
    assert _assert_error(resp, 413)["code"] == "request_too_large"


async def test_unknown_route_and_method_in_openai_shape(client: httpx.AsyncClient) -> None:
    _assert_error(await client.get("/v1/nothing"), 404)
    _assert_error(await client.get("/v1/chat/completions"), 405)


async def test_served_model_names_alias() -> None:
    app = build_worker_app(FakeEngine(), WorkerConfig(served_model_names=("alias",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        ok = await c.post("/v1/chat/completions", json=_chat(model="alias"))
        assert ok.status_code == 200 and ok.json()["model"] == "alias"
        _assert_error(await c.post("/v1/chat/completions", json=_chat()), 404)


class _FailingEngine(FakeEngine):
    """Fails after its first token, as an engine bug would."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        async for chunk in super().generate(request):
            yield chunk
            raise RuntimeError("engine step failed")


async def test_engine_failure_mid_stream_ends_with_an_error_frame() -> None:
    app = build_worker_app(_FailingEngine())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # uvicorn logs it
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
        resp = await c.post("/v1/chat/completions", json=_chat(max_tokens=5, stream=True))
        frames = _frames(resp.text)
        assert frames[0]["choices"][0]["delta"]["content"] == REPLY[0]
        assert frames[-2]["error"]["type"] == "server_error" and frames[-1] == "[DONE]"
        whole = await c.post("/v1/chat/completions", json=_chat(max_tokens=5))
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
