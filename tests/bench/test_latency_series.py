"""The proxy bench's spike-train test tells a periodic stall from random noise."""

from __future__ import annotations

import asyncio
import random

from bench.latency_series import client_loop, periodicity, run_client, tail

PERIODS_S = [p / 1000 for p in range(100, 501, 2)]
TIMES_S = [i * 0.013 for i in range(1000)]  # one request per 13 ms, as the bench's turns


def test_a_train_at_the_ledger_period_is_found() -> None:
    added = [8.0 if t % 0.21 < 0.014 else 1.0 for t in TIMES_S]
    found = periodicity(TIMES_S, added, 3.0, PERIODS_S)
    assert abs(found["strongest_period_s"] - 0.21) <= 0.004
    assert found["windowed_rayleigh_z"] > 5


def test_random_spikes_show_no_train() -> None:
    rng = random.Random(7)
    added = [8.0 if rng.random() < 0.06 else 1.0 for _ in TIMES_S]
    assert periodicity(TIMES_S, added, 3.0, PERIODS_S)["windowed_rayleigh_z"] < 3


def test_tail_percentiles() -> None:
    values = [float(v) for v in range(1, 1001)]
    assert tail(values) == {"p50_ms": 501.0, "p99_ms": 990.0, "p999_ms": 999.0}


def test_the_client_runs_on_the_loop_it_reports() -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    used = run_client(loop_module())
    assert used == ("uvloop" if client_loop() == "uvloop" else "asyncio")
