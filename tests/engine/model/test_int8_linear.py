"""Int8 linear layers (the opt-in quantized CPU path): close to the float product,
same parameters and state as nn.Linear, refusals, and an engine that runs on them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.api import GenerationRequest, SamplingParams
from engine.cli import engine_config
from engine.config import EngineConfig
from engine.factory import build_llm_engine, load_model
from engine.kernels.cpu_fused import FusedKernels, silu_mul
from engine.kernels.cpu_gemm import NativeInt8Gemm, int8_gemm_here
from engine.kernels.cpu_gemm_avx2 import Avx2Int8Gemm, avx2_int8_gemm_here
from engine.model.int8_linear import (
    INT8_LINEARS,
    Int8DynamicLinear,
    Int8Kernel,
    NativeInt8Linear,
    int8_available,
    quantize_linears,
    quantize_weight,
    reduce_range_needed,
)
from kvtoll.cpu_info import cpu_flags

pytestmark = pytest.mark.skipif(not int8_available(), reason="no x86/fbgemm quantized engine")


@pytest.fixture(params=["int8_gemm", "avx2_int8_gemm"])
def native_int8(request: pytest.FixtureRequest) -> Int8Kernel:
    """Each native int8 kernel that builds here: AVX512-VNNI, AVX2."""
    kernel: Int8Kernel = request.getfixturevalue(request.param)
    return kernel


def _linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_is_close_to_the_float_one(rows: int, bias: bool, dtype: torch.dtype) -> None:
    linear = _linear(576, 384, bias, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = nn.functional.linear(x.float(), linear.weight, linear.bias)
    with torch.inference_mode():
        got = Int8DynamicLinear.from_linear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    error = (got.float() - expected).norm() / expected.norm()
    assert error < 0.03, f"relative error {error:.4f}"


def test_full_range_inputs_do_not_saturate_on_this_cpu() -> None:
    """Inputs at the top of their uint8 range against weights at the top of int8's: on a
    CPU without VNNI fbgemm's int16 pair sums would saturate on 8-bit inputs (255 * 127 *
    2 > 32,767), so the layer quantizes them to 7 bits there."""
    linear = nn.Linear(256, 8, bias=False)
    with torch.no_grad():
        linear.weight.fill_(1.0)
    x = torch.ones(4, 256)
    x[:, 0] = -1.0  # the range's bottom: every other input sits at uint8 255
    expected = nn.functional.linear(x, linear.weight)
    layer = Int8DynamicLinear.from_linear(linear)
    assert layer.reduce_range == reduce_range_needed(cpu_flags())
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.0)


def test_reduce_range_only_without_vnni() -> None:
    assert reduce_range_needed(frozenset({"avx2", "fma"}))
    assert not reduce_range_needed(frozenset({"avx2", "avx_vnni"}))
    assert not reduce_range_needed(frozenset({"avx512f", "avx512_vnni"}))


def test_leading_dimensions_are_kept() -> None:
    layer = Int8DynamicLinear.from_linear(_linear(64, 32, False, seed=0))
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        assert layer(x).shape == (3, 5, 32)


def test_weight_quantization_is_per_row_symmetric() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.01, 0.02, -0.04], [0.0, 0.0, 0.0]])
    q = quantize_weight(w)
    scales = q.q_per_channel_scales()
    assert torch.allclose(scales[:2].float(), torch.tensor([2.0 / 127, 0.04 / 127]))
    assert q.int_repr()[0].tolist() == [64, -127, 32]  # 1 / (2/127) = 63.5 rounds to even
    assert torch.equal(q.dequantize()[2], torch.zeros(3))  # an all-zero row stays zero


def test_quantizing_a_model_keeps_its_state_and_tied_head() -> None:
    config = EngineConfig.tiny()
    model = load_model(config).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]  # packed ones here
    assert quantize_linears(model, keep=frozenset()) == len(linears) > 0
    assert all(isinstance(m, Int8DynamicLinear) for m in model.modules()
               if isinstance(m, nn.Linear))  # fmt: skip
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_down_projections_keep_their_dtype() -> None:
    model = load_model(EngineConfig.tiny()).model
    num_layers = len(model.model.layers)
    replaced = quantize_linears(model)
    assert replaced == sum(isinstance(m, Int8DynamicLinear) for m in model.modules())
    assert replaced == 3 * num_layers + 1  # qkv, o, gate_up per layer, and the head
    assert not any(isinstance(layer.mlp.down_proj, Int8DynamicLinear)
                   for layer in model.model.layers)  # fmt: skip


def test_engine_generates_on_int8_linears() -> None:
    loaded = load_model(EngineConfig.tiny(linear_quant="int8"))
    assert any(isinstance(m, INT8_LINEARS) for m in loaded.model.modules())
    # a native per-row path (AVX-512, else AVX2) takes the down projections too, fbgemm's
    # per-tensor one not
    down = loaded.model.model.layers[0].mlp.down_proj
    native = int8_gemm_here() or avx2_int8_gemm_here()
    assert isinstance(down, NativeInt8Linear) == (native is not None)
    if isinstance(down, NativeInt8Linear):
        assert type(down.gemm) is type(native)
    engine = build_llm_engine(EngineConfig.tiny(linear_quant="int8"), loaded)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = engine.generate_sync([GenerationRequest("a", (5, 6, 7, 8), params)])
    chunks = out["a"][0]
    assert sum(c.completion_tokens for c in chunks if c.finish_reason) == 12


def test_unknown_or_gpu_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="linear_quant must be one of"):
        EngineConfig.tiny(linear_quant="int4")
    with pytest.raises(ValueError, match="--linear-quant must be one of none, int8"):
        engine_config(None, None, linear_quant="fp8")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_product_is_close_to_the_float_one(
    native_int8: Int8Kernel, rows: int, bias: bool, dtype: torch.dtype
) -> None:
    linear = _linear(576, 384, bias, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = nn.functional.linear(x.float(), linear.weight, linear.bias)
    with torch.inference_mode():
        got = NativeInt8Linear.from_linear(linear, native_int8)(x.view(1, rows, 576))
    assert got.dtype == dtype and got.shape == (1, *expected.shape)
    error = (got[0].float() - expected).norm() / expected.norm()
    assert error < 0.02, f"relative error {error:.4f}"


def test_native_rows_keep_their_own_scale(native_int8: Int8Kernel) -> None:
    """A row with a far larger range beside small rows: fbgemm's one scale per call
    flattens the small rows; per-row scales keep them (and keep each row's result
    independent of its batch)."""
    linear = _linear(576, 384, False, seed=5)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(2))
    x[0] *= 1000.0
    expected = nn.functional.linear(x, linear.weight)
    with torch.inference_mode():
        native = NativeInt8Linear.from_linear(linear, native_int8)
        got, alone = native(x), native(x[3:4])
        per_tensor = Int8DynamicLinear.from_linear(linear)(x)
    small = slice(1, 8)
    error = (got[small] - expected[small]).norm() / expected[small].norm()
    per_tensor_error = (per_tensor[small] - expected[small]).norm() / expected[small].norm()
    assert error < 0.02 < per_tensor_error
    assert torch.equal(alone, got[3:4])


def test_native_quantization_takes_every_linear_it_can(native_int8: Int8Kernel) -> None:
    model = load_model(EngineConfig.tiny()).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    replaced = quantize_linears(model, gemm=native_int8)
    layers = model.model.layers
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert all(isinstance(layer.get_submodule(name), NativeInt8Linear)
               for layer in layers for name in names)  # fmt: skip
    # the byte vocabulary's head (not a multiple of 16 wide) falls back to fbgemm
    head_native = native_int8.supports(model.lm_head.weight)
    assert isinstance(model.lm_head, NativeInt8Linear if head_native else Int8DynamicLinear)
    assert replaced == 4 * len(layers) + 1
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert quantize_linears(model, gemm=native_int8) == 0  # already quantized: nothing to do


def test_native_gate_up_is_paired_and_fuses_silu(
    int8_gemm: NativeInt8Gemm, fused_kernels: FusedKernels
) -> None:
    model = load_model(EngineConfig.tiny(dtype="bfloat16")).model
    quantize_linears(model, gemm=int8_gemm)
    mlp = model.model.layers[0].mlp
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    assert isinstance(gate_up, NativeInt8Linear) and isinstance(down, NativeInt8Linear)
    assert gate_up.quantized.paired and not down.quantized.paired
    x = torch.randn(5, gate_up.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(gate_up.silu_mul(x), silu_mul(fused_kernels, gate_up(x)))
        assert down.silu_mul(torch.randn(5, down.in_features).to(torch.bfloat16)) is None
        assert gate_up.silu_mul(x.float()) is None


def test_avx2_gate_up_is_paired_and_fuses_silu(avx2_int8_gemm: Avx2Int8Gemm) -> None:
    model = load_model(EngineConfig.tiny(dtype="float32")).model
    quantize_linears(model, gemm=avx2_int8_gemm)
    mlp = model.model.layers[0].mlp
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    assert isinstance(gate_up, NativeInt8Linear) and isinstance(down, NativeInt8Linear)
    assert gate_up.quantized.paired and not down.quantized.paired
    x = torch.randn(5, gate_up.in_features)
    with torch.inference_mode():
        product = gate_up(x)
        width = product.shape[1] // 2
        expected = nn.functional.silu(product[:, :width]) * product[:, width:]
        torch.testing.assert_close(gate_up.silu_mul(x), expected, rtol=1e-5, atol=1e-6)
        assert down.silu_mul(torch.randn(5, down.in_features)) is None
        assert gate_up.silu_mul(x.to(torch.bfloat16)) is None  # the kernel takes float32
