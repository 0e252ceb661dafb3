"""Block bytes: exact round trip (raw), bounded error (int8), every corruption caught."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_int8 import quantize_rows
from engine.kv.hashing import BlockHash, TenantSalt
from engine.kv.tier.codec import BlockKey, CorruptBlock, TierMode, decode, encode

SHAPE = (3, 4, 2, 8)  # layers, block, heads, dim
KEY = BlockKey("m/float32", TenantSalt(b"a" * 16), BlockHash(b"h" * 16))


def _block(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn((3, 2, 4, 2, 8), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_round_trip_is_exact(dtype: torch.dtype) -> None:
    kv = _block(dtype)
    out = decode(KEY, encode(KEY, kv, TierMode.RAW), SHAPE)
    assert out.dtype == dtype and torch.equal(out, kv)


def test_int8_is_within_half_a_step_of_each_scale_and_smaller() -> None:
    kv = _block(torch.float32)
    data = encode(KEY, kv, TierMode.INT8)
    out = decode(KEY, data, SHAPE)
    step = kv.abs().amax(dim=(2, 3, 4), keepdim=True) / 127
    assert bool(((out - kv).abs() <= step / 2 + 1e-6).all())
    assert len(data) < len(encode(KEY, kv, TierMode.RAW)) / 3


@pytest.mark.parametrize("mode", list(TierMode))
def test_an_int8_kv_cache_block_is_stored_as_it_is(mode: TierMode) -> None:
    """A CPU engine's int8 KV cache (rows that carry their scales) round-trips exactly
    in either mode: it is never quantized again."""
    kv = quantize_rows(_block(torch.float32))  # [3, 2, 4, 2, 8 + 4]
    shape = (3, 4, 2, kv.shape[-1])
    data = encode(KEY, kv, mode)
    out = decode(KEY, data, shape)
    assert out.dtype == torch.int8 and torch.equal(out, kv)
    assert data == encode(KEY, kv, TierMode.RAW)


@pytest.mark.parametrize("mode", list(TierMode))
def test_any_flipped_byte_is_caught(mode: TierMode) -> None:
    data = encode(KEY, _block(torch.float32), mode)
    for pos in (0, 10, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptBlock):
            decode(KEY, bytes(bad), SHAPE)
    with pytest.raises(CorruptBlock):
        decode(KEY, data[:-1], SHAPE)


def test_a_block_under_another_key_or_shape_is_refused() -> None:
    data = encode(KEY, _block(torch.float32), TierMode.RAW)
    for other in (
        BlockKey(KEY.model, TenantSalt(b"b" * 16), KEY.block_hash),  # another tenant
        BlockKey("other/float32", KEY.salt, KEY.block_hash),  # another model
        BlockKey(KEY.model, KEY.salt, BlockHash(b"g" * 16)),  # another block
    ):
        with pytest.raises(CorruptBlock):
            decode(other, data, SHAPE)
    with pytest.raises(CorruptBlock):
        decode(KEY, data, (3, 4, 2, 4))
