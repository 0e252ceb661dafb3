"""Native bfloat16 linears: which layers the kernel takes, the row limit between it and
oneDNN, and the start-up race's verdicts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import engine.model.native_linear as native_linear
from engine.kernels.cpu_fused import FusedKernels, silu_mul
from engine.kernels.cpu_gemm import NativeGemm
from engine.model.native_linear import (
    ALL_ROWS,
    kept_rows_limit,
    native_rows_limit,
    use_native_linears,
)
from engine.model.packed_linear import PackedLinear, onednn_bf16_packing_works


@pytest.fixture(scope="module")
def gemm(native_gemm: NativeGemm) -> NativeGemm:
    """The kernel, where oneDNN can pack bfloat16 too (the layers start packed for it)."""
    if not onednn_bf16_packing_works():
        pytest.skip("no oneDNN bfloat16 packing here")
    return native_gemm


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 40, bias=False),
                          nn.Linear(40, 48, bias=True)).to(torch.bfloat16)  # fmt: skip
    for i, layer in enumerate(list(model)):
        model[i] = PackedLinear.from_linear(layer, "onednn")
    return model


def test_only_bias_free_packable_layers_are_taken(gemm: NativeGemm) -> None:
    model = _model()
    assert use_native_linears(model, gemm, ALL_ROWS) == 1  # 40 outputs: not n % 16; a bias
    assert model[0].native is gemm and model[1].native is None and model[2].native is None
    assert "native up to" in repr(model[0])


def test_calls_up_to_the_limit_run_natively_the_rest_on_onednn(gemm: NativeGemm) -> None:
    model = _model()
    layer = model[0]
    x = torch.randn(9, 64).to(torch.bfloat16)
    onednn = layer(x)
    packed = gemm.pack(layer.weight)
    use_native_linears(model, gemm, max_rows=4)
    with torch.inference_mode():
        assert torch.equal(layer(x[:4]), gemm.linear(x[:4], packed, 96, torch.get_num_threads()))
        assert torch.equal(layer(x), onednn)  # 9 rows: over the limit
        three_d = layer(x[:4].view(2, 2, 64))
    assert three_d.shape == (2, 2, 96)
    reference = torch.nn.functional.linear(x.float(), layer.weight.float())
    assert torch.allclose(layer(x).float(), reference, rtol=2**-7, atol=1e-2)


def test_taking_every_call_frees_the_onednn_copy(gemm: NativeGemm) -> None:
    kept, freed = _model(), _model()
    use_native_linears(kept, gemm, max_rows=64)
    use_native_linears(freed, gemm, ALL_ROWS)
    assert kept[0].packed.numel() > 0 and freed[0].packed.numel() == 0
    assert freed[1].packed.numel() > 0  # a layer the kernel did not take keeps its copy
    x = torch.randn(3, 64)
    with torch.inference_mode():  # rows that are not bfloat16 still multiply (F.linear)
        out = freed[0](x.to(torch.bfloat16))
        assert torch.equal(out, gemm.linear(x.to(torch.bfloat16), freed[0].native_packed, 96, 2))
        widened = freed[0].weight.float()
        assert torch.allclose(freed[0].float()(x), torch.nn.functional.linear(x, widened))


def test_use_native_refuses_a_layer_it_cannot_take(gemm: NativeGemm) -> None:
    with pytest.raises(ValueError, match="without bias"):
        _model()[2].use_native(gemm, ALL_ROWS)


@pytest.mark.parametrize(
    ("native_ms", "expected"),
    [((1.0, 1.0, 1.0), ALL_ROWS), ((1.0, 1.0, 3.0), 256), ((1.0, 3.0), 64), ((3.0,), 0),
     ((1.0, 3.0, 1.0), 64)],  # a later win after a loss does not count (and is not run)
)
def test_the_race_maps_wins_to_a_row_limit(
    gemm: NativeGemm, monkeypatch: pytest.MonkeyPatch, native_ms: tuple[float, ...],
    expected: int,
) -> None:  # fmt: skip
    times = iter(native_ms)

    def fake_best_of(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
        assert set(fns) == {"native", "onednn"}
        return {"native": next(times), "onednn": 2.0}

    monkeypatch.setattr(native_linear, "interleaved_best", fake_best_of)
    assert native_rows_limit(gemm) == expected


def test_the_race_runs_for_real(gemm: NativeGemm) -> None:
    assert native_rows_limit(gemm, repeats=1) in (0, *native_linear.RACE_ROWS[:-1], ALL_ROWS)


def test_gate_up_layers_are_paired_and_fuse_silu_up_to_the_limit(
    gemm: NativeGemm, fused_kernels: FusedKernels
) -> None:
    """A layer named gate_up_proj is packed as gate/up pairs: the same products, and
    its silu_mul is the fused kernels' SiLU * up of them, for calls the kernel takes."""
    torch.manual_seed(1)
    mlp = nn.Module()
    for name in ("gate_up_proj", "other"):
        linear = nn.Linear(64, 256, bias=False).to(torch.bfloat16)
        setattr(mlp, name, PackedLinear.from_linear(linear, "onednn"))
    assert use_native_linears(mlp, gemm, 8) == 2
    gate_up, other = mlp.gate_up_proj, mlp.other
    assert gate_up.native_paired and not other.native_paired
    with torch.inference_mode():
        x = torch.randn(8, 64).to(torch.bfloat16)
        product = gate_up(x)
        assert torch.equal(product, gemm.linear(x, gemm.pack(gate_up.weight), 256, 2))
        assert torch.equal(gate_up.silu_mul(x), silu_mul(fused_kernels, product))
        assert other.silu_mul(x) is None  # not paired
        assert gate_up.silu_mul(torch.randn(9, 64).to(torch.bfloat16)) is None  # oneDNN's rows
        assert gate_up.silu_mul(x.float()) is None


def test_the_race_is_run_once_per_machine_and_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Later starts (and concurrent ones, engine.dtype_probe.persisted's lock) read the
    first start's row limit, whatever a fresh race would say; another library build races
    again. ``no`` (0) is a verdict to keep too."""
    verdicts = iter([256, ALL_ROWS, 0, 64])
    raced: list[str] = []

    def race(gemm: object) -> int:
        raced.append(gemm.path.name)
        return next(verdicts)

    monkeypatch.setattr(native_linear, "native_rows_limit", race)
    path = tmp_path / "probe.json"
    one, other = (SimpleNamespace(path=Path(f"/cache/cpu_gemm-{h}.so")) for h in ("a1", "b2"))
    assert [kept_rows_limit(one, path) for _ in range(3)] == [256] * 3
    assert kept_rows_limit(other, path) == ALL_ROWS
    path.write_text("not json")
    assert kept_rows_limit(one, path) == 0
    assert kept_rows_limit(one, path) == 0
    assert raced == ["cpu_gemm-a1.so", "cpu_gemm-b2.so", "cpu_gemm-a1.so"]
