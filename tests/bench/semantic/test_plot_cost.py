"""bench/semantic/plot_cost.py draws the figures' JSON and refuses unpaired inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.semantic.plot_cost import STAGES, main


def _write(path: Path, data: dict[str, object]) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_writes_a_png_from_the_figures(tmp_path: Path) -> None:
    scale = {"lookup_ms": {s: {"p50": 1.0, "p99": 2.0} for s in STAGES}, "load_average_1m": 1.5}
    http = {"semantic": {"semantic_hits_per_s": 321.0}}
    paths = [_write(tmp_path / f"{name}.json", data)
             for name, data in (("s1", scale), ("s2", scale), ("h1", http), ("h2", http))]
    out = tmp_path / "cost.png"
    assert main(["--scale", str(paths[0]), str(paths[1]), "--http", str(paths[2]),
                 str(paths[3]), "--out", str(out)]) == 0  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unpaired_inputs_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.json", {})
    with pytest.raises(SystemExit):
        main(["--scale", str(path), "--http", str(path), "--out", str(tmp_path / "o.png")])
