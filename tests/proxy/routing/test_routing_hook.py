"""The gateway hook over three real tiny-engine workers (real HTTP, real event feeds):
a shared prefix lands on its holder with the predicted cached tokens, unrelated
traffic spreads, and a killed worker costs no request that had not started."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.factory import build_engine
from engine.kv.hashing import TenantSalt
from engine.serving.app import build_worker_app
from kvtoll.server import serve_in_background
from proxy.routing.hook import RoutingOptions, RoutingStack
from proxy.routing.registry import RegistryConfig
from proxy.routing.types import WorkerId
from proxy.upstream.base import Upstream, UpstreamError, UpstreamRequest, UpstreamUsage
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig

SALT = TenantSalt(b"t" * 16)


def _request(request_id: str, prompt: list[int]) -> UpstreamRequest:
    body = {"model": "kvtoll-tiny", "prompt": prompt, "max_tokens": 2}
    return UpstreamRequest(request_id, "completion", "kvtoll-tiny", body, SALT, tuple(prompt))


async def _send(
    stack: RoutingStack,
    upstreams: list[Upstream],
    request: UpstreamRequest,
    failures: list[str] | None = None,
) -> tuple[str, UpstreamUsage, int]:
    """The gateway's loop in miniature (proxy/service.py): try the ranked upstreams
    until one streams, tell the hook when it started and when it ended."""
    for upstream in stack.hook.rank(upstreams, request):
        stream = upstream.stream(request)
        try:
            first = await anext(stream)
        except UpstreamError as exc:
            assert exc.retryable
            if failures is not None:
                failures.append(upstream.name)
            continue
        stack.hook.started(upstream, request)
        predicted = stack.router.predicted_cached_tokens(request.request_id)
        items = [first, *[item async for item in stream]]
        usage = items[-1]
        assert isinstance(usage, UpstreamUsage)
        stack.hook.release(upstream, request, usage)
        return upstream.name, usage, predicted or 0
    raise AssertionError("no upstream answered")


async def _until_indexed(stack: RoutingStack, worker: str) -> None:
    while stack.router.precise.num_blocks(WorkerId(worker)) == 0:
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _workers(n: int) -> AsyncIterator[list[tuple[str, contextlib.AsyncExitStack]]]:
    engines = [build_engine(EngineConfig.tiny()) for _ in range(n)]
    stacks = [contextlib.AsyncExitStack() for _ in range(n)]
    try:
        urls = [
            await s.enter_async_context(serve_in_background(build_worker_app(e)))
            for s, e in zip(stacks, engines, strict=True)
        ]
        yield list(zip(urls, stacks, strict=True))
    finally:
        for s in stacks:
            await s.aclose()
        for e in engines:
            e.shutdown()


def test_prefix_lands_on_its_holder_and_a_dead_worker_loses_no_request() -> None:
    async def scenario() -> None:
        async with _workers(3) as workers:
            upstreams: list[Upstream] = [
                HttpUpstream(HttpUpstreamConfig(base_url=url)) for url, _ in workers
            ]
            options = RoutingOptions(
                registry=RegistryConfig(check_interval_s=30.0), events_interval_s=0.05
            )
            stack = RoutingStack(options, [(u.name, u.name) for u in upstreams])
            await stack.start()
            try:
                prefix = [(11 * i) % 200 + 1 for i in range(120)]
                spread: Counter[str] = Counter()
                for i in range(4):  # unrelated traffic first, so the prefix is no common one
                    spread[(await _send(stack, upstreams, _request(f"u{i}", [i + 1] * 30)))[0]] += 1
                holder, _, _ = await _send(stack, upstreams, _request("p0", [*prefix, 1]))
                await _until_indexed(stack, holder)
                for i in range(3):
                    name, usage, predicted = await _send(
                        stack, upstreams, _request(f"p{i + 1}", [*prefix, 50 + i, 60 + i])
                    )
                    assert name == holder
                    assert usage.cached_tokens == predicted == 112  # 7 blocks of 16
                    unrelated = _request(f"v{i}", [100 + i] * (20 + i))
                    spread[(await _send(stack, upstreams, unrelated))[0]] += 1
                assert len(spread) == 3  # unrelated traffic is spread over every worker
                holder_stack = next(s for url, s in workers if url == holder)
                await holder_stack.aclose()  # kill the holder; no health check runs meanwhile
                failures: list[str] = []
                after = _request("after", [*prefix, 7])
                name, usage, predicted = await _send(stack, upstreams, after, failures)
                assert failures == [holder]  # tried first, refused before any byte: retried
                assert name != holder and usage.completion_tokens > 0
                assert usage.cached_tokens == predicted == 0
                assert WorkerId(holder) not in {
                    s.worker_id for s in stack.registry.healthy_workers()
                }
                snap = stack.router.calibration.snapshot()
                assert snap.num_requests == snap.num_exact == 12
            finally:
                await stack.aclose()
                for u in upstreams:
                    await u.aclose()

    asyncio.run(scenario())
