"""The gateway refuses to front workers that serve one model in different dtypes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.serving.app import build_worker_app
from kvtoll.server import serve_in_background
from proxy.stack import StackError, worker_models
from tests.engine.serving.serving_fakes import FakeEngine

pytestmark = pytest.mark.anyio


async def test_workers_in_one_dtype_pass_and_mixed_dtypes_are_named() -> None:
    engines = [FakeEngine(dtype="bfloat16"), FakeEngine(dtype="bfloat16"),
               FakeEngine(dtype="float32")]
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve_in_background(build_worker_app(e)))
                for e in engines]
        same = await asyncio.to_thread(worker_models, tuple(urls[:2]))
        assert same == ["fake-model"]
        with pytest.raises(StackError) as refused:
            await asyncio.to_thread(worker_models, tuple(urls))
    message = str(refused.value)
    assert "fake-model in different dtypes" in message
    assert f"bfloat16 on {urls[0]}, {urls[1]}" in message and f"float32 on {urls[2]}" in message


async def test_models_list_names_the_dtype() -> None:
    async with serve_in_background(build_worker_app(FakeEngine(dtype="bfloat16"))) as url:
        import httpx

        async with httpx.AsyncClient(base_url=url) as client:
            data = (await client.get("/v1/models")).json()["data"]
    assert data[0]["kvtoll"] == {"dtype": "bfloat16"}
