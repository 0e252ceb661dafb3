"""Packed linear layers (oneDNN and MKL): same results and state as nn.Linear,
batch invariance, refusals, packing (float32, and bfloat16 where oneDNN can)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.dtype_choice import native_bf16
from engine.factory import load_model
from engine.model.packed_linear import (
    PackedLinear,
    PackKind,
    best_packing,
    mkl_packing_available,
    onednn_bf16_packing_works,
    onednn_packing_available,
    pack_linears,
    packable_dtypes,
    packed_bf16_speedup,
)

KINDS = [
    pytest.param(
        "onednn",
        marks=pytest.mark.skipif(
            not onednn_packing_available(), reason="torch built without oneDNN"
        ),
    ),
    pytest.param(
        "mkl",
        marks=pytest.mark.skipif(not mkl_packing_available(), reason="torch built without MKL"),
    ),
]


def _linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear_for_any_row_count(kind: PackKind, rows: int, bias: bool) -> None:
    linear = _linear(96, 160, bias, rows)
    packed = PackedLinear.from_linear(linear, kind)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 1))
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)
        x3 = x.view(1, rows, 96)
        assert packed(x3).shape == (1, rows, 160)


def test_onednn_rows_do_not_depend_on_their_batch() -> None:
    """Bit-identical rows whatever else is multiplied with them: a request's logits are
    the same alone, batched and prefix-cached."""
    if not onednn_packing_available():
        pytest.skip("torch built without oneDNN")
    packed = PackedLinear.from_linear(_linear(576, 1536, False, 3), "onednn")
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        full = packed(x)
        for rows in (1, 2, 7, 8, 33, 64, 100):
            assert torch.equal(packed(x[:rows].contiguous()), full[:rows]), rows
            assert torch.equal(packed(x[-rows:].contiguous()), full[-rows:]), rows


def test_mkl_packing_equals_f_linear_bit_for_bit() -> None:
    if not mkl_packing_available():
        pytest.skip("torch built without MKL")
    linear = _linear(576, 192, False, 5)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        assert torch.equal(PackedLinear.from_linear(linear, "mkl")(x), linear(x))


@pytest.mark.parametrize("kind", KINDS)
def test_shares_parameters_and_state_dict(kind: PackKind) -> None:
    linear = nn.Linear(32, 48, bias=False)
    packed = PackedLinear.from_linear(linear, kind)
    assert packed.weight is linear.weight
    assert list(packed.state_dict()) == ["weight"]  # the packed copy is not saved
    assert f"packed={kind}" in repr(packed)


@pytest.mark.parametrize("kind", KINDS)
def test_autograd_falls_back_to_the_plain_product(kind: PackKind) -> None:
    linear = nn.Linear(16, 8)
    packed = PackedLinear.from_linear(linear, kind)
    x = torch.randn(3, 16, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


@pytest.mark.parametrize("kind", KINDS)
def test_unpackable_dtypes_are_refused_and_left_alone(kind: PackKind) -> None:
    with pytest.raises(ValueError, match="packing needs"):
        PackedLinear.from_linear(nn.Linear(8, 8).to(torch.float16), kind)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float16))
    assert pack_linears(model, kind) == 1
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear


def test_mkl_packs_float32_only() -> None:
    if not mkl_packing_available():
        pytest.skip("torch built without MKL")
    assert packable_dtypes("mkl") == {torch.float32}
    with pytest.raises(ValueError, match="mkl packing needs float32"):
        PackedLinear.from_linear(nn.Linear(8, 8).to(torch.bfloat16), "mkl")


def test_onednn_bfloat16_packing_equals_f_linear_bit_for_bit() -> None:
    """Where oneDNN packs bfloat16 here, a bf16 engine's numbers do not change."""
    if not onednn_bf16_packing_works():
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU")
    linear = _linear(576, 1536, True, 8).to(torch.bfloat16)
    packed = PackedLinear.from_linear(linear, "onednn")
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 7, 16, 64, 300):
            assert torch.equal(packed(x[:rows]), linear(x[:rows])), rows


def test_bfloat16_weight_multiplied_in_float32_is_the_exact_float32_product_rounded() -> None:
    """``compute_dtype=float32``: the bf16 weight widened exactly, each row's product the
    packed float32 one (batch-invariant, like it), rounded to bfloat16 once."""
    if not onednn_packing_available():
        pytest.skip("torch built without oneDNN")
    linear = _linear(576, 1536, True, 10).to(torch.bfloat16)
    upcast = PackedLinear.from_linear(linear, "onednn", compute_dtype=torch.float32)
    wide = nn.Linear(576, 1536)
    with torch.no_grad():
        wide.weight.copy_(linear.weight.float())
        wide.bias.copy_(linear.bias.float())
    reference = PackedLinear.from_linear(wide, "onednn")
    assert upcast.weight is linear.weight and upcast.packed.dtype == torch.float32
    assert "packed=onednn in torch.float32" in repr(upcast)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    with torch.inference_mode():
        full = upcast(x)
        assert full.dtype == torch.bfloat16
        assert torch.equal(full, reference(x.float()).to(torch.bfloat16))
        for rows in (1, 7, 16, 64):
            assert torch.equal(upcast(x[:rows]), full[:rows]), rows
        # the same arithmetic as a bf16 product (exact products, float32 sums)
        torch.testing.assert_close(full, linear(x), rtol=1.6e-2, atol=1e-1)


def test_only_a_bfloat16_weight_on_onednn_computes_in_float32() -> None:
    if not onednn_packing_available():
        pytest.skip("torch built without oneDNN")
    f32 = torch.float32
    with pytest.raises(ValueError, match="computes in its own dtype"):
        PackedLinear.from_linear(nn.Linear(8, 8), "onednn", compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="computes in its own dtype"):
        PackedLinear.from_linear(nn.Linear(8, 8).to(torch.float16), "onednn", compute_dtype=f32)
    if mkl_packing_available():
        with pytest.raises(ValueError, match="only onednn"):
            PackedLinear.from_linear(nn.Linear(8, 8).to(torch.bfloat16), "mkl", compute_dtype=f32)
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert pack_linears(model, "onednn", upcast_bf16=True) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], PackedLinear)
    assert model[0].compute_dtype == f32 and model[0].weight.dtype == torch.bfloat16
    assert model[1].compute_dtype == f32 and model[1].weight.dtype == f32


def test_bf16_speedup_is_a_measured_ratio_and_bad_arguments_are_refused() -> None:
    """The timing itself is the machine's (never asserted); its shape is checked."""
    if not onednn_bf16_packing_works():
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU")
    speedup = packed_bf16_speedup(rows=4, repeats=2)
    assert isinstance(speedup, float) and 0 < speedup < float("inf")
    for rows, repeats in ((0, 3), (8, 0)):
        with pytest.raises(ValueError, match="positive"):
            packed_bf16_speedup(rows=rows, repeats=repeats)


def test_cpu_engine_models_are_packed_with_tied_embeddings() -> None:
    kind = best_packing()
    if kind is None:
        pytest.skip("torch built without oneDNN and MKL")
    assert kind == ("onednn" if onednn_packing_available() else "mkl")
    for dtype in ("float32", "bfloat16"):
        model = load_model(EngineConfig.tiny(dtype=dtype)).model
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        packed = [isinstance(m, PackedLinear) and m.kind == kind for m in linears]
        compute = getattr(torch, dtype)
        if compute == torch.bfloat16 and kind == "onednn" and not native_bf16("cpu"):
            compute = torch.float32  # no bf16 instructions: bf16 weights multiply in float32
        expected = compute in packable_dtypes(kind)
        assert linears and all(p == expected for p in packed), dtype
        assert all(m.compute_dtype == compute for m in linears if isinstance(m, PackedLinear))
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("has_bf16", [True, False])
def test_a_bf16_engine_multiplies_in_float32_only_without_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, has_bf16: bool
) -> None:
    if not onednn_packing_available() or (has_bf16 and not onednn_bf16_packing_works()):
        pytest.skip("oneDNN cannot pack these weights on this CPU")  # float32 compute: any
    import engine.factory

    monkeypatch.setattr(engine.factory, "native_bf16", lambda device: has_bf16)
    model = load_model(EngineConfig.tiny(dtype="bfloat16")).model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    compute = torch.bfloat16 if has_bf16 else torch.float32
    assert linears and all(m.compute_dtype == compute for m in linears)
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
