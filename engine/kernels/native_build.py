"""Build and load the native CPU kernels: attention (``native/cpu_attention.cpp``), the
decoder's fused small ops (``native/cpu_fused.cpp``, :mod:`engine.kernels.cpu_fused`) and
bfloat16 linear layers (``native/cpu_gemm.cpp``, :mod:`engine.kernels.cpu_gemm`).

A source is compiled on first use with the machine's C++ compiler for the machine
itself (``-O3 -march=native``) into a shared library in a cache directory (default
``$XDG_CACHE_HOME/kvtoll/kernels``, else ``~/.cache/kvtoll/kernels``), named by a hash
of the source, the flags, the compiler's version and the CPU's feature flags, so a
changed source or another machine builds anew (the attention library ~30 s) and an
unchanged one loads at once. Builders of one library take turns (a lock file beside
it): the first compiles into a temporary file and renames it into place, the others
then find it.

They need x86-64 with AVX-512 (``avx512f``) and a compiler (``c++``/``g++``, or
``$CXX``); :func:`unavailable_reason` says why not, and the CPU backend then keeps its
numba decode kernel and torch prefill.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtoll.cpu_info import cpu_flags

SOURCE = Path(__file__).with_name("native") / "cpu_attention.cpp"
FUSED_SOURCE = SOURCE.with_name("cpu_fused.cpp")
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
             "-Wno-maybe-uninitialized")  # fmt: skip
# The fused ops round where eager torch rounds: no a*b+c contracted into one FMA; they
# split big calls over torch's OpenMP threads (cpu_fused.cpp).
FUSED_FLAGS = ("-fopenmp", "-ffp-contract=off")
# The attention launchers run their items on OpenMP threads: torch's own runtime, since
# the library's libgomp.so.1 resolves to the copy torch has loaded (cpu_attention.cpp).
ATTENTION_FLAGS = ("-fopenmp",)
GEMM_FLAGS = ("-fopenmp", "-ffp-contract=off")  # its SiLU epilogue rounds as torch does
REQUIRED_CPU_FLAGS = frozenset({"avx512f"})
AVX2_CPU_FLAGS = frozenset({"avx2", "fma"})  # native/cpu_decode_avx2.cpp's
log = logging.getLogger(__name__)
HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the library is built for
MAX_GROUP = 8  # query heads per KV head it is built for: 1 .. MAX_GROUP


def default_cache_dir() -> Path:
    """Where built libraries are kept unless a caller says otherwise."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "kvtoll" / "kernels"


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``c++`` or ``g++`` on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return name
    return None


def unavailable_reason(
    flags: frozenset[str] | None = None, required: frozenset[str] = REQUIRED_CPU_FLAGS
) -> str | None:
    """None if the kernels can be built here, else why not; ``flags``: the CPU's
    (default :func:`kvtoll.cpu_info.cpu_flags`); ``required``: the flags the source needs
    (the AVX-512 kernels', or :data:`AVX2_CPU_FLAGS` for ``native/cpu_decode_avx2.cpp``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the native kernels are x86-64 SIMD code (this is {platform.machine()})"
    missing = required - (cpu_flags() if flags is None else flags)
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if compiler() is None:
        return "no C++ compiler (c++, g++ or $CXX) on PATH"
    return None


@dataclass(frozen=True)
class NativeLibrary:
    """The loaded library and its launchers (ctypes functions: every decode row of a
    step, every work item of a prefill chunk), by cache dtype: float32, bfloat16, and
    int8 rows with their scales (:mod:`engine.kernels.kv_int8`)."""

    path: Path  # the shared library
    decode_f32: Callable[..., int]
    decode_bf16: Callable[..., int]
    extend_f32: Callable[..., int]
    extend_bf16: Callable[..., int]
    decode_int8: Callable[..., int]
    extend_int8: Callable[..., int]
    bf16_products: bool  # built with the bfloat16 dot-product paths (AVX512-BF16)
    extend_amx: bool = False  # prefill may run on the AMX tiles (built and granted)
    int8_products: bool = False  # decode over an int8 cache on VNNI integer products


def _key(cxx: str, source: Path, flags: tuple[str, ...]) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    digest = hashlib.sha256()
    # the headers beside the source (the kernels' shared helpers) are part of the build
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(),
                 version.stdout.encode(), " ".join(sorted(cpu_flags())).encode()):  # fmt: skip
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build(
    cache_dir: Path,
    source: Path = SOURCE,
    extra_flags: tuple[str, ...] = (),
    required: frozenset[str] = REQUIRED_CPU_FLAGS,
) -> Path:
    """The library of ``source`` for this compiler and CPU in ``cache_dir``, compiled if
    absent; RuntimeError (with the compiler's message) if it cannot be built (``required``:
    the CPU flags the source needs)."""
    reason = unavailable_reason(required=required)
    if reason is not None:
        raise RuntimeError(reason)
    cxx = compiler()
    assert cxx is not None
    flags = (*CXX_FLAGS, *extra_flags)
    target = cache_dir / f"{source.stem}-{_key(cxx, source, flags)}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_suffix(".lock")):  # concurrent starts: one compiles
        if not target.exists():
            _compile(cxx, flags, source, target)
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (created if absent). Without it every process that
    started on a fresh cache at once compiled its own copy of the ~30 s attention
    library; one lock per library, so a builder of another library does not wait."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(cxx: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    """Compile ``source`` into ``target`` (aside, then renamed: a reader never sees half a
    library, and a failed build leaves nothing)."""
    cache_dir = target.parent
    log.info("compiling the native CPU kernels %s into %s (first use on this machine)",
             source.name, target)  # fmt: skip
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, "-o", tmp, str(source)], capture_output=True,
                              text=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"building {source.name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _entry(lib: ctypes.CDLL, name: str, extend: bool) -> Any:
    i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn = getattr(lib, name)
    if extend:  # head_dim, group, q, q_stride, q_bf16, q_len, k, v, table, offset,
        # block_size, hkv, scale, out, out_stride, out_bf16, tile, threads, products
        fn.argtypes = [i32, i32, ptr, i64, i32, i32, ptr, ptr, ptr, i32, i32, i32, f32, ptr,
                       i64, i32, i32, i32, i32]  # fmt: skip
    else:  # head_dim, group, q, q_stride, q_bf16, k, v, tables, table_stride, seq_lens,
        # q_rows, seq_ids, rows, block_size, hkv, scale, out, out_stride, out_bf16, threads,
        # products
        fn.argtypes = [i32, i32, ptr, i64, i32, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32,
                       i32, f32, ptr, i64, i32, i32, i32]  # fmt: skip
    fn.restype = i32
    return fn


@functools.cache
def load(cache_dir: Path) -> NativeLibrary:
    """Build (if needed) and load the library from ``cache_dir``. Memoised per process:
    the loaded library never changes, and loading it again would only add another
    handle to the same code."""
    path = build(cache_dir, extra_flags=ATTENTION_FLAGS)
    import torch  # noqa: F401  # its libgomp first, so that the library's resolves to it

    lib = ctypes.CDLL(str(path))
    return NativeLibrary(
        path,
        _entry(lib, "kvt_decode_rows_f32", extend=False),
        _entry(lib, "kvt_decode_rows_bf16", extend=False),
        _entry(lib, "kvt_extend_items_f32", extend=True),
        _entry(lib, "kvt_extend_items_bf16", extend=True),
        _entry(lib, "kvt_decode_rows_int8", extend=False),
        _entry(lib, "kvt_extend_items_int8", extend=True),
        bool(lib.kvt_bf16_products()),
        bool(lib.kvt_extend_amx()),  # asks the kernel for the tiles once
        bool(lib.kvt_int8_products()),
    )
