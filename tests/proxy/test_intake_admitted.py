"""Intake settles admission's fields in the parsed request, copying it only on a change."""

from __future__ import annotations

from kvtoll.openai.protocol import parse_request
from proxy.intake import _admitted_request

MESSAGES = [{"role": "user", "content": "hi"}]


def test_request_already_admitted_is_not_copied() -> None:
    request = parse_request("chat", {"model": "m", "messages": MESSAGES, "max_tokens": 16})
    assert _admitted_request(request, 16) is request


def test_max_tokens_and_salt_fields_are_settled_in_a_copy() -> None:
    request = parse_request("chat", {"model": "m", "messages": MESSAGES,
                                     "max_completion_tokens": 40})
    admitted = _admitted_request(request, 32)
    assert admitted is not request
    assert (admitted.max_tokens, admitted.max_completion_tokens) == (32, None)
    assert (request.max_tokens, request.max_completion_tokens) == (None, 40)  # untouched
    completion = parse_request("completion", {"model": "m", "prompt": "hi"})
    assert _admitted_request(completion, 8).max_tokens == 8
