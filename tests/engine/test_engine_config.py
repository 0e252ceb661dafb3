"""engine.config: the device is checked and normalised once, when the config is built."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, check_device


@pytest.mark.parametrize(("device", "normalised"), [("cpu", "cpu"), ("cpu:0", "cpu")])
def test_cpu_devices_normalise(device: str, normalised: str) -> None:
    assert EngineConfig.tiny(device=device).device == normalised


@pytest.mark.parametrize("device", ["tpu", "xla", "", "cuda:x", "meta"])
def test_unknown_devices_are_refused(device: str) -> None:
    with pytest.raises(ValueError, match="use cpu, cuda or cuda:N"):
        EngineConfig.tiny(device=device)


def test_cuda_needs_a_visible_gpu() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is visible"):
            check_device("cuda")
        return
    count = torch.cuda.device_count()
    assert check_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match=f"only {count} CUDA GPU"):
        check_device(f"cuda:{count}")
