"""Engine fixtures: the random tiny Llama (milliseconds), a HF transformers twin, and the
native CPU kernels (skipping where this machine cannot build them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from engine.config import EngineConfig
from engine.factory import LoadedModel, load_model
from engine.kernels.cpu_decode_avx2 import Avx2Decode, avx2_decode_here
from engine.kernels.cpu_fused import FusedKernels, fused_kernels_here
from engine.kernels.cpu_gemm import NativeGemm, NativeInt8Gemm, gemm_here, int8_gemm_here
from engine.kernels.cpu_gemm_avx2 import Avx2Int8Gemm, avx2_int8_gemm_here

_Kernel = TypeVar("_Kernel")

HFGreedy = Callable[[list[int], int], list[int]]


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """Weights + byte tokenizer of the tiny test model (reuse across engines)."""
    return load_model(EngineConfig.tiny())


def hf_twin(loaded: LoadedModel) -> HFGreedy:
    """transformers' LlamaForCausalLM with the same weights; greedy generate (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_fields: dict[str, Any] = dict(loaded.config.to_hf_dict())
    cfg = LlamaConfig(**hf_fields, eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    state = {k: v.float() for k, v in loaded.model.checkpoint_state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)

    def greedy(prompt: list[int], max_new: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        return [int(t) for t in out[0, len(prompt) :]]

    return greedy


@pytest.fixture(scope="session")
def real_model() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct GGUF, dequantized, float32 (a few seconds)."""
    return load_model(EngineConfig(dtype="float32"))


@pytest.fixture(scope="session")
def real_hf(real_model: LoadedModel) -> HFGreedy:
    return hf_twin(real_model)


@pytest.fixture(scope="session")
def tiny_hf(tiny_model: LoadedModel) -> HFGreedy:
    return hf_twin(tiny_model)


def _built(found: _Kernel | None, why_not: str) -> _Kernel:
    """A native kernel the fixture found, else the test skips (it cannot run here)."""
    if found is None:
        pytest.skip(why_not)
    return found


@pytest.fixture(scope="session")
def native_gemm() -> NativeGemm:
    """The native bfloat16 linear kernel (engine.kernels.cpu_gemm)."""
    return _built(
        gemm_here(), "no AVX512-BF16 or no compiler here: the bfloat16 kernel is not built"
    )


@pytest.fixture(scope="session")
def int8_gemm() -> NativeInt8Gemm:
    """The native int8 linear kernel (engine.kernels.cpu_gemm)."""
    return _built(
        int8_gemm_here(), "no AVX512-VNNI/BF16 or no compiler here: the int8 kernel is not built"
    )


@pytest.fixture(scope="session")
def avx2_int8_gemm() -> Avx2Int8Gemm:
    """The AVX2 int8 linear kernel (engine.kernels.cpu_gemm_avx2)."""
    return _built(
        avx2_int8_gemm_here(), "no AVX2/FMA or no compiler here: the AVX2 int8 kernel is not built"
    )


@pytest.fixture(scope="session")
def fused_kernels() -> FusedKernels:
    """The fused small-op kernels (engine.kernels.cpu_fused)."""
    return _built(
        fused_kernels_here(), "no AVX-512 or no compiler here: the fused CPU kernels are not built"
    )


@pytest.fixture(scope="session")
def avx2_decode() -> Avx2Decode:
    """The AVX2 decode attention kernel (engine.kernels.cpu_decode_avx2)."""
    found, why_not = avx2_decode_here()
    return _built(found, f"the AVX2 decode kernel is not built here: {why_not}")
