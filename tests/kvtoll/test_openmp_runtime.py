"""Finding the OpenMP runtime a library directory's code loaded (by path in the maps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtoll.openmp_runtime import RUNTIMES, loaded_runtime


def test_finds_torchs_own_runtime_and_nothing_elsewhere(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch build runs on no OpenMP runtime")
    lib = Path(torch.__file__).resolve().parent / "lib"
    found = loaded_runtime(lib)
    if found is None:
        pytest.skip("torch's OpenMP runtime is not one of its own files here")
    assert found.startswith(str(lib)) and Path(found).name.startswith(RUNTIMES)
    assert Path(found).exists()
    assert loaded_runtime(tmp_path) is None
