"""A client that goes away aborts its engine request, streamed or not (real uvicorn;
the engine is a slow fake that records whether its stream was cut short)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from engine.serving.app import build_worker_app
from kvtoll.server import serve_in_background
from tests.engine.serving.serving_fakes import FakeEngine

pytestmark = pytest.mark.anyio
BODY = {"model": "fake-model", "prompt": "abc", "max_tokens": 200}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(token_delay_s=0.02)


@pytest.fixture
async def url(engine: FakeEngine) -> AsyncIterator[str]:
    async with serve_in_background(build_worker_app(engine)) as base:
        yield base


async def _wait_for_abort(engine: FakeEngine) -> None:
    for _ in range(400):
        if engine.aborted:
            return
        await asyncio.sleep(0.01)


async def test_streaming_client_disconnect_aborts(url: str, engine: FakeEngine) -> None:
    async with (
        httpx.AsyncClient(base_url=url) as client,
        client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp,
    ):
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break
    await _wait_for_abort(engine)
    rid = engine.requests[0].request_id
    assert engine.aborted == [rid]
    assert rid in engine.abort_calls
    assert engine.load().num_running == 0


async def test_whole_response_client_disconnect_aborts(url: str, engine: FakeEngine) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=BODY)
    await _wait_for_abort(engine)
    assert engine.aborted == [engine.requests[0].request_id]
    assert engine.load().num_running == 0


async def test_batched_prompts_all_abort(url: str, engine: FakeEngine) -> None:
    body = {**BODY, "prompt": ["abc", "def", "ghi"], "stream": True}
    async with (
        httpx.AsyncClient(base_url=url) as client,
        client.stream("POST", "/v1/completions", json=body) as resp,
    ):
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break
    for _ in range(400):
        if len(engine.aborted) == 3:
            break
        await asyncio.sleep(0.01)
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests)
    assert len(engine.aborted) == 3
