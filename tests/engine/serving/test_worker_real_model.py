"""One end-to-end check of ``kvtoll worker`` serving the real SmolLM2-135M-Instruct
(bundled GGUF) to the official openai SDK: a factual answer, usage, and a repeated
long system prompt served from the prefix cache only under the same salt."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.serving.app import build_worker_app
from kvtoll.server import serve_in_background

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
SYSTEM = (
    "You are a concise geography tutor. Answer in one short sentence, name the city "
    "explicitly, and do not add any explanation, greeting or follow-up question. "
) * 3


@pytest.fixture
async def sdk() -> AsyncIterator[openai.AsyncOpenAI]:
    engine: AsyncEngine = build_engine(EngineConfig(num_kv_blocks=128, max_model_len=1024))
    try:
        async with serve_in_background(build_worker_app(engine)) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="internal", max_retries=0)
            yield client
            await client.close()
    finally:
        engine.shutdown()


async def test_real_model_answers_and_reuses_the_prefix(sdk: openai.AsyncOpenAI) -> None:
    model = (await sdk.models.list()).data[0].id
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
    ]

    async def ask(salt: str) -> tuple[str, int, int]:
        stream = await sdk.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": salt},
        )
        text, prompt, cached = "", 0, -1
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                prompt, cached = (
                    chunk.usage.prompt_tokens,
                    details.cached_tokens or 0 if details else 0,
                )
        return text, prompt, cached

    first, prompt_tokens, cached_first = await ask("a1" * 16)
    assert "Paris" in first
    assert cached_first == 0 and prompt_tokens > 64
    second, _, cached_second = await ask("a1" * 16)
    assert second == first  # greedy: same answer from the cached prefix
    assert cached_second >= 64 and cached_second % 16 == 0
    assert (await ask("b2" * 16))[2] == 0
