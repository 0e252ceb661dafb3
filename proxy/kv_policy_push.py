"""Push the tenants' KV shares to every kvtoll worker, so a reservation holds from the
moment it is set, not from the tenant's next request on that worker.

Algorithm. Every ``interval_s`` (1 s) the gateway reads the tenants whose KV share is
not the default (:func:`billing.accounts.kv_policies`, one query on a thread) and
turns each into ``{cache_salt, tenant, reserved_blocks, max_blocks}`` (the salt as the
gateway derives it for requests). A tenant that left that list (set back to the
default) stays in the table as reserved 0, no cap. Then, for each
upstream in the pool that takes pushed shares (a kvtoll worker), the table goes out
(``PUT /kv/shares``) when it differs from what that upstream last accepted, or when
``refresh_s`` (5 s) passed since then: a worker that (re)started or joined the pool
gets it within ``refresh_s + interval_s``. A failed push is retried at the next tick;
an upstream that answers 404 or 501 (not a kvtoll worker) is not asked again.

A change therefore reaches every worker within ``interval_s`` plus a database read
and a push (measured by bench/policy_propagation.py), independent of traffic. Shares
still travel with each request too (``kvtoll_kv_share``), which wins at that moment:
:func:`request_share` takes that share from this table's last reading (at most
``interval_s`` old) where it has the tenant, and from the key's cached policy (up to
the auth cache's TTL old) only where it does not, so a request never puts back a
share older than the one just pushed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from billing.accounts import KeyIdentity, TenantKVPolicy
from engine.api import KVShare
from engine.kv.hashing import TenantSalt, derive_tenant_salt
from proxy.pool import UpstreamPool

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 1.0
DEFAULT_REFRESH_S = 5.0

ShareTable = tuple[tuple[str, str, int, int | None], ...]  # (salt hex, tenant, reserved, max)


@runtime_checkable
class TakesKVShares(Protocol):
    """An upstream that takes the table (:meth:`proxy.upstream.http.HttpUpstream`)."""

    @property
    def name(self) -> str: ...

    async def push_kv_shares(self, shares: list[dict[str, Any]]) -> bool | None:
        """True: accepted; False: failed (retry); None: this upstream takes none."""
        ...


class KVSharePusher:
    """Reads the policy table and pushes it to the pool's kvtoll workers."""

    def __init__(
        self,
        read_policies: Callable[[], list[TenantKVPolicy]],
        pool: UpstreamPool,
        server_secret: bytes,
        interval_s: float = DEFAULT_INTERVAL_S,
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or refresh_s <= 0:
            raise ValueError("interval_s and refresh_s must be positive")
        self._read = read_policies
        self._pool = pool
        self._secret = server_secret
        self.interval_s = interval_s
        self.refresh_s = refresh_s
        self._clock = clock
        self._known: dict[str, tuple[str, int, int | None]] = {}  # salt hex -> share
        self._sent: dict[str, tuple[ShareTable, float]] = {}  # upstream -> (table, when)
        self._skip: set[str] = set()  # upstreams that take no pushed shares

    def table(self, policies: list[TenantKVPolicy]) -> ShareTable:
        """The entries to send, by salt: every non-default share, and as the default
        every tenant that had one since this gateway started and no longer has."""
        current = {
            derive_tenant_salt(self._secret, p.tenant_id).hex(): (
                p.name, p.kv_reserved_blocks, p.kv_max_blocks)
            for p in policies
        }  # fmt: skip
        for salt, (name, _, _) in self._known.items():
            if salt not in current:
                self._known[salt] = (name, 0, None)
        self._known.update(current)
        return tuple((salt, *self._known[salt]) for salt in sorted(self._known))

    def share_of(self, salt: TenantSalt) -> tuple[int, int | None] | None:
        """The tenant's (reserved, max) blocks as last read, or None if this gateway has
        read no non-default share for it since it started."""
        known = self._known.get(salt.hex())
        return None if known is None else (known[1], known[2])

    async def tick(self) -> None:
        """One read and, where due, one push per worker (concurrently)."""
        policies = await asyncio.to_thread(self._read)
        table = self.table(policies)
        if not table:
            return
        now = self._clock()
        due = [u for u in self._pool.upstreams
               if isinstance(u, TakesKVShares) and u.name not in self._skip
               and self._due(u.name, table, now)]  # fmt: skip
        if not due:
            return
        body = [{"cache_salt": s, "tenant": t, "reserved_blocks": r, "max_blocks": m}
                for s, t, r, m in table]  # fmt: skip
        results = await asyncio.gather(*(u.push_kv_shares(body) for u in due),
                                       return_exceptions=True)  # fmt: skip
        for upstream, ok in zip(due, results, strict=True):
            if ok is None:
                self._skip.add(upstream.name)
            elif ok is True:
                self._sent[upstream.name] = (table, now)
            else:
                log.warning("pushing KV shares to %s failed (%s); retrying",
                            upstream.name, ok if isinstance(ok, BaseException) else "refused")

    def _due(self, name: str, table: ShareTable, now: float) -> bool:
        sent = self._sent.get(name)
        return sent is None or sent[0] != table or now - sent[1] >= self.refresh_s

    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled (a failed read is logged, retried)."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("reading or pushing the KV share table failed")
            await asyncio.sleep(self.interval_s)


def request_share(
    identity: KeyIdentity, salt: TenantSalt, pusher: KVSharePusher | None
) -> KVShare:
    """The share a request carries (module doc): the pushed table's where it has the
    tenant, else the key's cached policy."""
    pushed = None if pusher is None else pusher.share_of(salt)
    reserved, cap = pushed or (identity.kv_reserved_blocks, identity.kv_max_blocks)
    return KVShare(identity.tenant_name, reserved, cap)
