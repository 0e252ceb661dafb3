"""What each spawned child of test_engine_dtype_choice's concurrent-start test runs. A
module of its own: a spawned child imports the module its function lives in, and the
test module's imports (torch, the engine) cost ~3 s of CPU a child; this one's, 30 ms."""

from __future__ import annotations

import time
from pathlib import Path

from engine import dtype_probe


def probe_in_child(path: str, i: int) -> float:
    def measure() -> float:
        time.sleep(0.05)  # a probe takes a while: others must wait, not measure too
        return 1.0 + i / 100

    return dtype_probe.persisted_speedup("k", measure, Path(path)).bf16_speedup
