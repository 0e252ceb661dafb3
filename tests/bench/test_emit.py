"""A benchmark's JSON result: printed, and written to --out when given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.emit import emit


def test_emit_prints_and_writes_the_same_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = {"tok_per_s": 12.5, "runs": [1, 2]}
    out = tmp_path / "r.json"
    emit(result, out)
    assert json.loads(capsys.readouterr().out) == result
    assert out.read_text().endswith("}\n") and json.loads(out.read_text()) == result
    emit(result, None)  # stdout only
    assert json.loads(capsys.readouterr().out) == result
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
