"""JSON on the gateway's per-request path, through orjson (C, several times faster than
the standard library's encoder and decoder), with the standard library's results.

Every request is decoded once and encoded three times (the body sent upstream, the
outbox record, the response) and every upstream event decoded once: with the
standard library's ``json`` that was ~9% of the gateway's CPU under load (measured
with py-spy). orjson differs from ``json`` in a few corners, each handled here so
that callers see what ``json`` gave them:

* integers beyond 64 bits: orjson decodes them as floats (lossy) and refuses to encode
  them. :func:`loads` leaves a document with a run of 19 or more digits to ``json``
  (orjson decodes every integer of at most 18 digits exactly); :func:`dumps` encodes
  what orjson refuses with ``json``.
* ``NaN`` / ``Infinity`` / ``1e400``: orjson refuses them when decoding; :func:`loads`
  then asks ``json``, which decides (the strict request decoder in
  ``proxy.intake`` refuses them with the exact error, as before).
* non-finite floats when encoding: orjson writes ``null``; ``json`` with
  ``allow_nan=False`` raised. Only a value taken from an upstream can be one (a
  client's request is decoded strictly), and ``null`` is the valid JSON of the two.

Output is compact (no spaces) UTF-8, non-ASCII characters as they are
(``ensure_ascii=False``), keys in insertion order unless ``sort_keys``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONG_RUN = 19
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % _LONG_RUN)
_DIGITS = b"0123456789"
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_COMPACT_SORTED = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def dumps(value: Any, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON of ``value`` (see module doc)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except TypeError:  # an integer beyond 64 bits, or a type orjson does not know
        encoder = _COMPACT_SORTED if sort_keys else _COMPACT
        return encoder.encode(value).encode("utf-8")


def fast_loads(raw: bytes | str) -> Any:
    """``raw`` decoded by orjson; ``ValueError`` for anything it refuses or might decode
    differently from ``json`` (callers fall back to their ``json`` decoder, which
    gives the exact result or error)."""
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    # a run of 19 digits needs 19 digits: counting them (C) is cheaper than the search
    if len(data) - len(data.translate(None, _DIGITS)) >= _LONG_RUN and _LONG_DIGITS.search(data):
        raise ValueError("an integer may need more than 64 bits")
    return orjson.loads(raw)


def loads(raw: bytes | str) -> Any:
    """``json.loads(raw)``, through orjson where that gives the same value."""
    try:
        return fast_loads(raw)
    except ValueError:  # orjson.JSONDecodeError is a ValueError
        return json.loads(raw)
