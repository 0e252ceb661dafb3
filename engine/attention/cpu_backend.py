"""Paged attention for CPU engines: decode rows through the native AVX-512 kernel of
:mod:`engine.kernels.cpu_native_attention` where it can be built, else the AVX2 kernel of
:mod:`engine.kernels.cpu_decode_avx2` where that builds, else the numba kernel of
:mod:`engine.kernels.cpu_decode_attention` (all read K/V from the block pool in
place); prefill chunks through the native kernel where it measured faster than
torch's fused attention at start-up (:meth:`CpuAttentionBackend.prepare`), else as in
:class:`engine.attention.torch_backend.TorchAttentionBackend`, which also writes the KV
and serves caches that are neither float32 nor bfloat16. A bfloat16 model's queries
are widened to float32 for the kernels and their outputs rounded back. int8 caches
(:mod:`engine.kernels.kv_int8`) run in the native kernels alone, decode and prefill.
Where torch wins the start-up race, short chunks may still run natively (a short new
turn after a long cached conversation): the longest of :data:`SHORT_PREFILL_PROBES` that
the native kernel also won, raced after :data:`SHORT_PROBE_CACHED` cached tokens. Over
a bfloat16 cache, decode and prefill each run on the native kernels' bfloat16 dot
products where the library has them and they won their own start-up race against
float32 products (:mod:`engine.attention.cpu_probes`).

The torch path copies every decode row's context out of the pool at every layer and
step before attending to it; on a 64-request batch that copy and the attention after
it were ~45% of a decode step (profile of bench/engine_throughput.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.cpu_probes import (
    PREFILL_PROBE,
    decode_products_win,
    extend_amx_wins,
    extend_products_win,
    race,
    random_caches,
)
from engine.attention.decode_groups import DEFAULT_GROUP_COST
from engine.attention.torch_backend import PREFILL_TILE, TorchAttentionBackend, _PrefillChunk
from engine.kernels import native_build
from engine.kernels.cpu_decode_attention import (
    CACHE_DTYPES,
    CpuDecodeKernels,
    DecodeRows,
    cpu_paged_decode_attention,
    decode_rows_attention,
    plan_decode_rows,
)
from engine.kernels.cpu_decode_avx2 import avx2_decode_for
from engine.kernels.cpu_native_attention import (
    AMX_CACHES,
    AMX_HEAD_DIMS,
    ExtendChunk,
    NativeKernels,
    load_native_kernels,
    native_decode_rows,
    native_extend,
    plan_extend,
    supports,
)
from engine.kernels.kv_int8 import head_dim_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _StepDecode:
    """One step's decode rows as every layer runs them (built at the first layer)."""

    meta: AttentionMetadata
    dtype: torch.dtype  # of q: in place (float32, or the native kernels), else float32 copies
    rows: DecodeRows
    q_index: torch.Tensor  # [R] int64 rows of q / out that are decodes
    all_rows: bool  # every row of q is a decode (no gather or scatter needed)
    out32: torch.Tensor | None  # through copies: the kernel's float32 output [R, H, D]


# Where torch wins the start-up prefill race (PREFILL_PROBE), chunks of at most as many
# query rows as the longest of these that the native kernel also won (shortest first,
# after SHORT_PROBE_CACHED cached tokens) run natively: it reads the pool in place where
# torch gathers the context first. AMX Xeon, SmolLM2's shape, bfloat16, native time over
# torch's after 256 / 1,024 / 1,900 cached tokens: 0.59 / 0.61 / 0.59 at 4 query rows,
# 0.63 / 0.67 / 0.71 at 8, 0.86 / 0.93 / 0.86 at 16, 0.98 / 1.08 / 1.20 at 20, 1.23 /
# 1.31 / 1.18 at 32 (the probes stop at 16; the long context is where native gains
# least).
SHORT_PREFILL_PROBES = (4, 8, 16)
SHORT_PROBE_CACHED = 1024
NATIVE_DTYPES = (*CACHE_DTYPES, torch.int8)  # caches the native kernels read


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode (and, where faster, prefill) attention in CPU
    paged kernels (float32 and bfloat16 caches)."""

    name = "cpu"

    def __init__(
        self,
        group_cost: int = DEFAULT_GROUP_COST,
        prefill_tile: int = PREFILL_TILE,
        fused_bf16_prefill: bool | None = None,
        native: bool | None = None,
        native_prefill: bool | None = None,
        native_cache_dir: Path | None = None,
        native_prefill_max_q: int | None = None,
    ) -> None:
        """The first three as for the torch backend (they govern its prefill, and decode
        for caches the kernels do not take). ``native``: the native kernels (None: where
        they build here; True: required, prepare() raises otherwise; False: numba and
        torch only). ``native_prefill``: prefill through them too (None: if faster
        here, measured by prepare()). ``native_cache_dir``: where their library is
        built (default :func:`engine.kernels.native_build.default_cache_dir`).
        ``native_prefill_max_q``: where prefill runs in torch, chunks of at most this many
        query rows run natively all the same (None: raced by prepare() where
        ``native_prefill`` is None, else 0)."""
        if native_prefill_max_q is not None and native_prefill_max_q < 0:
            raise ValueError(f"native_prefill_max_q must be >= 0, got {native_prefill_max_q}")
        super().__init__(group_cost, prefill_tile, fused_bf16_prefill)
        self._kernels = CpuDecodeKernels()
        self._want_native = native
        self._want_native_prefill = native_prefill
        self._native_cache_dir = native_cache_dir
        self._native: NativeKernels | None = None  # set by prepare() when they run here
        self._native_prefill = False
        # dot products in the native kernels (raced by prepare() where they exist):
        # bfloat16 ones over a bfloat16 cache, decode's VNNI integer ones over an int8 one
        self._decode_products = False
        self._extend_products = False
        self._extend_amx = False  # bf16 / int8-cache prefill on the AMX tiles (raced too)
        self._want_native_max_q = native_prefill_max_q
        self._native_max_q = 0  # set by prepare() (where prefill runs in torch)
        # This step's decode rows, planned (and checked) at the first layer and reused
        # by the others (same metadata object): checking the block tables, building
        # index tensors and scratch at every layer were ~20% of decode attention
        # (1.6 of 8.1 s on bench/engine_throughput.py's 64 requests).
        self._step: _StepDecode | None = None
        # Likewise this step's prefill chunks for the native kernel, by first query row,
        # with the torch plan's chunk list they were made for.
        self._extend: tuple[list[_PrefillChunk], dict[int, ExtendChunk]] | None = None

    @property
    def kernels(self) -> CpuDecodeKernels:
        """The compiled numba decode kernels (used where the native ones are not)."""
        return self._kernels

    @property
    def native(self) -> NativeKernels | None:
        """The native kernels, once prepare() found they run here (else None)."""
        return self._native

    @property
    def native_prefill(self) -> bool:
        """Whether prefill chunks run in the native kernel (decided by prepare())."""
        return self._native_prefill

    @property
    def bf16_products(self) -> tuple[bool, bool]:
        """Whether decode and prefill over a bfloat16 cache run on the native kernels'
        bfloat16 dot products (decided by prepare(): where the library has them and
        they measured faster here than float32 products); over an int8 cache, the first
        says whether decode runs on VNNI integer products (raced the same way)."""
        return self._decode_products, self._extend_products

    @property
    def extend_amx(self) -> bool:
        """Whether native prefill over a bfloat16 or int8 cache runs on the AMX tiles (decided by
        prepare(): where the library and the process have them and they measured faster
        here than the AVX-512 path)."""
        return self._extend_amx

    @property
    def native_prefill_max_q(self) -> int:
        """Where prefill runs in torch, the longest chunk (query rows) that runs in the
        native kernel all the same (decided by prepare(); 0: none)."""
        return self._native_max_q

    def prepare(self, num_heads: int, k_cache: torch.Tensor) -> None:
        """Build or load the kernels for this shape before the first step: the native
        library (first time on a machine ~8 s, then loaded from its cache directory)
        and its launchers, else the numba decode kernels (first time seconds, then from
        numba's disk cache); and decide where prefill runs."""
        int8 = k_cache.dtype == torch.int8
        if k_cache.dtype not in CACHE_DTYPES and not int8:
            return
        _, block_size, num_kv_heads, width = k_cache.shape
        head_dim = head_dim_of(k_cache)
        if int8 and self._want_native is False:
            raise RuntimeError("an int8 KV cache needs the native CPU attention kernels")
        if self._want_native is not False:
            self._native = self._load_native(num_heads, num_kv_heads, head_dim, required=int8)
        cache = torch.zeros((1, block_size, num_kv_heads, width), dtype=k_cache.dtype)
        q = torch.zeros((1, num_heads, head_dim))
        table = torch.zeros((1, 1), dtype=torch.int32)
        if self._native is None:
            if self._want_native is not False:  # numba's decode stages, or the AVX2 kernel
                avx2 = avx2_decode_for(num_heads // num_kv_heads, head_dim,
                                       self._native_cache_dir)  # fmt: skip
                self._kernels = CpuDecodeKernels(avx2=avx2)
            cpu_paged_decode_attention(q, cache, cache.clone(), table,
                                       torch.ones(1, dtype=torch.int32), 1.0,
                                       kernels=self._kernels)  # fmt: skip
            return
        rows = plan_decode_rows(1, num_heads, 1, block_size, table,
                                torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                                torch.zeros(1, dtype=torch.int64), scratch=False)  # fmt: skip
        native_decode_rows(self._native, rows, q, cache, cache.clone(), 1.0, torch.empty_like(q))
        if self._want_native_prefill is not False or int8 or self._want_native_max_q:
            # its launcher too, before any request
            chunk = plan_extend(table[0], 1, 1, 1, block_size)
            native_extend(self._native, chunk, q, cache, cache.clone(), 1.0, torch.empty_like(q))
        if k_cache.dtype == torch.bfloat16 and self._native.bf16_products:
            self._decode_products = decode_products_win(self._native, num_heads, k_cache)
            self._extend_products = extend_products_win(self._native, num_heads, k_cache)
        if int8 and self._native.int8_products and head_dim % 32 == 0:
            self._decode_products = decode_products_win(self._native, num_heads, k_cache)
        if (self._native.extend_amx and k_cache.dtype in AMX_CACHES
                and head_dim in AMX_HEAD_DIMS):  # fmt: skip
            self._extend_amx = extend_amx_wins(self._native, num_heads, k_cache,
                                               self._extend_products)  # fmt: skip
        if int8:  # torch has no int8 attention path here
            self._native_prefill = True
        elif self._want_native_prefill is None:
            self._native_prefill = self._native_wins(num_heads, k_cache, *PREFILL_PROBE)
        else:
            self._native_prefill = self._want_native_prefill
        if not self._native_prefill:
            self._native_max_q = self._short_native_limit(num_heads, k_cache)
        log.info("cpu attention: native decode kernels; prefill in %s; dot "
                 "products: decode %s, prefill %s; prefill on AMX tiles: %s",
                 "the native kernel" if self._native_prefill else
                 f"torch (chunks of up to {self._native_max_q} queries natively)",
                 self._decode_products, self._extend_products, self._extend_amx)  # fmt: skip

    def _load_native(
        self, num_heads: int, num_kv_heads: int, head_dim: int, required: bool = False
    ) -> NativeKernels | None:
        reason = native_build.unavailable_reason()
        if reason is None and not supports(num_heads, num_kv_heads, head_dim):
            reason = (f"they are not built for {num_heads} heads over {num_kv_heads} KV "
                      f"heads of head_dim {head_dim}")  # fmt: skip
        if reason is None:
            try:
                cache_dir = self._native_cache_dir or native_build.default_cache_dir()
                return load_native_kernels(cache_dir)
            except (RuntimeError, OSError) as exc:  # no home, a read-only cache, a failed build
                reason = str(exc)
        if self._want_native or required:
            raise RuntimeError(f"native CPU attention kernels unavailable: {reason}"
                               + (" (an int8 KV cache needs them)" if required else ""))
        log.warning("cpu attention: native kernels unavailable (%s); numba decode kernels", reason)
        return None

    def _short_native_limit(self, num_heads: int, k_cache: torch.Tensor) -> int:
        """Where prefill runs in torch, the longest chunk to run natively all the same:
        the one given, else (prefill left to the race) the longest of
        :data:`SHORT_PREFILL_PROBES` the native kernel wins with every shorter one, after
        :data:`SHORT_PROBE_CACHED` cached tokens; 0 if none or prefill forced to torch."""
        if self._want_native_max_q is not None:
            return self._want_native_max_q
        if self._want_native_prefill is not None:
            return 0
        limit = 0
        for q_len in SHORT_PREFILL_PROBES:
            if not self._native_wins(num_heads, k_cache, q_len, SHORT_PROBE_CACHED):
                break
            limit = q_len
        return limit

    def _native_wins(self, num_heads: int, k_cache: torch.Tensor, q_len: int, cached: int) -> bool:
        """Race the native prefill kernel against torch's fused attention on a probe
        chunk of this model's shape, ``q_len`` query rows after ``cached`` tokens
        (interleaved, best of a few each; ~10 ms at 64 rows)."""
        assert self._native is not None
        _, block_size, _, head_dim = k_cache.shape
        seq_len = q_len + cached
        blocks = -(-seq_len // block_size)
        gen = torch.Generator().manual_seed(0)
        kc, vc = random_caches(blocks, k_cache, k_cache.dtype, gen)
        # queries of the model's dtype, as a step's are (bfloat16 ones take the native
        # kernel's dot-product path where it has one)
        q = torch.randn((q_len, num_heads, head_dim), generator=gen).to(k_cache.dtype).float()
        table = torch.arange(blocks, dtype=torch.int32)
        meta = AttentionMetadata(
            torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
            table.unsqueeze(0), torch.zeros(q_len, dtype=torch.int64), q_len, seq_len,
            (q_len,), (seq_len,),
        )  # fmt: skip
        chunk = self._prefill_plan(meta, [0, q_len], block_size, q.to(k_cache.dtype))[0]
        self._prefill = None  # a probe, not a step
        native_chunk = plan_extend(table, seq_len, q_len, blocks, block_size)
        qd, out = q.to(k_cache.dtype), torch.empty_like(q)
        native, products = self._native, self._extend_products
        best = race(f"prefill ({q_len} queries after {cached})", {
            "native": lambda: native_extend(native, native_chunk, q, kc, vc, 0.125, out,
                                            bf16_products=products, amx=self._extend_amx),
            "torch": lambda: super(CpuAttentionBackend, self)._prefill_one(qd, kc, vc, chunk,
                                                                           0.125),
        })  # fmt: skip
        return best["native"] <= best["torch"]

    def _prefill_into(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: _PrefillChunk,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        native = self._native_prefill or chunk.end - chunk.start <= self._native_max_q
        if not native or self._native is None or k_cache.dtype not in NATIVE_DTYPES:
            super()._prefill_into(q, k_cache, v_cache, chunk, scale, out)
            return
        # q (a view into the step's q/k/v projection) read and out written in place
        native_extend(self._native, self._extend_plan(chunk, k_cache), q, k_cache, v_cache,
                      scale, out, bf16_products=self._extend_products,
                      amx=self._extend_amx)  # fmt: skip

    def _extend_plan(self, chunk: _PrefillChunk, k_cache: torch.Tensor) -> ExtendChunk:
        """The native plan of ``chunk``, made at the step's first layer (the torch
        backend plans the step's chunks once; this keys on that plan's list)."""
        assert self._prefill is not None  # forward() planned this step's chunks
        step_chunks = self._prefill[3]
        if self._extend is None or self._extend[0] is not step_chunks:
            self._extend = (step_chunks, {})
        plans = self._extend[1]
        plan = plans.get(chunk.start)
        if plan is None:
            q_len, (num_blocks, block_size) = chunk.end - chunk.start, k_cache.shape[:2]
            plan = plan_extend(chunk.table.to(torch.int32), chunk.seq_len, q_len, num_blocks,
                               block_size)  # fmt: skip
            plans[chunk.start] = plan
        return plan

    def _decode_rows(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        qsl: list[int],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        if q.dtype not in CACHE_DTYPES or (
            k_cache.dtype not in CACHE_DTYPES
            and (k_cache.dtype != torch.int8 or self._native is None)
        ):
            super()._decode_rows(q, k_cache, v_cache, meta, qsl, scale, out)
            return
        step = self._step_decode(q, k_cache, meta, qsl)
        if not step.rows.num_rows:
            return
        if self._native is not None:  # q read and out written in place, either dtype
            native_decode_rows(self._native, step.rows, q, k_cache, v_cache, scale, out,
                               bf16_products=self._decode_products,
                               int8_products=self._decode_products)  # fmt: skip
            return
        if q.dtype == torch.float32:  # numba: float32 in place
            decode_rows_attention(step.rows, q.contiguous(), k_cache, v_cache, scale, out,
                                  kernels=self._kernels)  # fmt: skip
            return
        assert step.out32 is not None  # numba, bfloat16: through float32 copies
        q32 = q.float() if step.all_rows else q.index_select(0, step.q_index).float()
        decode_rows_attention(step.rows, q32, k_cache, v_cache, scale, step.out32,
                              kernels=self._kernels)  # fmt: skip
        if step.all_rows:
            out.copy_(step.out32)
        else:
            out.index_copy_(0, step.q_index, step.out32.to(out.dtype))

    def _step_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, qsl: list[int]
    ) -> _StepDecode:
        step = self._step
        if step is not None and step.meta is meta and step.dtype == q.dtype:
            return step
        decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        q_index = torch.tensor([qsl[i] for i in decodes], dtype=torch.int64)
        seq_ids = torch.tensor(decodes, dtype=torch.int64)
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        scratch = self._native is None
        if q.dtype == torch.float32 or not scratch:  # the kernel reads q, writes out in place
            rows = plan_decode_rows(q.shape[0], q.shape[1], num_blocks, block_size,
                                    meta.block_tables, meta.seq_lens, q_index, seq_ids,
                                    scratch)  # fmt: skip
            out32 = None
        else:  # it reads a float32 copy of the decode rows alone
            r = len(decodes)
            own_rows = torch.arange(r, dtype=torch.int64)
            rows = plan_decode_rows(r, q.shape[1], num_blocks, block_size, meta.block_tables,
                                    meta.seq_lens, own_rows, seq_ids, scratch)  # fmt: skip
            out32 = torch.empty((r, q.shape[1], q.shape[2]), dtype=torch.float32)
        self._step = _StepDecode(
            meta, q.dtype, rows, q_index, len(decodes) == q.shape[0], out32
        )
        return self._step
