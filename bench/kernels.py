"""Benchmark the Triton paged-attention kernels on a CUDA GPU; prints JSON figures.

* decode at batch {1, 16, 64} x context {512, 4096, 32768}: achieved memory bandwidth
  (K/V bytes read / time) and its fraction of the GPU's peak, side by side with torch
  SDPA on gathered K/V (with and without the gather), FlashAttention and FlashInfer
  where importable;
* prefill over a cached prefix: TFLOP/s (4 * H * D * attended pairs) vs SDPA/FlashInfer;
* the engine end to end with the nano-vllm recipe (256 requests, 100-1024 input and
  output tokens, ignore_eos): output tokens/s with the Triton backend, eager and with
  decode steps as CUDA graphs, and with the torch backend.

Model shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16.
Without CUDA it prints a JSON note and exits 0; ``--smoke`` instead runs tiny shapes on
CPU under the Triton interpreter (checks the script, figures meaningless).

    python bench/kernels.py [--block-size 16] [--peak-gbps 3350] [--skip-engine]
                            [--sweep] [--out results.json]

``--sweep`` also times the decode and extend kernels over block shapes, warps and
pipeline stages (bench/kernel_sweep.py); ``--out`` rewrites a JSON file after every
section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as ``python bench/<script>.py``: the repo root, for bench.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.kernel_cases import (
    BenchConfig,
    Thunk,
    kv_read_bytes,
    log,
    make_inputs,
    prefill_flops,
    time_ms,
)
from bench.kernel_engine import RANDOM_SMOLLM2

DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (512, 4096, 32768)
# Engine runs: Triton eager, Triton with decode steps as CUDA graphs, the torch backend.
ENGINE_VARIANTS = (("triton", False), ("triton", True), ("torch", False))
PREFILL_CASES = ((1, 0, 8192), (8, 0, 1024), (8, 4096, 512), (4, 16384, 1024))  # S, prefix, new
PEAK_GBPS = {"H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864}  # fmt: skip


def peak_gbps(override: float | None) -> float | None:
    """Peak DRAM bandwidth: the flag, the device-name table, or clock x bus width."""
    if override:
        return override
    props = torch.cuda.get_device_properties(0)
    for key, value in PEAK_GBPS.items():
        if key in props.name:
            return float(value)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def copy_gbps(cfg: BenchConfig) -> float | None:
    """Device-to-device copy of 2 GiB, bytes read + written per second: the bandwidth a
    kernel that streams memory can reach here (the datasheet peak is not reachable)."""
    if cfg.device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), cfg)
    return round(2 * src.numel() * src.element_size() / ms / 1e6, 1)


def _peer_rows(peers: dict[str, Callable[[], Thunk]], cfg: BenchConfig) -> dict[str, Any]:
    from bench.kernel_peers import PeerUnavailable

    rows: dict[str, Any] = {}
    for name, build in peers.items():
        try:
            rows[name] = {"ms": time_ms(build(), cfg)}
        except PeerUnavailable as exc:
            rows[name] = {"unavailable": str(exc)}
        except Exception as exc:  # a peer's own failure must not sink the run
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return rows


def bench_decode(cfg: BenchConfig, batch: int, context: int, peak: float | None) -> dict[str, Any]:
    from bench import kernel_peers as kp
    from engine.kernels.decode_attention import choose_num_splits, paged_decode_attention

    x = make_inputs(cfg, batch, context - 1, 1, seed=batch * 7 + context)
    scale = cfg.head_dim**-0.5

    def ours() -> torch.Tensor:
        return paged_decode_attention(
            x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, scale, max_seq_len=context
        )

    elem = x.k_cache.element_size()
    kv_bytes = kv_read_bytes(cfg, batch, context, elem)
    other_bytes = 2 * x.q.numel() * elem + x.block_tables.numel() * 4
    ref = kp.sdpa_decode(x, include_gather=False)()
    assert isinstance(ref, torch.Tensor)
    max_err = float((ours().float() - ref.squeeze(2).float()).abs().max())
    rows = _peer_rows(
        {
            "triton": lambda: ours,
            "sdpa_gathered": lambda: kp.sdpa_decode(x, include_gather=False),
            "gather_plus_sdpa": lambda: kp.sdpa_decode(x, include_gather=True),
            "flash_attn": lambda: kp.flash_attn_decode(x),
            "flashinfer": lambda: kp.flashinfer_decode(x),
        },
        cfg,
    )
    for row in rows.values():
        if "ms" in row:
            row["gbps"] = round((kv_bytes + other_bytes) / row["ms"] / 1e6, 1)
            row["peak_fraction"] = round(row["gbps"] / peak, 3) if peak else None
    splits = choose_num_splits(batch, cfg.num_kv_heads, context, 64)
    return {"batch": batch, "context": context, "num_splits": splits,
            "kv_bytes": kv_bytes, "max_abs_err_vs_sdpa": max_err, **rows}  # fmt: skip


def bench_decode_int8(
    cfg: BenchConfig, batch: int, context: int, peak: float | None
) -> dict[str, Any]:
    """Decode over an int8 copy of the same pool: bandwidth and the accuracy cost."""
    from engine.kernels.decode_attention import paged_decode_attention
    from engine.kernels.launch import KVScales
    from engine.kernels.reference import reference_quantize_int8

    x = make_inputs(cfg, batch, context - 1, 1, seed=batch * 7 + context)
    k8, k_scale = reference_quantize_int8(x.k_cache)
    v8, v_scale = reference_quantize_int8(x.v_cache)
    scales = KVScales(k_scale, v_scale)
    scale = cfg.head_dim**-0.5

    def run(k: torch.Tensor, v: torch.Tensor, s: KVScales | None) -> torch.Tensor:
        return paged_decode_attention(x.q, k, v, x.block_tables, x.seq_lens, scale,
                                      max_seq_len=context, kv_scales=s)  # fmt: skip

    err = (run(k8, v8, scales).float() - run(x.k_cache, x.v_cache, None).float()).abs()
    ms = time_ms(lambda: run(k8, v8, scales), cfg)
    rows = batch * context * cfg.num_kv_heads
    read = 2 * rows * (cfg.head_dim + 4) + x.block_tables.numel() * 4
    gbps = read / ms / 1e6
    return {"batch": batch, "context": context, "ms": ms, "gbps": round(gbps, 1),
            "peak_fraction": round(gbps / peak, 3) if peak else None,
            "max_abs_err_vs_float_cache": float(err.max()),
            "mean_abs_err_vs_float_cache": float(err.mean())}  # fmt: skip


def bench_prefill(cfg: BenchConfig, num_seqs: int, prefix: int, new: int) -> dict[str, Any]:
    from bench import kernel_peers as kp
    from engine.kernels.extend_attention import extend_attention

    x = make_inputs(cfg, num_seqs, prefix, new, seed=num_seqs + prefix + new)
    scale = cfg.head_dim**-0.5

    def ours() -> torch.Tensor:
        return extend_attention(
            x.q, x.k_cache, x.v_cache, x.query_start_loc, x.seq_lens, x.block_tables, scale,
            max_query_len=new,
        )  # fmt: skip

    ref = kp.sdpa_prefill(x)()
    assert isinstance(ref, torch.Tensor)  # [S, H, new, D]
    ref_tokens = ref.transpose(1, 2).reshape(x.q.shape)
    max_err = float((ours().float() - ref_tokens.float()).abs().max())
    flops = prefill_flops(cfg, num_seqs, prefix, new)
    rows = _peer_rows(
        {
            "triton": lambda: ours,
            "sdpa_gathered": lambda: kp.sdpa_prefill(x),
            "flashinfer": lambda: kp.flashinfer_prefill(x),
        },
        cfg,
    )
    for row in rows.values():
        if "ms" in row:
            row["tflops"] = round(flops / row["ms"] / 1e9, 2)
    return {"num_seqs": num_seqs, "prefix": prefix, "new_tokens": new, "flops": flops,
            "max_abs_err_vs_sdpa": max_err, **rows}  # fmt: skip


def engine_plan(args: argparse.Namespace, cfg: BenchConfig) -> Any:
    from bench.kernel_engine import EnginePlan

    return EnginePlan(
        model=None if cfg.smoke or args.model == "bundled" else args.model, smoke=cfg.smoke,
        device=cfg.device,
        block_size=cfg.block_size, kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_requests=args.engine_requests, min_len=args.min_len, max_len=args.max_len,
    )  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--peak-gbps", type=float, default=None, help="override the peak table")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--model", default=RANDOM_SMOLLM2,
                   help="engine model: a checkpoint path, 'bundled' for the SmolLM2 GGUF, or "
                   "the default: SmolLM2-135M's architecture with random weights")  # fmt: skip
    p.add_argument("--sweep", action="store_true", help="time kernel launch variants too")
    p.add_argument("--out", type=Path, default=None, help="JSON file rewritten per section")
    p.add_argument("--engine-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=float, default=16.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script only)")
    return p.parse_args(argv)


def smoke_overrides(args: argparse.Namespace) -> tuple[BenchConfig, dict[str, Any]]:
    """Tiny everything; the interpreter must be on before engine.kernels is imported."""
    os.environ["TRITON_INTERPRET"] = "1"
    args.engine_requests, args.min_len, args.max_len = 2, 3, 5
    # 16 MiB of KV: a 1 GiB cache took the smoke's three engines ~4 s of zeroing alone
    args.kv_cache_gib, args.max_num_batched_tokens, args.max_num_seqs = 1 / 64, 64, 4
    cfg = BenchConfig(4, 2, 64, args.block_size, torch.float32, "cpu", smoke=True)
    plan = {"decode": [(2, 40)], "prefill": [(2, 20, 12)],
            "sweep_decode": [(2, 40)], "decode_variants": [(16, 4, 2), (32, 2, 3)],
            "decode_splits": (1, 3),
            "sweep_extend": [(2, 20, 12)], "extend_variants": [(16, 16, 4, 2)]}  # fmt: skip
    return cfg, plan


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every section asked for; ``save`` gets the result so far after each one."""
    if args.smoke:
        cfg, plan = smoke_overrides(args)
        peak = args.peak_gbps
    else:
        from bench import kernel_sweep as ks

        cfg = BenchConfig(32, 8, 128, args.block_size, torch.bfloat16, "cuda", smoke=False)
        plan = {"decode": [(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS],
                "prefill": list(PREFILL_CASES),
                "sweep_decode": ks.DECODE_CASES, "decode_variants": ks.DECODE_VARIANTS,
                "decode_splits": ks.DECODE_SPLITS,
                "sweep_extend": ks.EXTEND_CASES, "extend_variants": ks.EXTEND_VARIANTS}  # fmt: skip
        peak = peak_gbps(args.peak_gbps)
    device = "cpu (Triton interpreter)" if cfg.smoke else torch.cuda.get_device_name(0)
    shape = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "block_size": cfg.block_size,
             "dtype": str(cfg.dtype)}  # fmt: skip
    result: dict[str, Any] = {
        "device": device, "smoke": cfg.smoke, "peak_gbps": peak, "copy_gbps": copy_gbps(cfg),
        "shape": shape, "versions": {"torch": torch.__version__, "triton": _triton_version()},
    }  # fmt: skip
    if not args.skip_decode:
        result["decode"] = []
        for batch, context in plan["decode"]:
            log(f"decode batch={batch} context={context}")
            result["decode"].append(bench_decode(cfg, batch, context, peak))
            result.setdefault("decode_int8", []).append(
                bench_decode_int8(cfg, batch, context, peak)
            )
            torch.cuda.empty_cache() if cfg.device == "cuda" else None
        save(result)
    if not args.skip_prefill:
        result["prefill"] = []
        for num_seqs, prefix, new in plan["prefill"]:
            log(f"prefill seqs={num_seqs} prefix={prefix} new={new}")
            result["prefill"].append(bench_prefill(cfg, num_seqs, prefix, new))
        save(result)
    if not args.skip_engine:
        from bench.kernel_engine import bench_engine, engine_label

        result["engine"] = []
        for backend, graphs in ENGINE_VARIANTS:
            log(f"engine backend={backend} cuda_graphs={graphs}")
            try:
                result["engine"].append(bench_engine(backend, engine_plan(args, cfg), graphs))
            except Exception as exc:  # report it, keep the kernel figures
                error = f"{type(exc).__name__}: {exc}"[:300]
                result["engine"].append({"backend": engine_label(backend, graphs),
                                         "error": error})  # fmt: skip
            save(result)
    if args.sweep:
        from bench.kernel_sweep import run_sweep

        result["sweep"] = run_sweep(cfg, plan)
        save(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(json.dumps({"skipped": True, "reason": "bench/kernels.py needs a CUDA GPU; none is "
                          "visible here (use --smoke to check the script on CPU)"}))  # fmt: skip
        return 0

    def save(result: dict[str, Any]) -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))

    print(json.dumps(run(args, save), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
