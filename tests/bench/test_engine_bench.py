"""The engine benchmark's helpers: the HTTP driver against a real kvtoll worker
process (tiny model), the answers' agreement, the phase timer's exclusive times, and
the table's rows, ratios and merge."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.engine_http import run_workload, text_agreement
from bench.engine_peers import median_run, split_budget
from bench.engine_profile import PhaseTimer
from bench.engine_servers import kvtoll_spec, serving
from bench.engine_table import chart, merge, rows, table
from engine.api import TINY_MODEL
from engine.kernels import native_build


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_workload_through_a_real_worker(tmp_path: Path, kv_cache_dtype: str) -> None:
    """The worker as the bench starts it, also with its int8 KV cache (where the
    native kernels build: elsewhere the worker refuses it)."""
    if kv_cache_dtype == "int8" and native_build.unavailable_reason() is not None:
        pytest.skip("an int8 KV cache needs the native CPU kernels")
    spec = kvtoll_spec("float32", tmp_path, model=TINY_MODEL, max_model_len=256,
                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    assert (spec.name == "kvtoll-kvint8") == (kv_cache_dtype == "int8")
    prompts = [[5, 6, 7], [9] * 40, [11, 12]]
    max_tokens = [4, 9, 1]
    with serving(spec):
        figures, texts = asyncio.run(run_workload(spec.endpoint, prompts, max_tokens))
        again, texts_again = asyncio.run(run_workload(spec.endpoint, prompts, max_tokens))
    assert figures["output_tokens"] == again["output_tokens"] == 14
    assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"] <= figures["seconds"]
    assert texts == texts_again  # greedy: the same answers twice
    assert f"{spec.name}-worker.log" in {p.name for p in tmp_path.iterdir()}


def test_text_agreement_counts_identical_and_common_prefixes() -> None:
    got = text_agreement(["abcd", "abxx", ""], ["abcd", "abcd", ""])
    assert got == {"identical_answers": 2, "answers": 3, "mean_common_prefix_fraction": 0.5}


def test_phase_timer_charges_exclusive_time() -> None:
    now = [0.0]

    def clock() -> float:  # every reading advances time by one unit
        now[0] += 1.0
        return now[0]

    timer = PhaseTimer(clock)
    inner = timer.wrap("inner", lambda: None)
    outer = timer.wrap("outer", lambda: [inner() for _ in range(3)])
    outer()
    assert timer.calls == {"inner": 3, "outer": 1}
    # each inner call spans one tick; outer spans 7 ticks, 3 of them inside inner
    assert timer.seconds == {"inner": 3.0, "outer": 4.0}


def _result() -> dict[str, object]:
    return {
        "dtype": "bfloat16", "requests": 64, "prompt_tokens": 100,
        "cpu": {"model_name": "Test CPU", "logical_cpus": 2, "amx": False},
        "http": {"kvtoll": {"output_tokens_per_s": 120.0, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0},
                 "vllm": {"output_tokens_per_s": 100.0, "ttft_p50_s": 1.5, "ttft_p99_s": 3.0}},
        "hf_transformers": {"output_tokens_per_s": 30.0},
        "linear_bound": {"output_tokens_per_s_bound": 200.0},
    }  # fmt: skip


def test_rows_give_ratios_to_vllm_and_the_bound(tmp_path: Path) -> None:
    got = {r["peer"]: r for r in rows(_result())}
    assert got["kvtoll (HTTP worker)"]["vs_vllm_cpu"] == 1.2
    assert got["kvtoll (HTTP worker)"]["fraction_of_linear_bound"] == 0.6
    assert got["HF transformers generate"]["ttft_p50_s"] is None
    assert "Test CPU" in table(_result()) and "AMX: no" in table(_result())
    chart(_result(), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_a_budget_suffix_sets_the_workers_step_budget(tmp_path: Path) -> None:
    assert split_budget("kvtoll:512") == ("kvtoll", 512)
    assert split_budget("kvtoll-kvint8:2048") == ("kvtoll-kvint8", 2048)
    assert split_budget("kvtoll@/work/other:512") == ("kvtoll@/work/other", 512)
    assert split_budget("kvtoll") == ("kvtoll", None)
    assert split_budget("vllm") == ("vllm", None)
    for bad in ("kvtoll:0", "kvtoll:x", "kvtoll:"):
        with pytest.raises(ValueError, match="budget"):
            split_budget(bad)
    spec = kvtoll_spec("float32", tmp_path, max_batched_tokens=512)
    assert spec.name == "kvtoll:512"
    assert spec.command[spec.command.index("--max-batched-tokens") + 1] == "512"
    assert "--max-batched-tokens" not in kvtoll_spec("float32", tmp_path).command
    result = _result()
    result["http"]["kvtoll-kvint8:512"] = {"output_tokens_per_s": 90.0}  # type: ignore[index]
    got = {r["peer"]: r for r in rows(result)}
    assert got["kvtoll-kvint8 QUANTIZED, 512-token steps (HTTP worker)"]["vs_vllm_cpu"] == 0.9


def test_repeated_peers_report_their_median_run() -> None:
    runs = [{"output_tokens_per_s": t, "ttft_p50_s": t / 100} for t in (300.0, 100.0, 200.0, 400.0)]
    got = median_run(runs)
    assert got["output_tokens_per_s"] == 200.0 and got["ttft_p50_s"] == 2.0
    assert got["runs_output_tokens_per_s"] == [300.0, 100.0, 200.0, 400.0]
    assert median_run(runs[:1]) == runs[0] and "runs_output_tokens_per_s" not in runs[2]


def test_merge_joins_split_runs_and_refuses_other_workloads() -> None:
    first = _result()
    second = {"requests": 64, "http": {"kvtoll-int8": {"output_tokens_per_s": 150.0}}}
    merged = merge([json.loads(json.dumps(first)), second])
    assert set(merged["http"]) == {"kvtoll", "vllm", "kvtoll-int8"}
    with pytest.raises(ValueError, match="requests"):
        merge([first, {"requests": 16}])
