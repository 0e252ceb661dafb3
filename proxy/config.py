"""Proxy-only limits and timings, frozen and passed to :func:`proxy.app.create_app`.

:class:`kvtoll.settings.Settings` holds what the whole process shares (URLs, secrets);
this holds the gateway's policy numbers. Defaults suit the embedded single-process
setup; tests and deployments pass their own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from billing.db import DbTimeouts
from billing.keys import REVOCATION_BOUND_S
from kvtoll.settings import Settings


@dataclass(frozen=True)
class AdmissionLimits:
    """Hard limits checked before a request reaches any cache or upstream."""

    max_body_bytes: int = 1_000_000
    max_prompt_tokens: int = 8192  # also capped by the upstream's context, if it says
    max_tokens_cap: int = 4096  # largest max_tokens a client may ask for
    default_max_tokens: int = 256  # used when the client gives none
    max_n: int = 8


@dataclass(frozen=True)
class RateLimitDefaults:
    """Per-key limits when the key row has none (``NULL`` in ``api_keys``).

    ``burst_s``: each key's token buckets hold this many seconds of its rate (an idle
    key may send ``ceil(limit * burst_s / 60)`` at once; :mod:`proxy.ratelimit`).
    ``fallback_divisor``: while Redis is unreachable each replica enforces
    ``limit // fallback_divisor`` (at least 1) locally, so N replicas together stay
    near the shared limit; ``redis_retry_s`` is how long before Redis is tried again.
    """

    requests_per_minute: int = 6000
    tokens_per_minute: int = 1_000_000
    burst_s: float = 10.0
    fallback_divisor: int = 4
    redis_retry_s: float = 5.0


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the gateway's policy needs beyond :class:`Settings`."""

    limits: AdmissionLimits = AdmissionLimits()
    rate_limits: RateLimitDefaults = RateLimitDefaults()
    auth_cache_ttl_s: float = float(REVOCATION_BOUND_S)  # a revoked key works at most this long
    auth_cache_size: int = 10_000
    upstream_first_byte_timeout_s: float = 60.0
    upstream_idle_timeout_s: float = 60.0
    # a non-streamed request: the upstream's whole answer (it may be silent that long)
    upstream_response_timeout_s: float = 600.0
    ledger_retry_interval_s: float = 2.0  # outbox drain retries while the DB is failing
    ledger_batch_delay_s: float = 0.2  # ledger rows trail responses by about this much
    outbox_fsync: bool = False  # fsync every usage record (survives power loss, slower)
    health_check_interval_s: float = 5.0
    kv_share_push_interval_s: float = 1.0  # proxy.kv_policy_push: read and push the KV shares
    # Semantic-cache stores run after the response; past this many still waiting (misses
    # arriving faster than they can be embedded) further answers are not stored.
    max_pending_cache_stores: int = 256
    # Crash-safe metering (proxy.progress): a streamed request's tokens so far are
    # journaled at least every this many tokens or seconds.
    progress_every_tokens: int = 16
    progress_every_s: float = 0.5
    # Dependency probes behind /readyz (proxy.probes): how often, and how long a probe
    # may take before its dependency counts as down (a hang is a failure).
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    # How long a request from a never-seen key waits for the key store before a 503.
    auth_wait_s: float = 5.0
    worker_probe_min_s: float = 0.5  # first re-probe of a down worker; doubles up to the interval
    redis_socket_timeout_s: float = 0.5


def from_settings(settings: Settings, base: ProxyConfig | None = None) -> ProxyConfig:
    """``base`` (default: the defaults) with the timeouts and the default rate limits
    (``KVTOLL_RATE_LIMIT_*``) of ``settings``."""
    worker_s = settings.worker_read_timeout_s
    config = base or ProxyConfig()
    return replace(
        config,
        rate_limits=replace(
            config.rate_limits,
            requests_per_minute=settings.rate_limit_requests_per_minute,
            tokens_per_minute=settings.rate_limit_tokens_per_minute,
            burst_s=settings.rate_limit_burst_s,
        ),
        upstream_first_byte_timeout_s=worker_s, upstream_idle_timeout_s=worker_s,
        upstream_response_timeout_s=settings.worker_response_timeout_s,
        progress_every_tokens=settings.progress_every_tokens,
        progress_every_s=settings.progress_every_ms / 1000,
        auth_wait_s=settings.db_connect_timeout_s,
        redis_socket_timeout_s=settings.redis_socket_timeout_s,
    )


def db_timeouts(settings: Settings) -> DbTimeouts:
    """The gateway's database timeouts (a statement timeout of 0 means none)."""
    return DbTimeouts(
        connect_timeout_s=settings.db_connect_timeout_s,
        statement_timeout_ms=settings.db_statement_timeout_ms or None,
        sqlite_busy_timeout_ms=settings.sqlite_busy_timeout_ms,
        pool_timeout_s=settings.db_connect_timeout_s,
    )
