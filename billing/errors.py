"""Billing service errors: a caller's mistake, mapped by the edges to 404/409/400 or exit 2.

Every error is a ``ValueError`` (a caller's mistake, never broken internals) and its
message is one line that is safe to show: it never contains a plaintext API key.
"""

from __future__ import annotations


class BillingError(ValueError):
    """Base class of every caller-facing billing error."""


class NotFound(BillingError):
    """The named tenant, key or price does not exist (HTTP 404)."""


class Conflict(BillingError):
    """The change clashes with existing state: duplicate name, already revoked (HTTP 409)."""


class InvalidInput(BillingError):
    """Malformed input: bad price, fraction, key id or name (HTTP 400)."""
