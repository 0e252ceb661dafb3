"""The dequantized-weight cache (engine.loader.weight_cache): a second read of the same
model file comes from the cache; a changed file, a corrupt cache or an unwritable
cache directory fall back to reading the model."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.loader.weight_cache import cache_file, cached_weights


def _model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF-ish bytes")
    return path


def _reader(calls: list[int], scale: float = 1.0):  # type: ignore[no-untyped-def]
    def read() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
                "b.weight": torch.ones(5).t()}
    return read


def test_second_read_comes_from_the_cache(tmp_path: Path) -> None:
    model, cache, calls = _model(tmp_path), tmp_path / "cache", []
    first = cached_weights(model, _reader(calls), cache)
    second = cached_weights(model, _reader(calls), cache)
    assert calls == [1] and cache_file(model, cache).exists()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert [p.name for p in cache.iterdir()] == [cache_file(model, cache).name]  # no leftovers


def test_a_changed_model_file_is_read_again(tmp_path: Path) -> None:
    model, cache, calls = _model(tmp_path), tmp_path / "cache", []
    cached_weights(model, _reader(calls), cache)
    model.write_bytes(b"another model, another size")
    os.utime(model, ns=(1, 1))
    fresh = cached_weights(model, _reader(calls, scale=2.0), cache)
    assert calls == [1, 1] and fresh["a.weight"][0, 1] == 2.0


def test_a_corrupt_cache_file_is_ignored_and_replaced(tmp_path: Path) -> None:
    model, cache, calls = _model(tmp_path), tmp_path / "cache", []
    cache.mkdir()
    cache_file(model, cache).write_bytes(b"\x00" * 40)
    state = cached_weights(model, _reader(calls), cache)
    assert calls == [1] and state["a.weight"].shape == (3, 4)
    assert torch.equal(cached_weights(model, _reader(calls), cache)["a.weight"],
                       state["a.weight"])
    assert calls == [1]


def test_an_unwritable_cache_only_costs_time(tmp_path: Path) -> None:
    model, calls = _model(tmp_path), []
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    state = cached_weights(model, _reader(calls), blocker / "cache")
    assert calls == [1] and state["b.weight"].shape == (5,)
