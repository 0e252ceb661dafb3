"""The intake's JSON fast path answers exactly as the engine's strict decoder: the same
object, or the same OpenAI error, for good bodies and every kind of bad one; request
ids are canonical random version-4 UUIDs."""

from __future__ import annotations

import functools
import json
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtoll.openai.errors import OpenAIError, decode_json_body
from proxy.intake import decode_json_object, new_request_id

BODIES = [
    b'{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9llo"}]}',
    '{"model": "m", "messages": [{"role": "user", "content": "héllo ✓"}]}'.encode(),
    b'{"a": "\\ud800"}',  # lone surrogate escape
    b'{"a": "\\ud83d\\ude00"}',  # a valid pair
    b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b'{"a": "NaN"}',
    b"", b"   ", b"[1, 2]", b'"text"', b"{", b'{"a": 1,}', b"\xef\xbb\xbf{}",
    b'{"a": "\xff"}', b'{"n": 1' + b"0" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000,
    b'{"a": 1} trailing',
    # where orjson and json differ: big integers, non-finite and unusual numbers
    b'{"seed": 123456789012345678901234567890}', b'{"n": 18446744073709551615}',
    b'{"n": 18446744073709551616}', b'{"n": -9223372036854775809}', b'{"x": 1e400}',
    b'{"x": -0.0, "y": -0, "z": 1E-7, "w": 5e-324}', b'{"a": 1, "a": 2}',
]


def _outcome(decode: object, raw: bytes) -> object:
    assert callable(decode)
    try:
        return ("ok", decode(raw))
    except OpenAIError as exc:
        return ("error", exc.status, exc.body())


@pytest.mark.parametrize("raw", BODIES, ids=[repr(b[:30]) for b in BODIES])
def test_same_outcome_as_the_strict_decoder(raw: bytes) -> None:
    assert _outcome(decode_json_object, raw) == _outcome(decode_json_body, raw)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text()
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                    max_leaves=20))
def test_same_outcome_for_any_json_value(value: object) -> None:
    for raw in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode(
            "utf-8", errors="surrogatepass")):
        assert _outcome(decode_json_object, raw) == _outcome(decode_json_body, raw)


def test_request_ids_are_random_version_4_uuids() -> None:
    ids = [new_request_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    parsed = [uuid.UUID(i) for i in ids]
    assert all(str(u) == i for u, i in zip(parsed, ids, strict=True))  # canonical spelling
    assert {u.version for u in parsed} == {4}
    assert {u.variant for u in parsed} == {uuid.RFC_4122}
    # every random bit varies: 122 of them (4 version and 2 variant bits are fixed)
    varying = functools.reduce(int.__or__, (u.int ^ parsed[0].int for u in parsed))
    assert bin(varying).count("1") == 122
