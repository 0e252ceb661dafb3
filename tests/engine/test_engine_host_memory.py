"""keep_tensor_memory: tensor-sized blocks come from the heap, not fresh mappings."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.host_memory import keep_tensor_memory

# A fresh process mallocs 1.2 MiB (an RMSNorm temporary of a prefill chunk) and prints
# how much of it is usable: glibc gives an mmapped chunk whole pages (usable size =
# page-rounded size - 16), a heap chunk 16-byte granules (request rounded up + 8).
SCRIPT = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    from engine.host_memory import keep_tensor_memory
    assert keep_tensor_memory()
p = libc.malloc(1_200_000)
print(libc.malloc_usable_size(p))
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)


def _usable_size(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip())


@glibc
def test_tensor_sized_blocks_come_from_the_heap_instead_of_fresh_mappings() -> None:
    assert _usable_size("default") == 1_200_128 - 16  # its own mmap: pages, page faults
    assert _usable_size("tuned") == 1_200_008  # the heap: freed memory is reused


@glibc
def test_reports_success_on_glibc() -> None:
    assert keep_tensor_memory() is True


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text.split("[")[1].split("]")[0]


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


linux_thp = pytest.mark.skipif(
    platform.system() != "Linux" or _thp_mode() not in ("madvise", "always"),
    reason="needs Linux with transparent huge pages on madvise or always",
)


@linux_thp
def test_advised_memory_faults_in_huge_pages() -> None:
    """Fresh mappings of the same size, one advised before its first touch: only the
    advised one ends up on huge pages (under "madvise"; both may under "always"). 48 MiB
    each: above glibc's largest mmap threshold, so fresh even where keep_tensor_memory
    ran in this process (smaller blocks may come from the heap, already touched)."""
    import torch

    from engine.host_memory import HUGE_PAGE_BYTES, advise_huge_pages

    plain = torch.empty(24 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    advised = torch.empty(24 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    assert advise_huge_pages(advised.data_ptr(), advised.numel())
    plain.fill_(1)
    advised.fill_(1)
    assert _huge_kib(advised.data_ptr() + 12 * HUGE_PAGE_BYTES) >= 4 * HUGE_PAGE_BYTES // 1024
    if _thp_mode() == "madvise":
        assert _huge_kib(plain.data_ptr() + 12 * HUGE_PAGE_BYTES) == 0


def test_a_region_without_a_whole_huge_page_is_not_advised() -> None:
    from engine.host_memory import HUGE_PAGE_BYTES, advise_huge_pages

    assert not advise_huge_pages(HUGE_PAGE_BYTES + 4096, HUGE_PAGE_BYTES)
    assert not advise_huge_pages(0, 0)


@linux_thp
def test_the_runners_kv_caches_sit_on_huge_pages() -> None:
    from engine.config import EngineConfig
    from engine.factory import build_llm_engine

    engine = build_llm_engine(EngineConfig.tiny(num_kv_blocks=8192))
    k, v = engine.runner.kv_caches[0]
    assert k.numel() * k.element_size() >= 4 * (2 << 20)
    assert bool((k == 0).all()) and bool((v == 0).all())
    assert _huge_kib(k.data_ptr() + k.numel() * k.element_size() // 2) > 0


def test_only_caches_that_may_reuse_heap_pages_are_collapsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below glibc's mmap threshold a cache may come from the heap, its pages already
    touched small: collapse them. At or above it the cache is a fresh mapping, faulting
    in huge as it is zeroed: collapsing first only made the kernel populate it (slower)."""
    import torch

    from engine import runner
    from engine.host_memory import MMAP_THRESHOLD_BYTES

    asked: list[tuple[int, bool]] = []
    def advise(address: int, nbytes: int, collapse: bool) -> None:
        asked.append((nbytes, collapse))

    monkeypatch.setattr(runner, "advise_huge_pages", advise)
    for nbytes in (MMAP_THRESHOLD_BYTES // 2, MMAP_THRESHOLD_BYTES, 2 * MMAP_THRESHOLD_BYTES):
        cache = runner._zeroed_cache((nbytes // 4,), torch.float32, "cpu")
        assert bool((cache == 0).all())
    assert asked == [(MMAP_THRESHOLD_BYTES // 2, True), (MMAP_THRESHOLD_BYTES, False),
                     (2 * MMAP_THRESHOLD_BYTES, False)]  # fmt: skip
