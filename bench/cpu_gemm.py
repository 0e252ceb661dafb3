"""bfloat16 linear layers: the native AVX512-BF16 kernel (engine.kernels.cpu_gemm) vs
torch's oneDNN-packed bfloat16 matmul (engine.model.packed_linear), same run (a
benchmark, not a test); beside them, labelled QUANTIZED, the native int8 kernel
(AVX512-VNNI, per-channel int8 weights, per-row int8 inputs) on the same weights.

Usage::

    .venv/bin/python -m bench.cpu_gemm [--threads 2] [--runs 15] [--rows 1,16,64,512]

SmolLM2-135M's projections (stacked q/k/v 576 -> 960, o 576 -> 576, stacked gate/up
576 -> 3,072, down 1,536 -> 576: 30 layers' weights in turn, as a decode step reads
them; the LM head 576 -> 49,152 once), random weights; interleaved best-of-``runs``
microseconds per call, GFLOP/s (GOP/s for int8) and the speed-ups, and how many outputs
differ from oneDNN's (the sums run in another order: an output may differ in its last
bfloat16 bit).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.engine_peers import cpu_description
from engine.kernels.cpu_gemm import (
    Int8Weight,
    NativeGemm,
    NativeInt8Gemm,
    gemm_here,
    int8_gemm_here,
)
from engine.model.packed_linear import PackedLinear
from engine.timing import interleaved_best

SHAPES = {  # name: (in, out, weights in turn)
    "qkv_proj": (576, 960, 30),
    "o_proj": (576, 576, 30),
    "gate_up_proj": (576, 3072, 30),
    "down_proj": (1536, 576, 30),
    "lm_head": (576, 49152, 1),
}


def _calls(
    gemm: NativeGemm,
    x: torch.Tensor,
    packs: list[torch.Tensor],
    layers: list[PackedLinear],
    n: int,
    threads: int,
    int8: tuple[NativeInt8Gemm, list[Int8Weight]] | None,
) -> dict[str, Callable[[], object]]:
    """One pass of ``x`` through every layer, on each product."""

    def native() -> object:
        return [gemm.linear(x, p, n, threads) for p in packs]

    def onednn() -> object:
        return [layer(x) for layer in layers]

    calls: dict[str, Callable[[], object]] = {"native": native, "onednn": onednn}
    if int8 is not None:
        int8_gemm, weights = int8

        def int8_native() -> object:
            return [int8_gemm.linear(x, w, threads) for w in weights]

        calls["int8_native"] = int8_native
    return calls


def measure(rows_list: list[int], threads: int, runs: int) -> dict[str, Any]:
    gemm = gemm_here()
    if gemm is None:
        return {"skipped": "no AVX512-BF16 or no compiler: the native kernel is not built here"}
    int8_gemm = int8_gemm_here()
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for name, (k, n, count) in SHAPES.items():
            layers: list[PackedLinear] = []
            packs: list[torch.Tensor] = []
            for _ in range(count):
                linear = torch.nn.utils.skip_init(nn.Linear, k, n, bias=False)
                linear.weight.copy_(torch.randn(n, k, generator=gen) * k**-0.5)
                layer = PackedLinear.from_linear(linear.to(torch.bfloat16), "onednn")
                layers.append(layer)
                packs.append(gemm.pack(layer.weight))
            int8 = None
            if int8_gemm is not None:
                int8 = (int8_gemm, [int8_gemm.quantize(layer.weight) for layer in layers])
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                differ = int((gemm.linear(x, packs[0], n, threads) != layers[0](x)).sum())
                calls = _calls(gemm, x, packs, layers, n, threads, int8)
                per = {key: t / count for key, t in interleaved_best(calls, runs).items()}
                flop = 2 * rows * k * n
                case = {
                    "in": k, "out": n, "rows": rows,
                    **{f"{key}_us": round(t * 1e6, 1) for key, t in per.items()},
                    **{f"{key}_gflop_per_s": round(flop / t / 1e9, 1) for key, t in per.items()},
                    "speedup": round(per["onednn"] / per["native"], 2),
                    "outputs_differing_from_onednn": differ,
                    "outputs": rows * n,
                }  # fmt: skip
                if "int8_native" in per:  # QUANTIZED: its figure is GOP/s
                    speedup = per["native"] / per["int8_native"]
                    case["int8_speedup_vs_native_bf16"] = round(speedup, 2)
                out[f"{name}_{rows}"] = case
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rows", default="1,16,64,512", help="comma-separated row counts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        ap.error(f"--rows must list positive row counts, got {args.rows!r}")
    result = {"cpu": cpu_description(), "threads": args.threads,
              "cases": measure(rows, args.threads, args.runs)}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
