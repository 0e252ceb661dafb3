"""The trace simulator and ``kvtoll bench routing`` on small synthetic traces."""

from __future__ import annotations

import json
import random
from pathlib import Path

import typer
from typer.testing import CliRunner

from bench.cli import routing_command
from bench.routing.simulate import LRUBlockCache, SimConfig, simulate
from bench.routing.trace import block_hash_of_id, infinite_cache_hit_rate, parse_trace
from proxy.routing.index import PreciseIndex
from proxy.routing.policy import make_policy
from proxy.routing.types import WorkerId


def conversation_trace(num_sessions: int = 23, turns: int = 4, seed: int = 0) -> list[str]:
    """Multi-turn sessions behind one global system block (id 0): each turn's prompt
    is the previous prompt plus two new blocks; turns arrive 10 to 40 s apart."""
    rng = random.Random(seed)
    next_id = 1
    rows = []
    for _session in range(num_sessions):
        ids = [0]
        at = rng.uniform(0, 30)
        for _ in range(turns):
            ids = [*ids, next_id, next_id + 1]
            next_id += 2
            at += rng.uniform(10, 40)
            rows.append(
                {
                    "timestamp": int(at * 1000),
                    "input_length": len(ids) * 512 - 100,
                    "output_length": 50,
                    "hash_ids": list(ids),
                }
            )
    return [json.dumps(r) for r in rows]


CONFIG = SimConfig(num_workers=4, cache_tokens=40 * 512, prefill_tokens_per_s=50_000.0)


def test_cache_aware_beats_round_robin_on_a_trace_with_prefixes() -> None:
    requests = parse_trace(conversation_trace())
    ceiling = infinite_cache_hit_rate(requests, 512)
    cache_aware = simulate(requests, CONFIG, make_policy("cache_aware"))
    round_robin = simulate(requests, CONFIG, make_policy("round_robin"))
    assert cache_aware.num_requests == round_robin.num_requests == len(requests)
    assert round_robin.hit_rate < cache_aware.hit_rate <= ceiling
    assert cache_aware.hit_rate > 0.85 * ceiling
    assert cache_aware.prediction_exact_fraction > 0.9  # the index mirrors the caches
    assert sum(cache_aware.requests_per_worker) == len(requests)
    assert min(cache_aware.requests_per_worker) > 0  # the shared block 0 pulls nobody


def test_without_kv_events_the_approximate_index_still_finds_the_prefixes() -> None:
    requests = parse_trace(conversation_trace())
    config = SimConfig(
        num_workers=4, cache_tokens=40 * 512, prefill_tokens_per_s=50_000.0, kv_events=False
    )
    cache_aware = simulate(requests, config, make_policy("cache_aware"))
    round_robin = simulate(requests, config, make_policy("round_robin"))
    assert cache_aware.hit_rate > round_robin.hit_rate
    assert cache_aware.hit_rate > 0.8 * infinite_cache_hit_rate(requests, 512)


def test_lru_cache_events_keep_the_index_identical_to_the_cache() -> None:
    rng = random.Random(1)
    cache = LRUBlockCache(capacity_blocks=12)
    index = PreciseIndex()
    w = WorkerId("w")
    for _ in range(200):
        root = rng.randrange(4)
        prompt = [block_hash_of_id(root * 100 + i) for i in range(rng.randrange(1, 8))]
        result = index.apply_events(w, cache.admit(prompt))
        assert not result.reset
        probe = [block_hash_of_id(rng.randrange(4) * 100 + i) for i in range(8)]
        assert index.match(probe, [w])[w] == cache.leading_hits(probe)
    assert index.num_blocks(w) == len(cache) <= 12


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(routing_command)
    return app


def test_bench_cli_prints_one_object_per_policy(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(conversation_trace(num_sessions=6)) + "\n")
    runner = CliRunner()
    one = runner.invoke(
        _app(),
        [
            "--trace",
            str(trace),
            "--workers",
            "2",
            "--cache-tokens",
            "20480",
            "--policy",
            "round_robin",
        ],
    )
    assert one.exit_code == 0, one.output
    figures = json.loads(one.stdout)
    for key in ("hit_rate", "ttft_mean", "ttft_p90", "imbalance", "infinite_cache_hit_rate"):
        assert key in figures
    every = runner.invoke(_app(), ["--trace", str(trace), "--policy", "all"])
    assert every.exit_code == 0, every.output
    assert set(json.loads(every.stdout)) == {
        "cache_aware",
        "round_robin",
        "least_loaded",
        "consistent_hash",
    }


def test_bench_cli_rejects_bad_input_with_exit_code_2(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(_app(), ["--trace", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "not found" in missing.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert runner.invoke(_app(), ["--trace", str(bad)]).exit_code == 2
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(conversation_trace(num_sessions=1)))
    assert runner.invoke(_app(), ["--trace", str(good), "--policy", "random"]).exit_code == 2
    assert runner.invoke(_app(), ["--trace", str(good), "--workers", "0"]).exit_code == 2
