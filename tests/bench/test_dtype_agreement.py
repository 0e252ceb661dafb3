"""bench/dtype_agreement.py on the tiny model: one trial of two real worker processes,
both readings (start-up line, GET /v1/models) of each found and compared."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench import dtype_agreement


def test_one_trial_reads_the_log_line_and_v1_models_of_both_workers() -> None:
    """A fresh probe, the machine's kernel build shared (as the bench's trials do): two
    workers each building the native kernels into an empty cache took ~58 s of the suite."""
    with tempfile.TemporaryDirectory() as tmp:
        cache_home = Path(tmp) / "cache"
        dtype_agreement.fresh_cache_home(cache_home, dtype_agreement.machine_cache())
        assert not (cache_home / "kvtoll" / "dtype-probe.json").exists()
        out = dtype_agreement.trial("kvtoll-tiny", cache_home, Path(tmp), 120)
    assert out["log_line"][0] in ("float32", "bfloat16")
    assert out["agree"] is True
    assert out["log_line"] + out["v1_models"] == [out["log_line"][0]] * 4


def test_the_start_up_line_is_parsed() -> None:
    match = dtype_agreement.LINE.search("kvtoll worker: smollm2 (bfloat16) on http://h:1")
    assert match is not None and match.group("dtype") == "bfloat16"
