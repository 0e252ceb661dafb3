"""Compatibility shim: usage views need no per-process cache any more.

The usage views read the hourly rollup (:mod:`billing.usage_rollup`), which is
exact and small, so a cold call costs what a warm one does and every replica
answers the same. :class:`UsageCache` keeps its old interface for the web layer
and holds no state; callers may use :func:`billing.usage.aggregate_usage` directly.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from billing.usage import UsageQuery, UsageRow, aggregate_usage


class UsageCache:
    """Stateless: :meth:`aggregate` is :func:`billing.usage.aggregate_usage`."""

    def aggregate(self, session: Session, query: UsageQuery) -> list[UsageRow]:
        """The rows of :func:`billing.usage.aggregate_usage` for ``query``."""
        return aggregate_usage(session, query)
