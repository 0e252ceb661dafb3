"""kvtoll.fastjson gives the standard library's values: the same documents decoded, and
encodings that decode to the same values, including where orjson alone would differ
(integers beyond 64 bits, non-finite numbers)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtoll import fastjson

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=25,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, with the type of every number kept (1 and 1.0 differ)."""
    if isinstance(a, float) or isinstance(b, float):
        return type(a) is type(b) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


@given(JSON_VALUES)
def test_dumps_decodes_to_the_value(value: Any) -> None:
    assert _same(json.loads(fastjson.dumps(value)), value)
    assert _same(json.loads(fastjson.dumps(value, sort_keys=True)), _sorted(value))


@given(JSON_VALUES)
def test_loads_gives_what_json_gives(value: Any) -> None:
    for raw in (json.dumps(value), json.dumps(value, ensure_ascii=False),
                json.dumps(value, indent=1)):
        assert _same(fastjson.loads(raw), json.loads(raw))
        assert _same(fastjson.loads(raw.encode()), json.loads(raw))


def test_compact_utf8_output() -> None:
    assert fastjson.dumps({"a": "é✓", "b": [1, 2.5, None, True]}) == (
        '{"a":"é✓","b":[1,2.5,null,true]}'.encode())
    assert fastjson.dumps({"b": 1, "a": {"d": 1, "c": 2}}, sort_keys=True) == (
        b'{"a":{"c":2,"d":1},"b":1}')


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**30, [1, {"seed": 2**70}]])
def test_integers_beyond_64_bits_round_trip_exactly(value: Any) -> None:
    raw = fastjson.dumps(value)
    assert json.loads(raw) == value
    assert fastjson.loads(raw) == value  # not a float


@pytest.mark.parametrize("raw", ["1e400", "NaN", "-Infinity", '{"a": Infinity}'])
def test_non_finite_numbers_decode_as_json_does(raw: str) -> None:
    assert repr(fastjson.loads(raw)) == repr(json.loads(raw))


@pytest.mark.parametrize("raw", ['{"a": 12345678901234567890123}', "18446744073709551616"])
def test_fast_loads_refuses_what_it_may_decode_differently(raw: str) -> None:
    with pytest.raises(ValueError):
        fastjson.fast_loads(raw)


def test_a_non_finite_float_encodes_as_null() -> None:
    assert fastjson.dumps({"x": float("nan"), "y": float("inf")}) == b'{"x":null,"y":null}'
