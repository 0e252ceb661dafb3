"""Worker lifecycle: ``kvtoll serve`` starts with any reachable subset of its workers
(the rest start down), a down worker is re-probed with backoff and used again once it
answers, and a worker failing a request is marked down at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from bench.chaos_worker import MODEL, make_worker
from proxy.metrics import ProxyMetrics
from proxy.pool import UpstreamPool
from proxy.stack import StackError, worker_models
from tests.proxy.helpers import free_port
from tests.proxy.scripted import ScriptedUpstream


@pytest.fixture
def live_worker() -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(make_worker(2, 0.0), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_serve_starts_with_an_unreachable_worker(live_worker: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert worker_models((dead, live_worker), timeout_s=1.0) == [MODEL]
    with pytest.raises(StackError, match="no worker could be reached"):
        worker_models((dead,), timeout_s=1.0)


class Flaky(ScriptedUpstream):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.up = False
        self.probes = 0

    async def health(self) -> bool:
        self.probes += 1
        return self.up


def test_down_worker_is_reprobed_and_comes_back() -> None:
    flaky, steady = Flaky("flaky"), ScriptedUpstream("steady")
    pool = UpstreamPool([flaky, steady], ProxyMetrics.create())

    async def scenario() -> None:
        await pool.check_all()  # as the app does before serving
        assert [u.name for u in pool.candidates()] == ["steady"]
        task = asyncio.create_task(pool.run_health_checks(30.0, min_backoff_s=0.01))
        try:
            while flaky.probes < 4:  # re-probed while down, far sooner than the interval
                await asyncio.sleep(0.01)
            flaky.up = True
            while not pool.is_healthy("flaky"):
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
        assert [u.name for u in pool.candidates()] == ["flaky", "steady"]
        pool.mark(flaky, False)  # a request saw it fail: down at once
        assert [u.name for u in pool.candidates()] == ["steady"]

    asyncio.run(scenario())
