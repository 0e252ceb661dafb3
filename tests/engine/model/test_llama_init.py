"""The model's construction: on the CPU the embedding starts as ``nn.Embedding``'s own
init (the same draws from the same seed); on the meta device (a checkpoint's skeleton,
engine.factory) no init runs, so building it does not import ``torch._dynamo``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

from engine.factory import tiny_llama_config
from engine.model.llama import LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[3]


def test_the_embedding_draws_what_nn_embedding_draws() -> None:
    cfg = tiny_llama_config()
    torch.manual_seed(7)
    ours = LlamaForCausalLM(cfg).model.embed_tokens.weight
    torch.manual_seed(7)
    theirs = nn.Embedding(cfg.vocab_size, cfg.hidden_size).weight
    assert isinstance(ours, nn.Parameter) and ours.requires_grad
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_a_meta_skeleton_does_not_import_dynamo() -> None:
    """torch's Python reference for normal_ on a meta tensor imports torch._dynamo at its
    first call (2-3 s of a worker's start, measured on a 2-core EPYC)."""
    code = textwrap.dedent("""
        import sys, torch
        from engine.factory import tiny_llama_config
        from engine.model.llama import LlamaForCausalLM
        with torch.device("meta"):
            model = LlamaForCausalLM(tiny_llama_config())
        assert model.model.embed_tokens.weight.is_meta
        print("DYNAMO" if "torch._dynamo" in sys.modules else "NO-DYNAMO")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["NO-DYNAMO"]
