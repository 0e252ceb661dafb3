"""The dequantized-weight cache (engine.loader.weight_cache): a second read of the same
model file comes from the cache; a changed file, a corrupt cache or an unwritable
cache directory fall back to reading the model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from engine.loader.weight_cache import Loaded, cache_file, cached_weights


def _model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF-ish bytes")
    return path


def _reader(calls: list[int], scale: float = 1.0) -> Callable[[], Loaded]:
    def read() -> Loaded:
        calls.append(1)
        return ({"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
                 "b.weight": torch.ones(5).t()}, {"config": f'{{"scale": {scale}}}'})
    return read


def test_second_read_comes_from_the_cache(tmp_path: Path) -> None:
    model, cache, calls = _model(tmp_path), tmp_path / "cache", []
    first, meta = cached_weights(model, _reader(calls), cache)
    second, cached_meta = cached_weights(model, _reader(calls), cache)
    assert calls == [1] and cache_file(model, cache).exists()
    assert first.keys() == second.keys() and cached_meta == meta == {"config": '{"scale": 1.0}'}
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert [p.name for p in cache.iterdir()] == [cache_file(model, cache).name]  # no leftovers


def test_a_changed_model_file_is_read_again(tmp_path: Path) -> None:
    model, cache, calls = _model(tmp_path), tmp_path / "cache", []
    cached_weights(model, _reader(calls), cache)
    model.write_bytes(b"another model, another size")
    os.utime(model, ns=(1, 1))
    fresh, meta = cached_weights(model, _reader(calls, scale=2.0), cache)
    assert calls == [1, 1] and fresh["a.weight"][0, 1] == 2.0 and "2.0" in meta["config"]


def test_a_corrupt_cache_file_is_ignored_and_replaced(tmp_path: Path) -> None:
    model, cache, calls = _model(tmp_path), tmp_path / "cache", []
    cache.mkdir()
    cache_file(model, cache).write_bytes(b"\x00" * 40)
    state, _ = cached_weights(model, _reader(calls), cache)
    assert calls == [1] and state["a.weight"].shape == (3, 4)
    assert torch.equal(cached_weights(model, _reader(calls), cache)[0]["a.weight"],
                       state["a.weight"])
    assert calls == [1]


def test_an_unwritable_cache_only_costs_time(tmp_path: Path) -> None:
    model, calls = _model(tmp_path), []
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    state, _ = cached_weights(model, _reader(calls), blocker / "cache")
    assert calls == [1] and state["b.weight"].shape == (5,)


def test_the_bundled_model_loads_the_same_from_the_cache(tmp_path: Path) -> None:
    """The real GGUF: config, tokenizer (and chat template) and tensors read back from
    the cache equal those parsed from the file."""
    from engine.loader.bundled import bundled_model_path
    from engine.loader.gguf_loader import load_gguf

    path = bundled_model_path()
    cfg, state, tok = load_gguf(path, tmp_path)  # parsed, dequantized, cached
    cfg2, state2, tok2 = load_gguf(path, tmp_path)  # from the cache
    assert cfg2 == cfg and state2.keys() == state.keys()
    assert all(torch.equal(state[k], state2[k]) for k in list(state)[::17])
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 42!"}]
    assert tok2.apply_chat_template(chat) == tok.apply_chat_template(chat)
    assert tok2.eos_token_ids == tok.eos_token_ids and tok2.vocab_size == tok.vocab_size
    text = "<|im_start|>user naïve café 3.14<|im_end|>"
    assert tok2.encode(text) == tok.encode(text) and tok2.decode(tok.encode(text))
