from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing import keys


def test_generated_key_has_prefix_random_part_and_checksum() -> None:
    key = keys.generate_key()
    assert key.startswith("kvt_")
    assert len(key) == keys.KEY_LENGTH == 4 + 40 + 6
    assert keys.check_format(key)
    assert key[-6:] == keys.checksum(key[4:-6])


def test_keys_carry_at_least_190_bits() -> None:
    assert keys.RANDOM_LENGTH * math.log2(62) >= 190
    assert len({keys.generate_key() for _ in range(200)}) == 200


@given(st.data())
def test_any_single_character_typo_is_refused(data: st.DataObject) -> None:
    key = keys.generate_key()
    position = data.draw(st.integers(min_value=4, max_value=len(key) - 1))
    # An offset (not a filtered choice) keeps the drawn structure independent of the
    # random key, so hypothesis can replay a failing example.
    offset = data.draw(st.integers(min_value=1, max_value=len(keys.BASE62) - 1))
    replacement = keys.BASE62[(keys.BASE62.index(key[position]) + offset) % len(keys.BASE62)]
    typo = key[:position] + replacement + key[position + 1 :]
    assert not keys.check_format(typo)


@given(st.data())
def test_swapping_two_different_adjacent_characters_is_refused(data: st.DataObject) -> None:
    key = keys.generate_key()
    position = data.draw(st.integers(min_value=4, max_value=len(key) - 2))
    if key[position] == key[position + 1]:
        return
    swapped = key[:position] + key[position + 1] + key[position] + key[position + 2 :]
    assert not keys.check_format(swapped)


def test_malformed_shapes_are_refused() -> None:
    key = keys.generate_key()
    for bad in (
        key[:-1], key + "a", "kvx_" + key[4:], key.upper() if key != key.upper() else key[:-1],
        " " + key[1:], key[:10] + "-" + key[11:], "", "kvt_", key.replace("kvt_", "KVT_"),
    ):
        assert not keys.check_format(bad), bad


def test_only_a_sha256_hash_is_stored_and_verification_is_exact() -> None:
    key = keys.generate_key()
    digest = keys.hash_key(key)
    assert digest == hashlib.sha256(key.encode()).hexdigest()
    assert key[4:-6] not in digest
    assert keys.verify_hash(key, digest)
    assert not keys.verify_hash(keys.generate_key(), digest)


def test_display_prefix_shows_only_a_few_characters() -> None:
    key = keys.generate_key()
    shown = keys.display_prefix(key)
    assert shown == f"kvt_{key[4:8]}…{key[-4:]}"
    assert key[8:-4] not in shown


@pytest.mark.parametrize(
    ("candidate", "ok"),
    [("key_" + "a" * 20, True), ("key_" + "a" * 19, False), ("key_" + "a" * 19 + "!", False),
     ("kvt_" + "a" * 20, False), ("", False)],
)
def test_key_id_format(candidate: str, ok: bool) -> None:
    assert keys.check_key_id(candidate) is ok
    assert keys.check_key_id(keys.generate_key_id())
