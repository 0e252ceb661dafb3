"""AsyncEngine: streaming, n choices, abort and client disconnect free blocks, events."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.api import (
    EngineRejected,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    KVEventKind,
    SamplingParams,
)
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_engine
from engine.kv.hashing import TenantSalt, hash_prompt_blocks

PROMPT = tuple(range(3, 43))  # 40 tokens: 2 full blocks
# 50 steps whatever the tiny model samples (an early EOS would end the stream first)
FIFTY_TOKENS = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


async def _collect(engine: object, req: GenerationRequest) -> list[GenerationChunk]:
    return [c async for c in engine.generate(req)]  # type: ignore[attr-defined]


def test_stream_abort_and_disconnect_free_blocks(tiny_model: LoadedModel) -> None:
    async def scenario() -> None:
        engine = build_engine(EngineConfig.tiny(), tiny_model)
        total = engine.load().num_total_blocks
        try:
            chunks = await _collect(
                engine,
                GenerationRequest("a", PROMPT, SamplingParams(max_tokens=5, n=2, temperature=0.0)),
            )
            assert {c.index for c in chunks} == {0, 1}
            assert [c.finish_reason for c in chunks if c.finish_reason] == [FinishReason.LENGTH] * 2
            assert sum(len(c.token_ids) for c in chunks if c.index == 0) == 5

            # client goes away: closing the stream aborts and frees
            gen = engine.generate(
                GenerationRequest("b", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
            )
            first = await gen.__anext__()
            assert first.request_id == "b"
            await gen.aclose()  # type: ignore[attr-defined]
            await _wait_idle(engine, total)

            # explicit abort ends the stream with an abort chunk
            got: list[GenerationChunk] = []

            async def consume() -> None:
                async for c in engine.generate(
                    GenerationRequest("c", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
                ):
                    got.append(c)
                    if len(got) == 2:
                        await engine.abort("c")

            await asyncio.wait_for(consume(), 30)
            assert got[-1].finish_reason is FinishReason.ABORT
            await _wait_idle(engine, total)

            with pytest.raises(EngineRejected, match=r"^temperature"):
                await _collect(
                    engine, GenerationRequest("d", PROMPT, SamplingParams(temperature=-1))
                )
            assert (
                await _collect(engine, GenerationRequest("e", PROMPT, SamplingParams(max_tokens=2)))
            )[-1].finish_reason
        finally:
            await engine.close()

    asyncio.run(scenario())


async def _wait_idle(engine: object, total: int) -> None:
    for _ in range(200):
        load = engine.load()  # type: ignore[attr-defined]
        if load.num_running == 0 and load.num_waiting == 0 and load.num_free_blocks == total:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {engine.load()}")  # type: ignore[attr-defined]


def test_prefix_hit_reports_cached_tokens_and_kv_events(tiny_model: LoadedModel) -> None:
    salt = TenantSalt(b"tenant-1")

    async def scenario() -> None:
        engine = build_engine(EngineConfig.tiny(), tiny_model)
        try:
            p = SamplingParams(max_tokens=3, temperature=0.0)
            cold = await _collect(engine, GenerationRequest("x", PROMPT, p, salt=salt))
            warm = await _collect(engine, GenerationRequest("y", PROMPT, p, salt=salt))
            other = await _collect(
                engine, GenerationRequest("z", PROMPT, p, salt=TenantSalt(b"tenant-2"))
            )
            assert cold[-1].cached_tokens == 0
            assert warm[-1].cached_tokens == 32
            assert other[-1].cached_tokens == 0
            assert [t for c in warm for t in c.token_ids] == [t for c in cold for t in c.token_ids]
            events = engine.kv_events(0)
            assert [e.seq for e in events] == list(range(len(events)))
            stored = [h for e in events if e.kind is KVEventKind.STORED for h in e.block_hashes]
            assert hash_prompt_blocks(PROMPT, 16, salt) == stored[:2]
            assert engine.kv_events(len(events)) == []
            assert engine.kv_events(1, limit=1) == events[1:2]
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_a_failing_step_fails_the_stream_instead_of_hanging(tiny_model: LoadedModel) -> None:
    async def scenario() -> None:
        engine = build_engine(EngineConfig.tiny(), tiny_model)
        model = engine.engine.runner.model
        real_run_layers = model.run_layers
        calls = 0

        def flaky(*args: Any) -> None:  # fault injection in the model, once
            nonlocal calls  # (a step runs its layers in one call or one call per layer)
            calls += 1
            if calls == 3:
                raise RuntimeError("device lost")
            real_run_layers(*args)

        model.run_layers = flaky  # type: ignore[method-assign]
        try:
            with pytest.raises(RuntimeError, match="device lost"):
                await asyncio.wait_for(
                    _collect(engine, GenerationRequest("f", PROMPT, FIFTY_TOKENS)),
                    30,
                )
            await _wait_idle(engine, engine.load().num_total_blocks)
            ok = await _collect(
                engine, GenerationRequest("g", PROMPT, SamplingParams(max_tokens=3))
            )
            assert ok[-1].finish_reason is not None
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_a_steps_chunks_wake_the_event_loop_once(tiny_model: LoadedModel) -> None:
    """Six streams decoding together: their chunks reach the loop in one call a step
    (not one a chunk), each stream's in order."""

    async def scenario() -> None:
        engine = build_engine(EngineConfig.tiny(), tiny_model)
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        wakeups = 0

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        try:
            results = await asyncio.gather(
                *(_collect(engine, GenerationRequest(f"s{i}", PROMPT, params)) for i in range(6))
            )
        finally:
            loop.call_soon_threadsafe = real  # type: ignore[method-assign]
            await engine.close()
        chunks = sum(len(r) for r in results)
        for r in results:
            assert [c.completion_tokens for c in r] == sorted(c.completion_tokens for c in r)
            assert r[-1].completion_tokens == 8 and r[-1].finish_reason == FinishReason.LENGTH
        assert chunks >= 6 * 8
        assert wakeups <= engine.engine.num_steps < chunks

    asyncio.run(scenario())
