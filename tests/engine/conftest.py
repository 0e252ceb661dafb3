"""Engine fixtures: the random tiny Llama (milliseconds) and a HF transformers twin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.factory import LoadedModel, load_model

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
