"""keep_tensor_memory: tensor-sized blocks come from the heap, not fresh mappings."""

from __future__ import annotations

import platform
import subprocess
import sys

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
