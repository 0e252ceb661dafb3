"""bfloat16 linear layers on the native kernel (:mod:`engine.kernels.cpu_gemm`: AVX512-BF16
dot products, or AMX tiles where the process has them) where it beats oneDNN here.

:func:`native_rows_limit` races the two at start-up on SmolLM2-135M's MLP projection
(576 -> 3,072, random weights), best of interleaved runs, at :data:`RACE_ROWS` in turn:
the native kernel takes calls of up to the last count it won before its first loss
(every call, :data:`ALL_ROWS`, where it won them all; none where it lost the first).
On a 2-core AMX Xeon its AVX-512 path lost at 64 rows (1.07-1.18 vs 0.29-0.33 ms); its
AMX path takes decode steps (0.16-0.24 vs 0.20-0.30 ms) and, since a panel's tile steps
are taken a dozen at a time, mixed steps of up to 256 rows (hot weights, native with
SiLU * up fused vs oneDNN then silu_mul: gate/up 0.50 vs 0.56 ms, down 0.22 vs 0.29);
512 rows stay oneDNN's (0.92 vs 0.73 ms). :func:`use_native_linears` hands a model's eligible
:class:`engine.model.packed_linear.PackedLinear` layers to it.

Taking every call keeps each row's result independent of its batch: a row's sums run
over its inputs in one fixed order whatever rows share the call.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from engine.dtype_probe import default_path, machine_key, persisted
from engine.kernels.cpu_gemm import NativeGemm
from engine.model.packed_linear import PAIRED, PackedLinear
from engine.timing import interleaved_best
from kvtoll.cpu_info import cpu_flags, cpu_model

log = logging.getLogger(__name__)

RACE_ROWS = (64, 256, 512)  # a decode step's rows, a mixed step's, a prefill chunk's
RACE_SHAPE = (576, 3072)  # in, out features
ALL_ROWS = 1 << 30
PROBE_FILE = "native-linear-probe.json"  # kept_rows_limit's, beside the dtype probe's


def native_rows_limit(gemm: NativeGemm, repeats: int = 5) -> int:
    """Up to how many rows a call should run on ``gemm`` here (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    in_f, out_f = RACE_SHAPE
    linear = torch.nn.utils.skip_init(nn.Linear, in_f, out_f, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_f, in_f, generator=gen))
    layer = PackedLinear.from_linear(linear.to(torch.bfloat16), "onednn")
    packed = gemm.pack(layer.weight)
    threads = torch.get_num_threads()
    limit = 0
    with torch.inference_mode():
        for rows in RACE_ROWS:
            x = torch.randn(rows, in_f, generator=gen).to(torch.bfloat16)

            def native(x: torch.Tensor = x) -> object:
                return gemm.linear(x, packed, out_f, threads)

            def onednn(x: torch.Tensor = x) -> object:
                return layer(x)

            best = interleaved_best({"native": native, "onednn": onednn}, repeats)
            log.info("bfloat16 linear, %d rows x %d -> %d: native %.3f ms, oneDNN %.3f ms",
                     rows, in_f, out_f, 1e3 * best["native"], 1e3 * best["onednn"])  # fmt: skip
            if best["native"] >= best["onednn"]:
                return limit
            limit = rows
    return ALL_ROWS


def kept_rows_limit(gemm: NativeGemm, path: Path | None = None) -> int:
    """:func:`native_rows_limit`, raced once per machine and kept
    (:func:`engine.dtype_probe.persisted`, ``native-linear-probe.json``): every worker on
    a machine then splits its linears at the same row count (a row's sums depend on which
    kernel takes its call, so two workers that raced apart could answer one
    temperature-0 prompt two ways), and later starts skip the race (~0.9 s). Keyed by the
    machine (CPU, flags, torch), the library's build and the race's shape; delete the file
    to race again."""
    key = "|".join((machine_key(cpu_flags(), cpu_model(), torch.__version__), gemm.path.name,
                    f"{RACE_ROWS}{RACE_SHAPE}"))  # fmt: skip
    path = path or default_path(PROBE_FILE)
    rows, raced = persisted(key, "native_rows", lambda: float(native_rows_limit(gemm)), path)
    if not raced:
        log.info("bfloat16 linears: native up to %d rows (raced before, kept in %s)",
                 int(rows), path)  # fmt: skip
    return int(rows)


def use_native_linears(model: nn.Module, gemm: NativeGemm, max_rows: int) -> int:
    """Every :class:`PackedLinear` of ``model`` that ``gemm`` can take multiplies calls of
    up to ``max_rows`` rows on it, stacked gate/up projections (:data:`PAIRED`) packed
    as pairs (their SiLU * up fused into the kernel); the number taken."""
    taken = 0
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear) and module.can_use_native(gemm):
            # every call native: oneDNN's copy of the weight is dead memory (~270 MB for
            # SmolLM2-135M in bfloat16)
            module.use_native(gemm, max_rows, keep_onednn=max_rows < ALL_ROWS,
                              paired=name.rpartition(".")[2] in PAIRED)  # fmt: skip
            taken += 1
    return taken
