"""Where a kvtoll engine's time goes on the throughput workload, by phase (a benchmark
helper, not a test): the in-process engine runs :mod:`bench.engine_throughput`'s
64 requests with a timer around every call of each phase's code, and each phase is
charged its *exclusive* time (a call's time minus the timed calls inside it):

=============  ==========================================================
linears        every linear layer (the packed projections and the LM head; a gate/up
               layer's native call with SiLU * up in its epilogue counts here)
attention      the attention backend's ``write_kv`` and ``forward``
norms          every RMSNorm (fused: residual add + RMSNorm)
rope           the rotary tables and the rotation (fused: with the K/V write)
mlp_act        the rest of the MLP (SiLU(gate) * up where it runs apart)
layer_glue     the rest of the decoder layers (residual adds, views, reshapes)
embed          the token embedding
batch_build    the runner turning a batch into tensors (``ModelRunner.build``)
sampling       ``sample_batch`` (greedy: argmax of the logits)
detokenize     the output processor (incremental detokenization, finish checks)
scheduling     ``Scheduler.schedule`` and ``update_from_output``
python_other   the rest of each engine step (Python between the phases)
=============  ==========================================================

The timers cost ~1 us a call (~300 calls a step), charged to the phase they wrap;
the untimed run's seconds are reported beside the timed run's for comparison.

    python -m bench.engine_profile [--dtype bfloat16] [--quick] [--kv-cache-dtype int8]
                                   [--linear-quant int8]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

import engine.llm_engine as llm_engine_module
import engine.model.llama as llama_module
from bench.engine_peers import cpu_description
from bench.engine_throughput import Workload, make_workload, run_engine
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine, load_model
from engine.llm_engine import LLMEngine
from engine.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm


class PhaseTimer:
    """Exclusive seconds and calls per phase; :meth:`wrap` times one callable."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._children: list[float] = []

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self._clock() - start
                inner = self._children.pop()
                self.seconds[phase] += elapsed - inner
                self.calls[phase] += 1
                if self._children:
                    self._children[-1] += elapsed

        return timed


def _module_phase(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linears"
    if isinstance(module, RMSNorm):
        return "norms"
    if isinstance(module, LlamaMLP):
        return "mlp_act"
    if isinstance(module, LlamaAttention | LlamaDecoderLayer):
        return "layer_glue"
    if isinstance(module, nn.Embedding):
        return "embed"
    return None


@contextmanager
def instrumented(engine: LLMEngine, timer: PhaseTimer) -> Iterator[None]:
    """Timers on ``engine``'s phases for the body (instance attributes, and the module
    functions the model and the engine call by name), removed after."""
    patched: list[tuple[object, str]] = []

    def put(obj: object, name: str, phase: str) -> None:
        setattr(obj, name, timer.wrap(phase, getattr(obj, name)))
        patched.append((obj, name))

    for module in engine.runner.model.modules():
        phase = _module_phase(module)
        if phase is not None:
            put(module, "forward", phase)
        if phase == "linears" and hasattr(module, "silu_mul"):
            # a gate/up layer whose kernel also applies SiLU * up: charged as a linear
            put(module, "silu_mul", "linears")
    for name in ("write_kv", "forward"):
        put(engine.runner.backend, name, "attention")
    put(engine.runner.rope, "tables", "rope")
    put(engine.runner, "build", "batch_build")
    put(engine.outputs, "process", "detokenize")
    put(engine.scheduler, "schedule", "scheduling")
    put(engine.scheduler, "update_from_output", "scheduling")
    put(engine, "step", "python_other")
    functions = [(llama_module, "rotate", "rope"), (llama_module, "add_rmsnorm", "norms"),
                 (llama_module, "rope_write_kv", "rope"), (llama_module, "silu_mul", "mlp_act"),
                 (llm_engine_module, "sample_batch", "sampling")]  # fmt: skip
    originals = [getattr(owner, name) for owner, name, _ in functions]
    for owner, name, phase in functions:  # the model and the engine call these by name
        setattr(owner, name, timer.wrap(phase, getattr(owner, name)))
    try:
        yield
    finally:
        for (owner, name, _), original in zip(functions, originals, strict=True):
            setattr(owner, name, original)
        for obj, name in patched:
            delattr(obj, name)  # the class attribute shows through again


def profile(loaded: LoadedModel, config: EngineConfig, work: Workload) -> dict[str, Any]:
    """The workload once untimed, once timed; the phases' share of the timed run."""
    plain = run_engine(loaded, config, work)
    engine = build_llm_engine(config, loaded)
    timer = PhaseTimer()
    from engine.api import GenerationRequest, SamplingParams

    reqs = [
        GenerationRequest(
            f"r{i}", tuple(p), SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        )
        for i, (p, m) in enumerate(zip(work.prompts, work.max_tokens, strict=True))
    ]
    with instrumented(engine, timer):
        start = time.perf_counter()
        engine.generate_sync(reqs)
        total = time.perf_counter() - start
    timer.seconds["outside_steps"] = total - sum(timer.seconds.values())
    phases = sorted(timer.seconds.items(), key=lambda kv: -kv[1])
    return {
        "untimed_run": plain,
        "timed_run_seconds": round(total, 2),
        "steps": engine.num_steps,
        "phases": {
            name: {
                "seconds": round(s, 3),
                "fraction": round(s / total, 4),
                "ms_per_step": round(1000 * s / max(engine.num_steps, 1), 3),
                "calls": timer.calls.get(name, 0),
            }
            for name, s in phases
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="16 requests, shorter prompts and outputs")
    ap.add_argument("--no-fused", action="store_true", help="eager small ops (the 'before')")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                    help="int8: the quantized KV cache (engine.kernels.kv_int8)")
    ap.add_argument("--linear-quant", default="none", choices=["none", "int8"],
                    help="int8: the quantized linears (engine.model.int8_linear)")
    ap.add_argument("--max-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                    help="step token budget (default: the engine's; figures before 2026-12-06 "
                    "used 512)")
    args = ap.parse_args()
    if args.quick:
        work = make_workload(16, (32, 256), (16, 64), seed=0)
    else:
        work = make_workload(64, (32, 512), (32, 256), seed=0)
    config = EngineConfig(dtype=args.dtype, kv_cache_bytes=2 << 30, max_num_seqs=64,
                          max_num_batched_tokens=args.max_batched_tokens, max_model_len=2048,
                          fused_ops=not args.no_fused,
                          kv_cache_dtype=args.kv_cache_dtype,
                          linear_quant=args.linear_quant)  # fmt: skip
    result = {"cpu": cpu_description(), "dtype": args.dtype, "requests": len(work.prompts),
              "max_num_batched_tokens": config.max_num_batched_tokens,
              "fused_ops": config.fused_ops, "kv_cache_dtype": config.kv_cache_dtype,
              "linear_quant": config.linear_quant,
              "load_average": list(os.getloadavg()),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
              "profile": profile(load_model(config), config, work)}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
