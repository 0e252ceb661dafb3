"""Compile the Triton kernels for a CUDA GPU on a machine without one (a developer check).

The interpreter runs the kernels' maths on CPU but accepts code that a GPU build
rejects and says nothing of what the build costs. This module drives the real public
launch functions with small CPU stand-in tensors while Triton's active driver is a
:class:`CompileOnlyDriver` for the chosen target: each launch is specialised exactly as
on a GPU (dtypes, 16-byte alignment and divisibility of every integer argument, all
constexprs), compiled to PTX and a cubin by Triton's own toolchain (its bundled
``ptxas``), and skipped instead of run::

    launcher(cpu stand-ins) --Triton binder--> signature + constexprs + attrs
        --jit_cache_hook--> triton.compile(target=sm_XX) -> KernelBuild (cubin, PTX)
                         \\-> launch skipped (the hook says "handled")

The stand-ins carry the real model's head counts, head_dim and block size, so strides
(and their specialisation) are those of the engine. :func:`build_report` reads what
each build costs from its cubin and PTX: registers, stack frame, local-memory
(spill) instructions, shared memory, and how wide the global loads are.

Needs Triton >= 3.4 (``triton.knobs``) with its NVIDIA backend; nothing is launched,
so no CUDA driver or GPU is used. Run it where ``TRITON_INTERPRET`` is unset: under
the interpreter the kernels are not compilable objects.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

# Modules whose launchers check their tensors' device with check_device; under the
# compile-only driver the stand-ins are CPU tensors, so the check is lifted there.
KERNEL_MODULES = (
    "engine.kernels.decode_attention",
    "engine.kernels.extend_attention",
    "engine.kernels.kv_write",
)
# An async global -> shared copy and its size operand (4, 8 or 16 bytes per thread).
CP_ASYNC = r"cp\.async\.(c[ag])\.shared\.global\S*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)"
# A local-memory load or store in SASS (spilled registers, or arrays kept in memory).
LOCAL_OP = r"\b(?:LDL|STL)(?:\.\w+)*\s"
# Largest shared memory one program may use (opt-in limit), by compute capability.
MAX_SHARED_BYTES = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}


@dataclass(frozen=True)
class KernelBuild:
    """One compiled specialisation of a kernel."""

    name: str
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    shared_bytes: int
    cubin: bytes
    ptx: str


@dataclass(frozen=True)
class KernelReport:
    """What one build costs on the GPU (from its cubin and PTX)."""

    name: str
    label: str  # which launch produced it (model shape, dtype, ...)
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    registers: int
    stack_bytes: int
    local_memory_ops: int  # LDL/STL in the SASS: spills or arrays the compiler put in memory
    loop_local_memory_ops: int  # of those, the ones inside a loop body (these cost time)
    shared_bytes: int
    global_loads: dict[str, int] = field(default_factory=dict)  # ld.global and cp.async forms
    matrix_ops: dict[str, int] = field(default_factory=dict)  # HGMMA (wgmma) / HMMA in SASS

    @property
    def widest_load_bytes(self) -> int:
        """Widest global (or async-copy) load in the PTX, in bytes."""
        return max((_load_bytes(form) for form in self.global_loads), default=0)


class CompileOnlyDriver:
    """A Triton driver that names a GPU target but has no device: kernels compile for
    ``target`` and the cache hook of :func:`compiling_for` keeps them from launching."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> str:
        # The key of each kernel's per-device cache: distinct from any real device.
        return f"compile-only:{self.target.backend}:{self.target.arch}"

    def get_current_stream(self, device: object = None) -> int:
        return 0


def cuda_target(arch: int) -> Any:
    """Triton's target for compute capability ``arch`` (90 = Hopper, 80 = Ampere)."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def unavailable_reason() -> str | None:
    """Why this Triton cannot compile for CUDA here, or None when it can."""
    try:
        import triton
        from triton import knobs
    except ImportError as exc:
        return f"triton is not importable: {exc}"
    if not hasattr(knobs, "runtime") or not hasattr(knobs.runtime, "jit_cache_hook"):
        return f"triton {triton.__version__} has no knobs.runtime.jit_cache_hook (need >= 3.4)"
    try:
        knobs.nvidia.ptxas.path  # noqa: B018  # raises when the NVIDIA toolchain is absent
        knobs.nvidia.cuobjdump.path  # noqa: B018
    except (AttributeError, RuntimeError) as exc:
        return f"triton's NVIDIA tools are missing: {exc}"
    from engine.kernels.decode_attention import _decode_split_kernel
    from engine.kernels.launch import runs_interpreted

    if runs_interpreted(_decode_split_kernel):
        return "TRITON_INTERPRET is set: the kernels were built for the interpreter"
    return None


@contextmanager
def compiling_for(arch: int) -> Iterator[list[KernelBuild]]:
    """Inside, kernel launches compile for ``arch`` and return without running; the
    builds collect in the yielded list. Triton's driver and hook are restored after."""
    import importlib

    import triton
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.runtime.driver import driver

    target = cuda_target(arch)
    builds: list[KernelBuild] = []

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        jit_fn = fn.jit_function
        src = ASTSource(jit_fn, compile["signature"], compile["constants"],
                        compile["configs"][0])  # fmt: skip
        options = {"num_warps": compile["num_warps"], "num_stages": compile["num_stages"],
                   "num_ctas": compile["num_ctas"]}  # fmt: skip
        kernel = triton.compile(src, target=target, options=options)
        names = jit_fn.arg_names
        constants = {names[k[0]]: v for k, v in compile["constants"].items() if len(k) == 1}
        builds.append(KernelBuild(
            name=jit_fn.__name__, constants=constants, num_warps=kernel.metadata.num_warps,
            num_stages=kernel.metadata.num_stages, shared_bytes=kernel.metadata.shared,
            cubin=kernel.asm["cubin"], ptx=kernel.asm["ptx"],
        ))  # fmt: skip
        return True  # handled: Triton neither compiles again nor launches

    previous_hook = knobs.runtime.jit_cache_hook
    # None until something first asked for the default driver, which needs a GPU to build.
    previous_driver = driver._active
    with ExitStack() as stack:
        for name in KERNEL_MODULES:
            module = importlib.import_module(name)
            stack.enter_context(mock.patch.object(module, "check_device", _same_device))
        driver.set_active(CompileOnlyDriver(target))
        knobs.runtime.jit_cache_hook = hook
        try:
            yield builds
        finally:
            knobs.runtime.jit_cache_hook = previous_hook
            driver.set_active(previous_driver)  # None: unset again


def _same_device(kernel: object, *tensors: torch.Tensor) -> None:
    """check_device's first half, kept under the compile-only driver: one device."""
    if len({t.device for t in tensors}) != 1:
        raise ValueError("tensors on several devices")


def build_report(build: KernelBuild, label: str) -> KernelReport:
    """Registers, stack, spills, shared memory and load widths of ``build``."""
    usage = _cuobjdump(build.cubin, "-res-usage")
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {build.name}: {usage!r}")
    sass = _cuobjdump(build.cubin, "-sass")
    local_ops = len(re.findall(LOCAL_OP, sass))
    matrix = Counter(re.findall(r"\b(HGMMA|HMMA)\.", sass))
    loads = Counter(re.findall(r"\bld\.global[\w.:]*", build.ptx))
    for kind, size in re.findall(CP_ASYNC, build.ptx):
        loads[f"cp.async.{kind}.{int(size, 0)}B"] += 1
    return KernelReport(
        name=build.name, label=label, constants=build.constants, num_warps=build.num_warps,
        num_stages=build.num_stages, registers=int(match.group(1)),
        stack_bytes=int(match.group(2)), local_memory_ops=local_ops,
        loop_local_memory_ops=loop_local_ops(sass),
        shared_bytes=build.shared_bytes, global_loads=dict(loads), matrix_ops=dict(matrix),
    )  # fmt: skip


def loop_local_ops(sass: str) -> int:
    """LDL/STL instructions of ``sass`` that lie inside a loop: between a backward
    branch and its target. A value spilled once before a loop and reloaded after it
    costs two memory operations per program; one spilled inside costs them per tile."""
    loops: list[tuple[int, int]] = []
    local: list[int] = []
    for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        at = int(address, 16)
        branch = re.search(r"\bBRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < at:
            loops.append((int(branch.group(1), 16), at))
        if re.search(LOCAL_OP, text + " "):
            local.append(at)
    return sum(any(lo <= at <= hi for lo, hi in loops) for at in local)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([knobs.nvidia.cuobjdump.path, flag, f.name], capture_output=True,
                              text=True, check=True)  # fmt: skip
    return done.stdout


def _load_bytes(form: str) -> int:
    """Bytes moved per thread by one load form (``ld.global.v4.b32`` -> 16, and
    ``cp.async.cg.16B``, this module's name for a 16-byte async copy, -> 16)."""
    if form.startswith("cp.async."):
        return int(form.rsplit(".", 1)[1].removesuffix("B"))
    width = re.search(r"\.(?:b|u|s|f)(\d+)$", form)
    vector = re.search(r"\.v(\d)\.", form)
    bits = int(width.group(1)) if width else 8
    return bits // 8 * (int(vector.group(1)) if vector else 1)


@dataclass(frozen=True)
class LaunchShape:
    """The head layout, dtype and block size one set of launches uses."""

    label: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16


# The engine's bundled model (SmolLM2-135M) and the benchmark's (Llama-3-8B attention).
SMOLLM2 = (9, 3, 64)
LLAMA3_8B = (32, 8, 128)


def default_shapes() -> list[LaunchShape]:
    """Both head layouts in every dtype at block 16, plus blocks 8 and 32 in bf16."""
    shapes = []
    for name, (heads, kv_heads, head_dim) in (("smollm2", SMOLLM2), ("llama3-8b", LLAMA3_8B)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            label = f"{name} {str(dtype).removeprefix('torch.')}"
            shapes.append(LaunchShape(label, heads, kv_heads, head_dim, dtype))
    for block_size in (8, 32):
        shapes.append(LaunchShape(f"llama3-8b bfloat16 block {block_size}", *LLAMA3_8B,
                                  torch.bfloat16, block_size))  # fmt: skip
    return shapes


def launch_all(shape: LaunchShape, int8: bool) -> None:
    """Call every public kernel function once with stand-ins of ``shape``."""
    from engine.kernels.decode_attention import paged_decode_attention
    from engine.kernels.extend_attention import extend_attention
    from engine.kernels.kv_write import write_kv
    from engine.kernels.launch import KVScales

    h, hkv, d, bs, dt = (shape.num_heads, shape.num_kv_heads, shape.head_dim,
                         shape.block_size, shape.dtype)  # fmt: skip
    num_seqs, new_tokens, blocks_per_seq = 2, 8, 64
    context = blocks_per_seq * bs
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * new_tokens
    tokens = num_seqs * new_tokens
    q = torch.zeros(tokens, h, d, dtype=dt)
    k = torch.zeros(tokens, hkv, d, dtype=dt)
    slots = torch.arange(tokens, dtype=torch.int64)
    scale = d**-0.5
    if int8:
        k8 = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.int8)
        v8 = torch.zeros_like(k8)
        scales = KVScales(torch.ones(num_blocks, bs, hkv), torch.ones(num_blocks, bs, hkv))
        paged_decode_attention(q[:num_seqs], k8, v8, tables, seq_lens, scale,
                               max_seq_len=context, kv_scales=scales)  # fmt: skip
        extend_attention(q, k8, v8, qsl, seq_lens, tables, scale, max_query_len=new_tokens,
                         kv_scales=scales)  # fmt: skip
        return
    write_kv(k, k, k_cache, v_cache, slots)
    paged_decode_attention(q[:num_seqs], k_cache, v_cache, tables, seq_lens, scale,
                           max_seq_len=context)  # fmt: skip
    extend_attention(q, k_cache, v_cache, qsl, seq_lens, tables, scale, max_query_len=new_tokens)


def compile_reports(
    arch: int, shapes: list[LaunchShape], int8_labels: tuple[str, ...] = (),
    progress: Callable[[str], None] | None = None,
) -> list[KernelReport]:  # fmt: skip
    """Compile every kernel for ``arch`` at each shape; int8-cache kernels too for the
    shapes whose label is in ``int8_labels``."""
    reports: list[KernelReport] = []
    for shape in shapes:
        for int8 in (False, True) if shape.label in int8_labels else (False,):
            label = f"{shape.label}{' int8 cache' if int8 else ''}"
            if progress:
                progress(f"sm_{arch} {label}")
            with compiling_for(arch) as builds:
                launch_all(shape, int8)
            reports.extend(build_report(b, label) for b in builds)
    return reports
