"""Chained block hashes for automatic prefix caching, shared by engine and router.

The one implementation of how a prompt's tokens become block hashes. The engine's
prefix cache and the proxy's prefix router both call :func:`hash_prompt_blocks`,
so a router prediction and an engine hit agree by construction.

::

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]      block_size = 16
              block 0     block 1     partial (never hashed, never shared)
    hash0 = H(ROOT,  tokens[0:16],  extra=salt)       salt: tenant, server-derived
    hash1 = H(hash0, tokens[16:32], extra=None)

Only the first block carries the salt; since every later hash chains through it,
two tenants can never share any block.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
TenantSalt = NewType("TenantSalt", bytes)

ROOT_HASH = BlockHash(b"\x00" * 16)
_DIGEST_SIZE = 16


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash and optional extra keys."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_keys:
        h.update(b"\x01")
        h.update(struct.pack("<I", len(extra_keys)))
        h.update(extra_keys)
    return BlockHash(h.digest())


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, salt: TenantSalt | None = None
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids``; the first block carries ``salt``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = salt if start == 0 else None
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def derive_tenant_salt(server_secret: bytes, tenant_id: int | str) -> TenantSalt:
    """Server-side salt for a tenant: HMAC of its id under the server secret.

    Clients never see or send it; a client field claiming a salt is ignored.
    """
    if not server_secret:
        raise ValueError("server secret must not be empty")
    mac = hmac.new(server_secret, f"kvtoll-prefix-salt:{tenant_id}".encode(), hashlib.sha256)
    return TenantSalt(mac.digest()[:16])
