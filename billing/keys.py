"""API key format, checksum and hashing.

A key is ``kvt_`` + 40 random base62 characters (~238 bits) + a 6-character base62
checksum (blake2b of the random part, 32 bits)::

    kvt_ 7Gd0...(40)...Qx 3kP9aZ
         └─ random ─────┘ └ checksum

:func:`check_format` rejects typos (wrong prefix, length, alphabet or checksum)
without touching the database. Only :func:`hash_key` (sha256 hex: enough for a
random key with this much entropy, no salt or KDF needed) is stored, together with
a display prefix that shows 4 random and the 4 last checksum characters.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string

KEY_PREFIX = "kvt_"
RANDOM_LENGTH = 40
CHECKSUM_LENGTH = 6
KEY_LENGTH = len(KEY_PREFIX) + RANDOM_LENGTH + CHECKSUM_LENGTH
KEY_ID_PREFIX = "key_"
KEY_ID_RANDOM_LENGTH = 20
# How long a gateway may keep accepting a key after its revocation: the lifetime of
# its key cache (proxy.auth). `kvtoll key revoke` and the README state this bound.
REVOCATION_BOUND_S = 5
BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
_BASE62_SET = frozenset(BASE62)


def _random_base62(length: int) -> str:
    return "".join(secrets.choice(BASE62) for _ in range(length))


def _to_base62(number: int, width: int) -> str:
    digits = []
    for _ in range(width):
        number, digit = divmod(number, 62)
        digits.append(BASE62[digit])
    return "".join(reversed(digits))


def checksum(random_part: str) -> str:
    """The 6-character base62 checksum of a key's random part."""
    digest = hashlib.blake2b(random_part.encode("ascii"), digest_size=4).digest()
    return _to_base62(int.from_bytes(digest, "big"), CHECKSUM_LENGTH)


def generate_key() -> str:
    """A new plaintext key; show it once and store only :func:`hash_key` of it."""
    random_part = _random_base62(RANDOM_LENGTH)
    return KEY_PREFIX + random_part + checksum(random_part)


def check_format(candidate: str) -> bool:
    """True if ``candidate`` is a well-formed key with a valid checksum (no lookup)."""
    if not isinstance(candidate, str) or len(candidate) != KEY_LENGTH:
        return False
    if not candidate.startswith(KEY_PREFIX):
        return False
    body = candidate[len(KEY_PREFIX) :]
    if not _BASE62_SET.issuperset(body):
        return False
    random_part, check = body[:RANDOM_LENGTH], body[RANDOM_LENGTH:]
    return hmac.compare_digest(checksum(random_part), check)


def hash_key(plaintext: str) -> str:
    """sha256 hex of the key: the only form the database ever sees."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def verify_hash(plaintext: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented key with a stored hash."""
    return hmac.compare_digest(hash_key(plaintext).encode(), stored_hash.encode())


def display_prefix(plaintext: str) -> str:
    """A recognisable, non-secret label such as ``kvt_Ab3d…x9Z2``."""
    head = plaintext[len(KEY_PREFIX) : len(KEY_PREFIX) + 4]
    return f"{KEY_PREFIX}{head}…{plaintext[-4:]}"


def generate_key_id() -> str:
    """A new public key id (``key_`` + 20 base62 characters)."""
    return KEY_ID_PREFIX + _random_base62(KEY_ID_RANDOM_LENGTH)


def check_key_id(candidate: str) -> bool:
    """True if ``candidate`` looks like a key id (no lookup)."""
    body = candidate[len(KEY_ID_PREFIX) :]
    return (
        candidate.startswith(KEY_ID_PREFIX)
        and len(body) == KEY_ID_RANDOM_LENGTH
        and _BASE62_SET.issuperset(body)
    )
