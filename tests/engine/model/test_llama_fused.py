"""The decoder with its small ops fused (engine.kernels.cpu_fused) computes what the
eager decoder computes: on the tiny model, one step mixing prefill chunks (one after
cached tokens) and decodes gives the same logits and the same K/V in the caches, bit for
bit, in float32 and bfloat16. Skipped where the native kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.factory import load_model
from engine.kernels import native_build
from engine.kernels.cpu_fused import load_fused_kernels
from engine.kernels.cpu_fused import unavailable_reason as cpu_fused_unavailable
from engine.runner import ModelRunner, RunnerSeq

WHY_NOT = cpu_fused_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernels: {WHY_NOT}")

# (token ids, start, block ids): a prompt, a chunk after 8 cached tokens, two decodes.
BATCH = [
    (tuple(range(3, 22)), 0, (0, 1)),
    (tuple(range(40, 45)), 8, (2,)),
    ((7,), 12, (3,)),
    ((9,), 30, (4, 5)),
]


def _runner(dtype: str, fused: bool) -> ModelRunner:
    config = EngineConfig.tiny(dtype=dtype)
    model = load_model(config).model
    kernels = load_fused_kernels(native_build.default_cache_dir()) if fused else None
    runner = ModelRunner(model, TorchAttentionBackend(), 8, 16, 64,
                         model.lm_head.weight.dtype, "cpu", fused=kernels)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for k, v in runner.kv_caches:  # the cached tokens the chunk and the decodes attend to
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    return runner


def _batch() -> list[RunnerSeq]:
    return [RunnerSeq(ids, start, blocks, needs_logits=True) for ids, start, blocks in BATCH]


def _run(dtype: str, fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    runner = _runner(dtype, fused)
    logits = runner.execute(_batch())
    return logits, [c for pair in runner.kv_caches for c in pair]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_step_equals_the_eager_step(dtype: str) -> None:
    want_logits, want_caches = _run(dtype, fused=False)
    got_logits, got_caches = _run(dtype, fused=True)
    assert torch.equal(got_logits, want_logits)
    for got, want in zip(got_caches, want_caches, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fused_step_run_in_stages_equals_the_eager_step(dtype: str) -> None:
    """The fused path carries its state (residual stream and the next layer's normed
    input) between the stages of a staged step (engine.tenant_fair's interjections),
    with another step run in between on other blocks."""
    want_logits, want_caches = _run(dtype, fused=False)
    runner = _runner(dtype, fused=True)
    forward = runner.start(_batch())
    assert forward.advance(1)
    runner.execute([RunnerSeq(tuple(range(60, 67)), 0, (7,), needs_logits=True)])
    while forward.advance(1):
        pass
    assert torch.equal(forward.logits(), want_logits)
    caches = [c for pair in runner.kv_caches for c in pair]
    for got, want in zip(caches, want_caches, strict=True):  # block 7: the step in between
        assert torch.equal(got[:7], want[:7]) and torch.equal(got[8:], want[8:])
