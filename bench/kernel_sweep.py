"""Launch variants of the decode and extend kernels, for ``bench/kernels.py --sweep``.

The engine launches each kernel with one default shape (engine.kernels: block sizes,
warps, software-pipeline stages) chosen where no GPU was at hand. On a GPU this times
the alternatives on the same inputs, each checked against the default's output, so one
run says which defaults to keep. A variant that cannot launch (too much shared memory
for the chip, say) is reported with its error.

    decode variants: BLOCK_N {32, 64, 128} x warps {4, 8} x stages {2, 3, 4}, then the
                     split-K count {1, 2, 4, ..., 64} at the default launch
    extend variants: (BLOCK_M, BLOCK_N) {64x64, 128x64, 128x32, 64x32} x warps {4, 8}
                     x stages {2, 3}
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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

Timer = Callable[[Thunk], float]

DECODE_CASES = ((1, 32768), (16, 4096), (64, 4096))  # batch, context
EXTEND_CASES = ((8, 4096, 512), (1, 0, 8192))  # sequences, cached prefix, new tokens
DECODE_SPLITS = (1, 2, 4, 8, 16, 32, 64)
DECODE_VARIANTS = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
EXTEND_VARIANTS = [
    (bm, bn, w, st)
    for bm, bn in ((64, 64), (128, 64), (128, 32), (64, 32))
    for w in (4, 8)
    for st in (2, 3)
]


def _timed(run: Callable[[], torch.Tensor], expected: torch.Tensor, timer: Timer) -> dict[str, Any]:
    try:
        err = float((run().float() - expected.float()).abs().max())
        return {"ms": timer(run), "max_abs_err_vs_default": err}
    except Exception as exc:  # a variant the chip cannot run: say why, keep sweeping
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def sweep_decode(x: Any, timer: Timer, read_bytes: int, variants: list[tuple[int, ...]],
                 splits_variants: tuple[int, ...]) -> list[dict[str, Any]]:  # fmt: skip
    """Every decode variant on inputs ``x`` (bench/kernel_peers.PagedInputs)."""
    from engine.kernels.decode_attention import paged_decode_attention
    from engine.kernels.launch import LaunchOptions

    scale = x.q.shape[-1] ** -0.5

    def decode(block_n: int = 64, launch: LaunchOptions | None = None,
               num_splits: int | None = None) -> torch.Tensor:  # fmt: skip
        return paged_decode_attention(
            x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, scale,
            max_seq_len=x.context_len, block_n=block_n, launch=launch or LaunchOptions(),
            num_splits=num_splits,
        )  # fmt: skip

    default = decode()
    rows = [{"block_n": "default", **_timed(decode, default, timer)}]
    for block_n, warps, stages in variants:
        launch = LaunchOptions(warps, stages)
        row = _timed(functools.partial(decode, block_n, launch), default, timer)
        rows.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, **row})
    for splits in splits_variants:
        row = _timed(functools.partial(decode, num_splits=splits), default, timer)
        rows.append({"block_n": "default", "num_splits": splits, **row})
    for row in rows:
        if "ms" in row:
            row["gbps"] = round(read_bytes / row["ms"] / 1e6, 1)
    return rows


def sweep_extend(x: Any, timer: Timer, flops: int, variants: list[tuple[int, ...]]
                 ) -> list[dict[str, Any]]:  # fmt: skip
    """Every extend variant on inputs ``x`` (bench/kernel_peers.PagedInputs)."""
    from engine.kernels.extend_attention import extend_attention
    from engine.kernels.launch import LaunchOptions

    scale = x.q.shape[-1] ** -0.5

    def extend(block_m: int | None = None, block_n: int | None = None,
               launch: LaunchOptions | None = None) -> torch.Tensor:  # fmt: skip
        return extend_attention(
            x.q, x.k_cache, x.v_cache, x.query_start_loc, x.seq_lens, x.block_tables, scale,
            max_query_len=x.query_len, block_m=block_m, block_n=block_n,
            launch=launch or LaunchOptions(),
        )  # fmt: skip

    default = extend()
    rows = [{"block_m": "default", **_timed(extend, default, timer)}]
    for block_m, block_n, warps, stages in variants:
        run = functools.partial(extend, block_m, block_n, LaunchOptions(warps, stages))
        rows.append({"block_m": block_m, "block_n": block_n, "num_warps": warps,
                     "num_stages": stages, **_timed(run, default, timer)})  # fmt: skip
    for row in rows:
        if "ms" in row:
            row["tflops"] = round(flops / row["ms"] / 1e9, 2)
    return rows


def run_sweep(cfg: BenchConfig, plan: dict[str, Any]) -> dict[str, Any]:
    """Both sweeps over the plan's cases (bench/kernels.py builds the plan)."""
    out: dict[str, Any] = {"decode": [], "extend": []}
    timer: Timer = functools.partial(time_ms, cfg=cfg)
    for batch, context in plan["sweep_decode"]:
        log(f"sweep decode batch={batch} context={context}")
        x = make_inputs(cfg, batch, context - 1, 1, seed=batch + context)
        read = kv_read_bytes(cfg, batch, context, x.k_cache.element_size())
        rows = sweep_decode(x, timer, read, plan["decode_variants"], plan["decode_splits"])
        out["decode"].append({"batch": batch, "context": context, "best": best(rows, "gbps"),
                              "variants": rows})  # fmt: skip
    for num_seqs, prefix, new in plan["sweep_extend"]:
        log(f"sweep extend seqs={num_seqs} prefix={prefix} new={new}")
        x = make_inputs(cfg, num_seqs, prefix, new, seed=num_seqs + prefix + new)
        flops = prefill_flops(cfg, num_seqs, prefix, new)
        rows = sweep_extend(x, timer, flops, plan["extend_variants"])
        out["extend"].append({"num_seqs": num_seqs, "prefix": prefix, "new_tokens": new,
                              "best": best(rows, "tflops"), "variants": rows})  # fmt: skip
    return out


def best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The fastest row that ran and matched the default within bf16 rounding."""
    ok = [r for r in rows if "ms" in r and r["max_abs_err_vs_default"] < 2e-2]
    return max(ok, key=lambda r: r[key]) if ok else None
