"""select_attention_backend: auto / torch / cpu / triton per device, and its refusals;
the CPU backend prepares its kernels when an engine is built."""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.selector import resolve_backend_name, select_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend, kernels_run_on_cpu
from engine.config import EngineConfig
from engine.factory import build_llm_engine, load_model
from engine.kernels import native_build


def test_auto_is_the_cpu_kernels_on_cpu_and_triton_on_cuda() -> None:
    backend = select_attention_backend("auto", "cpu")
    assert isinstance(backend, CpuAttentionBackend) and backend.name == "cpu"
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    assert isinstance(select_attention_backend("auto", "cuda"), TritonAttentionBackend)


def test_torch_can_be_forced_anywhere() -> None:
    assert isinstance(select_attention_backend("torch", "cuda"), TorchAttentionBackend)
    assert type(select_attention_backend("torch", "cpu")) is TorchAttentionBackend


def test_cpu_backend_is_refused_on_cuda() -> None:
    with pytest.raises(ValueError, match="needs the CPU device"):
        select_attention_backend("cpu", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter path")
def test_triton_on_cpu_runs_in_the_interpreter() -> None:
    assert kernels_run_on_cpu()  # the conftest's TRITON_INTERPRET=1 was honoured
    backend = select_attention_backend("triton", torch.device("cpu"))
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_attention_backend("triton", "cpu")


def test_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, torch, cpu, triton"):
        select_attention_backend("flash", "cpu")


def test_without_a_threadsafe_numba_back_end_auto_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.kernels import numba_threads

    monkeypatch.setattr(numba_threads, "THREADSAFE_LAYERS", {"omp": "no.such.module"})
    assert type(select_attention_backend("auto", "cpu")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="libgomp or libtbb"):
        select_attention_backend("cpu", "cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_engines_compile_their_decode_kernels_when_built(dtype: str) -> None:
    """Before any request: the first step must not wait for a compiler (the native
    library, whose launchers need no JIT, where it builds here, else numba's decode
    kernels)."""
    config = EngineConfig.tiny(dtype=dtype, attention_backend="cpu")
    engine = build_llm_engine(config, load_model(config))
    backend = engine.runner.backend
    assert isinstance(backend, CpuAttentionBackend)
    cfg = engine.runner.model.config
    cache_dtype = getattr(torch, dtype)
    if native_build.unavailable_reason() is None:
        assert backend.native is not None
        assert backend.native.library.path.exists()
        assert callable(backend.native.decode[cache_dtype])
        assert callable(backend.native.extend[cache_dtype])
    elif native_build.unavailable_reason(required=native_build.AVX2_CPU_FLAGS) is None:
        assert backend.native is None  # the AVX2 kernel, built before any request
        assert backend.kernels.avx2 is not None and backend.kernels.avx2.path.exists()
    else:
        assert backend.native is None
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        kernels = backend.kernels.get(group, cfg.head_size, cfg.num_key_value_heads,
                                      dtype == "bfloat16")  # fmt: skip
        assert all(k.signatures for k in kernels)
    assert engine.num_steps == 0


def test_cpu_backend_without_native_kernels_compiles_numba_ones() -> None:
    backend = CpuAttentionBackend(native=False)
    backend.prepare(4, torch.zeros(1, 16, 2, 16))
    assert backend.native is None and not backend.native_prefill
    assert backend.kernels.avx2 is None  # no native code at all, the AVX2 kernel neither
    assert all(k.signatures for k in backend.kernels.get(2, 16, 2, False))


def test_native_kernels_that_cannot_build_fall_back_or_fail_when_required(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_build, "unavailable_reason",
                        lambda flags=None, required=None: "no AVX-512 here")  # fmt: skip
    cache = torch.zeros(1, 16, 2, 16)
    backend = CpuAttentionBackend()
    with caplog.at_level("WARNING"):
        backend.prepare(4, cache)
    assert backend.native is None and "no AVX-512 here" in caplog.text
    assert backend.kernels.avx2 is None  # nor AVX2 (the same reason): numba decodes
    with pytest.raises(RuntimeError, match="no AVX-512 here"):
        CpuAttentionBackend(native=True).prepare(4, cache)
    # a head layout the library is not built for (head_dim 8) falls back the same way
    monkeypatch.undo()
    backend = CpuAttentionBackend()
    backend.prepare(4, torch.zeros(1, 16, 2, 8))
    assert backend.native is None
