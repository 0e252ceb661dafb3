"""bfloat16 linear layers: the native AVX512-BF16 kernel (engine.kernels.cpu_gemm) vs
torch's oneDNN-packed bfloat16 matmul (engine.model.packed_linear), same run (a
benchmark, not a test); beside them, labelled QUANTIZED, the native int8 kernel
(AVX512-VNNI, per-channel int8 weights, per-row int8 inputs) on the same weights.

Usage::

    .venv/bin/python -m bench.cpu_gemm [--threads 2] [--runs 15] [--rows 1,16,64,512] [--avx2]

``--avx2``: instead, the AVX2 int8 kernel (engine.kernels.cpu_gemm_avx2: per-channel int8
weights, per-row int16 inputs, the quantized path where the AVX-512 kernels do not build)
vs torch's oneDNN-packed *float32* matmul, the model's path on such a CPU; its outputs'
relative error against the float32 products is reported too. On an AVX2-only EPYC (AMD
family 25 model 1, 2 threads; microseconds per call, AVX2 int8 vs oneDNN float32)::

    k x n (layer)          rows 1         16             64               512
    576 x 960 (q/k/v)        69 vs 233     148 vs 390     460 vs 902     3,437 vs 4,549
    576 x 576 (o)            51 vs 181     119 vs 333     311 vs 667     2,504 vs 3,706
    576 x 3,072 (gate/up)   160 vs 617     393 vs 1,011 1,253 vs 2,338   9,897 vs 13,443
    1,536 x 576 (down)       74 vs 292     175 vs 514     542 vs 1,200   4,248 vs 6,815
    576 x 49,152 (head)   1,604 vs 5,733 5,897 vs 13,003 20,734 vs 32,143 162,928 vs 214,039

3.4-4.0x at 1 row (weights streamed: a quarter of the bytes), 2.2-2.9x at 16, 1.6-2.2x
at 64, 1.3-1.6x at 512 (165-213 GOP/s against oneDNN's 92-135 GFLOP/s); relative error
of an output against the float32 product 0.0072-0.0082 (random weights).

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
from engine.kernels.cpu_gemm_avx2 import Avx2Int8Gemm, Avx2Int8Weight, avx2_int8_gemm_here
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


def _avx2_calls(
    gemm: Avx2Int8Gemm,
    x: torch.Tensor,
    layers: list[PackedLinear],
    weights: list[Avx2Int8Weight],
    threads: int,
) -> dict[str, Callable[[], object]]:
    """One pass of ``x`` through every layer, on oneDNN float32 and on the AVX2 kernel."""
    return {
        "onednn_f32": lambda: [layer(x) for layer in layers],
        "avx2_int8": lambda: [gemm.linear(x, w, threads) for w in weights],
    }


def measure_avx2(rows_list: list[int], threads: int, runs: int) -> dict[str, Any]:
    """The AVX2 int8 kernel against oneDNN's float32 linears, per :data:`SHAPES`."""
    gemm = avx2_int8_gemm_here()
    if gemm is None:
        return {"skipped": "no AVX2/FMA or no compiler: the AVX2 int8 kernel is not built here"}
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for name, (k, n, count) in SHAPES.items():
            layers: list[PackedLinear] = []
            for _ in range(count):
                linear = torch.nn.utils.skip_init(nn.Linear, k, n, bias=False)
                linear.weight.copy_(torch.randn(n, k, generator=gen) * k**-0.5)
                layers.append(PackedLinear.from_linear(linear, "onednn"))
            weights = [gemm.quantize(layer.weight) for layer in layers]
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen)
                ref = layers[0](x)
                error = (gemm.linear(x, weights[0], threads) - ref).norm() / ref.norm()
                calls = _avx2_calls(gemm, x, layers, weights, threads)
                per = {key: t / count for key, t in interleaved_best(calls, runs).items()}
                flop = 2 * rows * k * n
                out[f"{name}_{rows}"] = {
                    "in": k, "out": n, "rows": rows,
                    **{f"{key}_us": round(t * 1e6, 1) for key, t in per.items()},
                    **{f"{key}_gop_per_s": round(flop / t / 1e9, 1) for key, t in per.items()},
                    "speedup": round(per["onednn_f32"] / per["avx2_int8"], 2),
                    "relative_error_vs_f32": round(float(error), 6),
                }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rows", default="1,16,64,512", help="comma-separated row counts")
    ap.add_argument("--avx2", action="store_true",
                    help="the AVX2 int8 kernel vs oneDNN float32 (QUANTIZED)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        ap.error(f"--rows must list positive row counts, got {args.rows!r}")
    run = measure_avx2 if args.avx2 else measure
    result = {"cpu": cpu_description(), "threads": args.threads,
              "cases": run(rows, args.threads, args.runs)}  # fmt: skip
    if args.avx2:
        result["label"] = ("QUANTIZED: per-channel int8 weights, per-row int16 inputs "
                           "(AVX2 vpmaddwd) vs float32")  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
