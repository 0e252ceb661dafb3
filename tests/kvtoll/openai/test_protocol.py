from __future__ import annotations

from typing import Any

import pytest

from kvtoll.openai.errors import OpenAIError, decode_json_body, format_loc
from kvtoll.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    strip_client_salt,
)

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **fields}


def _rejected(parse: Any, body: dict[str, Any]) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body)
    err = info.value
    assert err.status == 400
    body_out = err.body()["error"]
    assert set(body_out) == {"message", "type", "param", "code"}
    assert body_out["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        (_chat(temperature=-0.1), "temperature"),
        (_chat(temperature=float("nan")), "temperature"),
        (_chat(temperature=float("inf")), "temperature"),
        (_chat(temperature="0.5"), "temperature"),
        (_chat(top_p=0.0), "top_p"),
        (_chat(top_p=1.01), "top_p"),
        (_chat(n=0), "n"),
        (_chat(n=129), "n"),
        (_chat(n=1.0), "n"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_tokens=-5), "max_tokens"),
        (_chat(max_completion_tokens=0), "max_completion_tokens"),
        (_chat(stream=1), "stream"),
        (_chat(stop=[""]), "stop"),
        (_chat(stop=["x"] * 17), "stop"),
        (_chat(top_logprobs=3), "top_logprobs"),
        (_chat(cache_salt="not-hex"), "cache_salt"),
        (_chat(cache_salt="abc"), "cache_salt"),
        (_chat(frobnicate=True), "frobnicate"),
        (_chat(api_base="http://evil"), "api_base"),
        (_chat(base_url="http://evil"), "base_url"),
        (_chat(upstream="w1"), "upstream"),
        (_chat(worker="http://w"), "worker"),
        ({"messages": MSG}, "model"),
        ({"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0]"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_bad_chat_requests_are_400_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    assert _rejected(parse_chat_request, body).param == param


@pytest.mark.parametrize(
    "prompt",
    ["", [], [[]], ["a", ""], [1, -1], [True], 5, [1, "a"], ["a"] * 65, [[1], [2, "x"]]],
)
def test_bad_completion_prompts_are_400(prompt: object) -> None:
    assert _rejected(parse_completion_request, {"model": "m", "prompt": prompt}).param == "prompt"


def test_completion_cross_field_checks() -> None:
    body = {"model": "m", "prompt": "x", "n": 3, "best_of": 2}
    assert _rejected(parse_completion_request, body).param == "best_of"


def test_valid_chat_request_normalises_fields() -> None:
    req = parse_chat_request(
        _chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            ],
            stop="END",
            max_tokens=5,
            max_completion_tokens=7,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
            cache_salt="00ff",
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="none",
            response_format={"type": "text"},
            user="u1",
            temperature=0,
        )
    )
    assert isinstance(req, ChatCompletionRequest)
    assert req.messages[1].text() == "a\nb"
    assert req.messages[2].text() == ""
    assert req.stop_strings() == ("END",)
    assert req.requested_max_tokens() == 7
    assert req.num_logprobs() == 2
    assert req.include_usage() is True
    assert req.salt_bytes() == b"\x00\xff"
    assert req.temperature == 0.0


def test_completion_prompt_shapes() -> None:
    def prompts(p: object) -> object:
        req = parse_completion_request({"model": "m", "prompt": p})
        assert isinstance(req, CompletionRequest)
        return req.prompts()

    assert prompts("abc") == ["abc"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_include_usage_needs_stream() -> None:
    req = parse_chat_request(_chat(stream_options={"include_usage": True}))
    assert req.include_usage() is False


def test_strip_client_salt_drops_only_salt_fields() -> None:
    body = _chat(cache_salt="aa", user="u")
    assert strip_client_salt(body) == _chat(user="u")


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "invalid_json"),
        (b"{not json", "invalid_json"),
        (b'{"a": NaN}', "invalid_json"),
        (b'{"a": Infinity}', "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'{"a": "\xff\xfe"}', "invalid_encoding"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
        (b'{"seed": 1' + b"0" * 5000 + b"}", "invalid_json"),
        (b'{"messages": [{"content": "\\ud800"}]}', "invalid_encoding"),
        (b'{"a": 1}{"b": 2}', "invalid_json"),
    ],
)
def test_decode_json_body_rejects_malformed_input(raw: bytes, code: str) -> None:
    with pytest.raises(OpenAIError) as info:
        decode_json_body(raw)
    assert (info.value.status, info.value.code) == (400, code)


def test_format_loc() -> None:
    assert format_loc(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert format_loc(("query", "cursor")) == "cursor"
    assert format_loc(()) is None
