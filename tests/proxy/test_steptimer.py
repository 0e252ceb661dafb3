"""StepTimer (per-await timeouts with one timer) and the gateway's first-byte and idle
timeouts built on it: a stalled upstream is a 502 / an SSE error event with one
ledger row, a slow first byte moves on to the next upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from billing.models import RequestStatus
from kvtoll.settings import Settings
from proxy.config import ProxyConfig
from proxy.steptimer import StepTimer
from tests.proxy.helpers import MODEL, LiveServer, Tenants, build_app, settled_rows
from tests.proxy.scripted import ScriptedUpstream


def test_a_step_over_its_limit_times_out_and_leaves_the_task_usable() -> None:
    async def run() -> int:
        timer = StepTimer()
        with pytest.raises(TimeoutError), timer(0.05):
            await asyncio.sleep(5)
        await asyncio.sleep(0)  # no cancellation left pending on the task
        task = asyncio.current_task()
        assert task is not None
        timer.close()
        return task.cancelling()

    assert asyncio.run(run()) == 0


def test_many_short_steps_longer_than_one_limit_in_total() -> None:
    """The handle armed by the first step fires during a later one and is re-armed for
    that step's own deadline instead of cancelling it."""
    async def run() -> int:
        timer = StepTimer()
        done = 0
        for _ in range(12):
            with timer(0.25):
                await asyncio.sleep(0.05)
            done += 1
        timer.close()
        return done

    assert asyncio.run(run()) == 12


def test_time_between_steps_does_not_count() -> None:
    async def run() -> str:
        timer = StepTimer()
        with timer(0.1):
            await asyncio.sleep(0)
        await asyncio.sleep(0.3)  # the handle fires with no step running: ignored
        with timer(0.1):
            await asyncio.sleep(0.01)
        timer.close()
        return "ok"

    assert asyncio.run(run()) == "ok"


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def victim(timer: StepTimer) -> None:
        with timer(10):
            await asyncio.sleep(10)

    async def run() -> bool:
        timer = StepTimer()
        task = asyncio.ensure_future(victim(timer))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        timer.close()
        return task.cancelled()

    assert asyncio.run(run())


@pytest.fixture
def stalling(settings: Settings, db: sessionmaker[Session],
             tenants: Tenants) -> Iterator[LiveServer]:
    """First upstream: slow first byte; second: first word at once, then stalls."""

    class StallsAfterFirst(ScriptedUpstream):
        async def _stream(self, request):  # type: ignore[no-untyped-def]
            first = True
            async for item in super()._stream(request):
                if not first:
                    await asyncio.sleep(30)
                first = False
                yield item

    config = ProxyConfig(upstream_first_byte_timeout_s=0.3, upstream_idle_timeout_s=0.3)
    upstreams = [ScriptedUpstream("slow-first", delay_s=30), StallsAfterFirst("stalls")]
    app = build_app(settings, db, upstreams=upstreams, config=config)
    with LiveServer(app) as live:
        yield live


def test_slow_first_byte_then_stall(stalling: LiveServer, tenants: Tenants,
                                    db: sessionmaker[Session]) -> None:
    headers = {"Authorization": f"Bearer {tenants.key_a}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    whole = httpx.post(stalling.url + "/v1/chat/completions", json=body, headers=headers,
                       timeout=30)
    assert whole.status_code == 502, whole.text
    assert whole.json()["error"]["code"] == "upstream_error"
    assert "stalled" in whole.json()["error"]["message"]
    with httpx.stream("POST", stalling.url + "/v1/chat/completions", headers=headers,
                      json={**body, "stream": True}, timeout=30) as streamed:
        assert streamed.headers["x-kvtoll-worker"] == "stalls"  # moved on from slow-first
        text = streamed.read().decode()
    assert '"content":"word0 "' in text
    assert "upstream failed mid-stream: upstream stalled" in text
    rows = settled_rows(db, 2)
    assert [(r.status, r.worker, r.completion_tokens) for r in rows] == [
        (RequestStatus.UPSTREAM_ERROR, "stalls", 1)] * 2
