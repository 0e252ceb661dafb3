"""The llama.cpp peer of :mod:`bench.engine_throughput`: llama-cpp-python single stream on
the bundled GGUF (its own quantised kernels, the engine's thread count), the first
:data:`LLAMA_CPP_REQUESTS` requests one after another, in a child process (this module
run as a script), if ``llama_cpp`` is importable (``pip install -e '.[llamacpp]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as the child: the repo root, for bench.* and engine.*
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from engine.loader.bundled import bundled_model_path

LLAMA_CPP_REQUESTS = 8


def run_llama_cpp(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> dict[str, Any]:
    """Single-stream llama.cpp on the bundled GGUF, in a child process (a crash in
    llama.cpp must not take the engine's figures with it).

    It runs first with llama.cpp's extra weight buffers (repacked / AMX layouts, its
    default). On a Xeon with AMX, llama-cpp-python 0.3.36 built here died with a
    segfault in that path (upstream reports the same in ``ggml_backend_amx_mul_mat``);
    it is then re-run without them (``use_extra_bufts=False``: its plain AVX-512/VNNI
    kernels), and the result says so.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": "llama-cpp-python is not installed (optional extra 'llamacpp')"}
    threads = torch.get_num_threads()  # the engine's and HF's threads (llama.cpp's default: half)
    requests = {"prompts": [list(p) for p in prompts[:LLAMA_CPP_REQUESTS]],
                "max_tokens": list(max_tokens[:LLAMA_CPP_REQUESTS])}  # fmt: skip
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.json"
        path.write_text(json.dumps(requests))
        for extra in (True, False):
            cmd = [sys.executable, __file__, str(path), "--threads", str(threads)] + (
                ["--extra-bufts"] if extra else [])  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode == 0:
                result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
                result["extra_buffer_types"] = extra
                if failures:
                    result["first_attempt"] = failures
                return result
            why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            failures.append(f"extra_bufts={extra}: {why}; {proc.stderr.strip()[-200:]}")
    return {"error": failures}


def llama_cpp_peer(path: Path, threads: int, extra_bufts: bool) -> dict[str, Any]:
    """The child of :func:`run_llama_cpp`: the requests in ``path`` one after another."""
    import llama_cpp.llama as llama_module
    from llama_cpp import Llama

    defaults = llama_module.llama_cpp.llama_model_default_params

    def model_params() -> Any:
        params = defaults()
        params.use_extra_bufts = extra_bufts
        return params

    # Llama() takes its model parameters from this function and has no argument for
    # the extra buffers, so the child replaces it (this process only).
    llama_module.llama_cpp.llama_model_default_params = model_params
    requests = json.loads(path.read_text())
    llm = Llama(
        model_path=str(bundled_model_path()), n_ctx=1024, n_threads=threads,
        n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    start = time.perf_counter()
    n = 0
    for p, m in zip(requests["prompts"], requests["max_tokens"], strict=True):
        llm.reset()
        made = 0
        for _ in llm.generate(p, temp=0.0):
            made += 1
            if made >= m:  # each prompt gets its own full output length
                break
        n += made
    elapsed = time.perf_counter() - start
    return {
        "seconds": round(elapsed, 2),
        "requests": len(requests["prompts"]),
        "threads": threads,
        "output_tokens": n,
        "output_tokens_per_s": round(n / elapsed, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="run_llama_cpp's child (one JSON line)")
    ap.add_argument("requests", type=Path)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--extra-bufts", action="store_true")
    args = ap.parse_args()
    print(json.dumps(llama_cpp_peer(args.requests, args.threads, args.extra_bufts)))


if __name__ == "__main__":
    main()
