"""MKL-packed linear layers: same results and state as nn.Linear, refusals, packing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.factory import load_model
from engine.model.packed_linear import PackedLinear, mkl_packing_available, pack_linears

pytestmark = pytest.mark.skipif(not mkl_packing_available(), reason="torch built without MKL")


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear_for_any_row_count(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(160, 96, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(160, generator=gen))
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(rows, 96, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)
        x3 = x.view(1, rows, 96)
        assert packed(x3).shape == (1, rows, 160)


def test_shares_parameters_and_state_dict() -> None:
    linear = nn.Linear(32, 48, bias=False)
    packed = PackedLinear.from_linear(linear)
    assert packed.weight is linear.weight
    assert list(packed.state_dict()) == ["weight"]  # the packed copy is not saved


def test_autograd_falls_back_to_the_plain_product() -> None:
    linear = nn.Linear(16, 8)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(3, 16, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


def test_only_float32_cpu_weights_are_packed() -> None:
    with pytest.raises(ValueError, match="float32 CPU"):
        PackedLinear.from_linear(nn.Linear(8, 8).to(torch.bfloat16))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_linears(model) == 1
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear


def test_float32_cpu_engine_models_are_packed_with_tied_embeddings() -> None:
    loaded = load_model(EngineConfig.tiny())
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(isinstance(m, PackedLinear)
                   for m in load_model(EngineConfig.tiny(dtype="bfloat16")).model.modules())
