"""One KV block as bytes: header, payload, checksum (the tier's wire and disk format).

::

    b"KVT1" | mode u8 | dtype u8 | layers u16 | block u16 | heads u16 | dim u16
          | key digest (16 B) | [scales: float32 x layers x 2, int8 mode only]
          | payload (layers x 2 x block x heads x dim elements) | blake2b-16 of all before

``mode``: ``raw`` keeps the KV dtype as is (exact); ``int8`` stores one symmetric
scale per (layer, K or V) of the block and int8 values (half of bf16's bytes, a
quarter of float32's). The key digest binds the bytes to (model, tenant salt, block
hash): a block copied under another tenant's or model's key fails :func:`decode`.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv.hashing import BlockHash, TenantSalt

MAGIC = b"KVT1"
_HEADER = struct.Struct("<4sBBHHHH16s")
_DIGEST = 16
# int8: a CPU engine's int8 KV cache (engine.kernels.kv_int8), rows that carry their own
# scales; its blocks are always stored raw (they are int8 already).
_DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int8: 4,
}  # fmt: skip
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


class TierMode(enum.Enum):
    RAW = "raw"
    INT8 = "int8"


class CorruptBlock(ValueError):
    """The bytes are not a valid block for the key they were looked up under."""


@dataclass(frozen=True)
class BlockKey:
    """Where a block lives in the tier: model, tenant salt (None: no tenant) and hash."""

    model: str
    salt: TenantSalt | None
    block_hash: BlockHash

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=_DIGEST, person=b"kvtoll-kvtier")
        for part in (self.model.encode(), self.salt or b"", self.block_hash):
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        return h.digest()

    def redis_key(self, prefix: str) -> str:
        """``<prefix>:<model>:<salt hex or ->:<hash hex>``."""
        salt = self.salt.hex() if self.salt else "-"
        return f"{prefix}:{self.model}:{salt}:{self.block_hash.hex()}"


def encode(key: BlockKey, kv: torch.Tensor, mode: TierMode) -> bytes:
    """``kv``: one block, ``[layers, 2, block, heads, dim]`` on the CPU."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"a block is [layers, 2, block, heads, dim], got {tuple(kv.shape)}")
    if kv.dtype not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {kv.dtype}")
    layers, _, block, heads, dim = kv.shape
    code = 0 if mode is TierMode.RAW or kv.dtype == torch.int8 else 1
    header = _HEADER.pack(MAGIC, code, _DTYPES[kv.dtype], layers, block, heads, dim, key.digest())
    parts: list[bytes | memoryview]
    if code == 0:
        parts = [header, _view(kv.contiguous())]
    else:
        flat = kv.float().reshape(layers * 2, -1)
        scales = (flat.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(flat / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        parts = [header, _view(scales), _view(q)]
    h = hashlib.blake2b(digest_size=_DIGEST)
    for part in parts:
        h.update(part)
    return b"".join([*parts, h.digest()])  # the one copy of the payload


def verify(key: BlockKey, data: bytes, shape: tuple[int, int, int, int]) -> tuple[int, int]:
    """Check ``data`` is an intact block of ``key`` and ``shape`` (layers, block, heads,
    dim); its (mode code, dtype code). :class:`CorruptBlock` if the checksum, the key,
    the shape or the length is wrong."""
    if len(data) < _HEADER.size + _DIGEST:
        raise CorruptBlock("too short")
    body, check = memoryview(data)[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != check:
        raise CorruptBlock("checksum mismatch")
    magic, code, dtype_code, layers, block, heads, dim, digest = _HEADER.unpack_from(body)
    if magic != MAGIC or digest != key.digest():
        raise CorruptBlock("not this key's block")
    if (layers, block, heads, dim) != shape or dtype_code not in _CODES or code not in (0, 1):
        raise CorruptBlock(f"shape {(layers, block, heads, dim)} is not {shape}")
    numel = layers * 2 * block * heads * dim
    elem = torch.tensor([], dtype=_CODES[dtype_code]).element_size()
    size = elem * numel if code == 0 else 4 * layers * 2 + numel
    if len(body) - _HEADER.size != size:
        raise CorruptBlock("payload of the wrong length")
    return code, dtype_code


def decode(key: BlockKey, data: bytes, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The block's ``[layers, 2, block, heads, dim]`` tensor (its stored dtype), after
    :func:`verify`."""
    code, dtype_code = verify(key, data, shape)
    layers, block, heads, dim = shape
    dtype = _CODES[dtype_code]
    payload = memoryview(data)[_HEADER.size : -_DIGEST]
    if code == 0:
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
    else:
        n_scales = layers * 2
        scales = torch.frombuffer(bytearray(payload[: 4 * n_scales]), dtype=torch.float32)
        q = torch.frombuffer(bytearray(payload[4 * n_scales :]), dtype=torch.int8)
        out = (q.view(n_scales, -1).float() * scales[:, None]).to(dtype)
    return out.view(layers, 2, block, heads, dim)


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)
