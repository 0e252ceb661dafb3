"""Kernel tests run on CUDA when present, else on CPU under the Triton interpreter.

``TRITON_INTERPRET`` is read when ``triton.jit`` decorates a kernel, so it is set here,
at conftest import, before any test module imports :mod:`engine.kernels`.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
