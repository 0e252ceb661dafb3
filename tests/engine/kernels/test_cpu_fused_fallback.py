"""Where the fused native kernels cannot be built (no AVX-512, no compiler), the engine
runs the eager torch ops: no error, the same greedy tokens. Runs on every CPU."""

from __future__ import annotations

import pytest

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine
from engine.kernels import cpu_fused, native_build


def _greedy(config: EngineConfig, model: LoadedModel) -> tuple[object, list[int]]:
    engine = build_llm_engine(config, model)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = engine.generate_sync([GenerationRequest("r", tuple(b"fused or not"), params)])
    return engine.runner.fused, [t for c in out["r"][0] for t in c.token_ids]


def test_without_the_native_kernels_the_model_runs_eager(
    monkeypatch: pytest.MonkeyPatch, tiny_model: LoadedModel
) -> None:
    config = EngineConfig.tiny()
    _, want = _greedy(EngineConfig.tiny(fused_ops=False), tiny_model)
    monkeypatch.setattr(native_build, "unavailable_reason",
                        lambda flags=None, required=None: "the CPU lacks avx512f")  # fmt: skip
    assert cpu_fused.fused_kernels_here() is None
    fused, got = _greedy(config, tiny_model)
    assert fused is None and got == want
