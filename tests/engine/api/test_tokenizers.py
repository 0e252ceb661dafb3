"""The gateway's copy of the workers' tokenizer: chosen by model name or path, and
producing exactly the token ids the worker's engine would (what prefix routing
hashes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api.convert import prepare
from engine.api.tokenizers import worker_tokenizer
from engine.config import TINY_MODEL
from engine.kv.hashing import TenantSalt
from engine.loader.bundled import bundled_model_path
from engine.tokenizer import ByteTokenizer
from kvtoll.openai.protocol import parse_request
from proxy.prompt import PromptCounter

REQUESTS = [
    ("completion", {"model": "m", "prompt": "a text prompt"}),
    ("chat", {"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text",
                                                                      "text": "parts"}]},
    ]}),
]


def test_choice_by_model_name_or_option(tmp_path: Path) -> None:
    assert isinstance(worker_tokenizer([TINY_MODEL]), ByteTokenizer)
    assert worker_tokenizer([TINY_MODEL], "none") is None
    assert worker_tokenizer(["some-remote-model"]) is None
    assert worker_tokenizer([TINY_MODEL, "other"]) is None  # no single tokenizer fits
    with pytest.raises(ValueError, match="neither"):
        worker_tokenizer(["x"], str(tmp_path / "missing.bin"))


@pytest.mark.parametrize(("kind", "body"), REQUESTS)
def test_gateway_ids_equal_the_engines(kind: str, body: dict[str, object]) -> None:
    tokenizer = ByteTokenizer()
    request = parse_request(kind, body)  # type: ignore[arg-type]
    counted = PromptCounter(tokenizer).count(request)
    engine_ids = prepare(request, tokenizer, 4096, TenantSalt(b"s" * 16)).prompts[0]
    assert counted.exact and counted.token_ids == engine_ids


def test_bundled_gguf_tokenizer_by_name() -> None:  # reads the GGUF metadata (~5 s)
    path = bundled_model_path()  # the README's install puts it there; absent is a failure
    tokenizer = worker_tokenizer([path.stem])
    assert tokenizer is not None and not isinstance(tokenizer, ByteTokenizer)
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    assert 0 < len(ids) < len(text) and tokenizer.decode(ids) == text
