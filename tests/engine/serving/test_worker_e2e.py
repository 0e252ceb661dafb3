"""The worker app with the real (tiny, random-weight) engine behind a real uvicorn
server: OpenAI shapes, streaming, prefix-cache hits by salt, KV events that match
the shared block hashing, load, bad input, and the official openai SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import TenantSalt, hash_prompt_blocks
from engine.serving.app import build_worker_app
from kvtoll.server import serve_in_background

pytestmark = pytest.mark.anyio
MODEL = "kvtoll-tiny"
LONG = "You are a careful assistant. Answer briefly and cite sources. " * 2


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = build_engine(EngineConfig.tiny(max_n=3))
    yield eng
    eng.shutdown()


@pytest.fixture
async def url(engine: AsyncEngine) -> AsyncIterator[str]:
    async with serve_in_background(build_worker_app(engine)) as base:
        yield base


@pytest.fixture
async def client(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        yield c


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **fields,
    }


async def test_chat_and_completion(client: httpx.AsyncClient) -> None:
    chat = (await client.post("/v1/chat/completions", json=_chat(temperature=0))).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    usage = chat["usage"]
    assert 1 <= usage["completion_tokens"] <= 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    comp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["abc", "defg"], "max_tokens": 3, "n": 2}
    )
    body = comp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] > 7  # both prompts counted once each


async def test_stream_with_usage(client: httpx.AsyncClient) -> None:
    body = _chat(max_tokens=6, stream=True, stream_options={"include_usage": True}, ignore_eos=True)
    frames: list[Any] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                frames.append(data if data == "[DONE]" else json.loads(data))
    assert frames[-1] == "[DONE]"
    assert frames[-2]["choices"] == [] and frames[-2]["usage"]["completion_tokens"] == 6
    assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
    assert frames[-3]["choices"][0]["finish_reason"] == "length"


async def _cached(client: httpx.AsyncClient, salt: str) -> int:
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 1, "cache_salt": salt}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_prefix_cache_hits_only_with_the_same_salt(client: httpx.AsyncClient) -> None:
    assert await _cached(client, "aa" * 16) == 0
    hit = await _cached(client, "aa" * 16)
    assert hit > 0 and hit % 16 == 0
    assert await _cached(client, "bb" * 16) == 0
    assert await _cached(client, "aa" * 16) == hit


async def test_kv_events_match_shared_block_hashing(
    client: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    await _cached(client, "cc" * 16)
    await _cached(client, "dd" * 16)
    events = (await client.get("/kv/events")).json()
    seqs = [e["seq"] for e in events["events"]]
    assert seqs == sorted(seqs) and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert events["next_cursor"] == seqs[-1] + 1
    stored = {h for e in events["events"] if e["kind"] == "stored" for h in e["block_hashes"]}
    ids = engine.tokenizer().encode(LONG, add_special_tokens=True)
    for salt in ("cc", "dd"):
        expected = hash_prompt_blocks(ids, 16, TenantSalt(bytes.fromhex(salt * 16)))
        assert expected and {h.hex() for h in expected} <= stored
    later = (await client.get("/kv/events", params={"cursor": seqs[-1]})).json()
    assert [e["seq"] for e in later["events"]] == [seqs[-1]]
    assert (await client.get("/kv/events", params={"cursor": events["next_cursor"]})).json()[
        "events"
    ] == []


async def test_load(client: httpx.AsyncClient) -> None:
    load = (await client.get("/load")).json()
    assert load["num_total_blocks"] == 64 and load["block_size"] == 16
    assert load["num_running"] == 0 and load["num_waiting"] == 0
    assert 0 <= load["num_free_blocks"] <= 64


BAD = [
    (_chat(messages=[{"role": "user", "content": "x" * 300}]), None),  # longer than context
    (_chat(max_tokens=250), "max_tokens"),
    (_chat(n=4), "n"),  # over the engine's cap of 3
    (_chat(temperature=-0.5), "temperature"),
    (_chat(top_p=0), "top_p"),
    (_chat(top_p=1.5), "top_p"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [100_000]}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
async def test_bad_input_is_400_and_next_request_is_served(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    resp = await client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    assert (await client.post("/v1/chat/completions", json=_chat())).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"{oops",
        b'{"model": "kvtoll-tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
        b'{"model": "kvtoll-tiny", "messages": [{"role": "user", "content": "x"}], '
        b'"temperature": NaN}',
    ],
)
async def test_malformed_bodies_are_400_and_next_request_is_served(
    client: httpx.AsyncClient, raw: bytes
) -> None:
    resp = await client.post("/v1/chat/completions", content=raw)
    assert resp.status_code == 400 and resp.json()["error"]["code"] in (
        "invalid_json",
        "invalid_encoding",
    )
    assert (await client.post("/v1/chat/completions", json=_chat())).status_code == 200


async def test_client_disconnect_frees_the_engine(
    client: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    """The request is aborted (not run to its 200 tokens) and its blocks freed. Polled
    until then, not a fixed number of times: the engine's first step loads its kernels
    (seconds), and a fast machine ran 500 polls before that first step ended."""
    body = _chat(max_tokens=200, ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break
    load = (await client.get("/load")).json()
    for _ in range(3000):  # a liveness bound (about a minute), not a speed goal
        if load["num_running"] == 0 and load["num_waiting"] == 0:
            break
        await asyncio.sleep(0.02)
        load = (await client.get("/load")).json()
    assert load["num_running"] == 0 and load["num_waiting"] == 0
    assert load["num_free_blocks"] == load["num_total_blocks"]  # cached blocks count as free
    assert engine.engine.num_steps < 200  # aborted, not finished


async def test_openai_sdk_chat_stream_completions_models(url: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="internal", max_retries=0)
    try:
        models = await sdk.models.list()
        assert [m.id for m in models.data] == [MODEL]
        chat = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.usage is not None and chat.usage.completion_tokens <= 3
        assert chat.usage.prompt_tokens_details is not None
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usages = [c.usage async for c in stream if c.usage is not None]
        assert len(usages) == 1 and usages[0].completion_tokens == 3
        comp = await sdk.completions.create(model=MODEL, prompt="abc", max_tokens=2)
        assert comp.object == "text_completion" and comp.usage is not None
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1
            )
        assert info.value.status_code == 400
    finally:
        await sdk.close()


async def test_concurrent_requests_are_batched_and_all_answered(
    client: httpx.AsyncClient,
) -> None:
    async def one(i: int) -> dict[str, Any]:
        body = _chat(
            messages=[{"role": "user", "content": f"question {i} " * (i + 1)}],
            max_tokens=5,
            ignore_eos=True,
            seed=i,
        )
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return dict(resp.json()["usage"])

    usages = await asyncio.gather(*(one(i) for i in range(8)))
    assert [u["completion_tokens"] for u in usages] == [5] * 8
    assert len({u["prompt_tokens"] for u in usages}) == 8


async def test_tenant_shares_on_load_and_metrics_and_an_oversized_one_refused(
    client: httpx.AsyncClient,
) -> None:
    share = {"tenant": "acme", "reserved_blocks": 4, "max_blocks": 32}
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 1, "cache_salt": "0a" * 16,
            "kvtoll_kv_share": share}
    for _ in range(2):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    load = (await client.get("/load")).json()
    [acme] = [t for t in load["tenants"] if t["tenant"] == "acme"]
    assert (acme["reserved_blocks"], acme["max_blocks"]) == (4, 32)
    assert acme["cached_blocks"] > 0 and 0 < acme["hit_blocks"] <= acme["query_blocks"]
    text = (await client.get("/metrics")).text
    assert 'kvtoll_worker_kv_reserved_blocks{tenant="acme"} 4.0' in text
    hits = acme["hit_blocks"]
    assert f'kvtoll_worker_kv_prefix_hit_blocks_total{{tenant="acme"}} {hits}.0' in text
    events = (await client.get("/kv/events")).json()["events"]
    assert {e["tenant"] for e in events} == {"acme"}
    huge = {**body, "kvtoll_kv_share": {**share, "reserved_blocks": load["num_total_blocks"] + 1}}
    resp = await client.post("/v1/completions", json=huge)
    assert resp.status_code == 400
    assert "exceeds this worker's pool" in resp.json()["error"]["message"]
    assert (await client.post("/v1/completions", json=body)).status_code == 200  # still serving
