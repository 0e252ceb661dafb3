"""The gateway hook in front of servers without KV events and without token ids:
prompt bytes feed the approximate index, so conversations stick to a worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from engine.kv.hashing import TenantSalt
from proxy.routing.hook import RoutingHook, prompt_bytes
from proxy.routing.policy import make_policy
from proxy.routing.router import PrefixRouter, WorkerStatus
from proxy.routing.types import WorkerId, WorkerLoad
from proxy.upstream.base import UpstreamDelta, UpstreamRequest, UpstreamUsage

NAMES = ["vllm-a", "vllm-b", "vllm-c"]


class NamedUpstream:
    """Stand-in for another part (an HTTP upstream): only its name matters to ranking."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    async def stream(
        self, request: UpstreamRequest
    ) -> AsyncIterator[UpstreamDelta | UpstreamUsage]:
        yield UpstreamUsage(0, 0)

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


class NoEventsSource:
    def healthy_workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(WorkerId(n), WorkerLoad(), False) for n in NAMES]

    def report_failure(self, worker_id: WorkerId) -> None:
        raise AssertionError("no failure expected")


def _chat(request_id: str, messages: list[dict[str, Any]], salt: bytes) -> UpstreamRequest:
    body = {"model": "m", "messages": messages}
    return UpstreamRequest(request_id, "chat", "m", body, TenantSalt(salt))


def test_prompt_bytes_of_an_earlier_turn_prefix_the_next_turn() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    assert prompt_bytes({"messages": second}).startswith(prompt_bytes({"messages": first}))
    assert prompt_bytes({"prompt": ["abc"]}) == b"abc"
    assert prompt_bytes({"prompt": ["a", "b"]}) == b""


def test_a_conversation_sticks_to_its_worker_and_tenants_do_not_share() -> None:
    router = PrefixRouter(make_policy("cache_aware"), NoEventsSource(), 16)
    hook = RoutingHook(router)
    upstreams = [NamedUpstream(n) for n in NAMES]
    history = [{"role": "system", "content": "You are a careful assistant. " * 20}]

    async def scenario() -> None:
        for i in range(4):  # unrelated conversations first
            other = [{"role": "user", "content": f"unrelated {i} " * 30}]
            ranked = hook.rank(upstreams, _chat(f"u{i}", other, b"a" * 16))
            hook.release(ranked[0], _chat(f"u{i}", other, b"a" * 16))
        turn = [*history, {"role": "user", "content": "first question " * 10}]
        first = (hook.rank(upstreams, _chat("t0", turn, b"a" * 16)))[0]
        hook.release(first, _chat("t0", turn, b"a" * 16))
        for i in range(3):
            turn = [
                *turn,
                {"role": "assistant", "content": f"answer {i}"},
                {"role": "user", "content": f"next question {i}"},
            ]
            request = _chat(f"t{i + 1}", turn, b"a" * 16)
            ranked = hook.rank(upstreams, request)
            assert ranked[0].name == first.name
            assert (router.predicted_cached_tokens(request.request_id) or 0) > 100
            hook.release(ranked[0], request)
        stranger = _chat("s", turn, b"b" * 16)  # same text, another tenant's salt
        hook.rank(upstreams, stranger)
        assert router.predicted_cached_tokens("s") == 0

    asyncio.run(scenario())


def test_a_single_candidate_is_returned_and_its_request_still_tracked() -> None:
    router = PrefixRouter(make_policy("cache_aware"), NoEventsSource(), block_size=4)
    hook = RoutingHook(router)
    only = NamedUpstream("vllm-b")
    long_turn = [{"role": "user", "content": "tell me about the weather in Paris " * 4}]
    first = _chat("r1", long_turn, b"s" * 16)
    assert hook.rank([only], first) == [only]
    assert router.inflight_worker("r1") == "vllm-b" and router.pending_tokens(WorkerId("vllm-b"))
    hook.started(only, first)
    hook.release(only, first, UpstreamUsage(10, 1))
    assert router.inflight_worker("r1") is None
    # what was sent is in the approximate index: the same prompt now predicts a hit
    assert hook.rank([only], _chat("r2", long_turn, b"s" * 16)) == [only]
    assert router.predicted_cached_tokens("r2")
