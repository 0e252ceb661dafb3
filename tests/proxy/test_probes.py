"""Dependency probes behind /readyz: a failing or hanging dependency is down, with the
reason, and back once its probe passes; a hanging probe is never started twice."""

from __future__ import annotations

import asyncio

from proxy.probes import DependencyProbes


def test_failing_hanging_and_recovering_probes() -> None:
    state = {"db": "ok", "redis": "ok"}
    started = {"db": 0, "redis": 0}
    never = asyncio.Event()

    async def probe(name: str) -> None:
        started[name] += 1
        if state[name] == "fail":
            raise ConnectionRefusedError("connection refused")
        if state[name] == "hang":
            await never.wait()

    async def scenario() -> None:
        probes = DependencyProbes({"database": lambda: probe("db"),
                                   "redis": lambda: probe("redis")}, timeout_s=0.05)
        await probes.check_all()
        assert probes.down() == []
        state["db"], state["redis"] = "hang", "fail"
        await probes.check_all()
        results = probes.results()
        assert probes.down() == ["database", "redis"]
        assert "no answer" in results["database"].detail
        assert "refused" in results["redis"].detail
        await probes.check_all()  # the hanging probe is still running: not started again
        assert started["db"] == 2
        assert "no answer for" in probes.results()["database"].detail
        state["redis"] = "ok"
        never.set()
        state["db"] = "ok"
        await asyncio.sleep(0)
        await probes.check_all()
        assert probes.down() == []
        await probes.aclose()

    asyncio.run(scenario())
