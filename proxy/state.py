"""Everything one app instance owns, built once by :func:`proxy.app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from proxy.config import ProxyConfig
from proxy.intake import Intake
from proxy.kv_policy_push import KVSharePusher
from proxy.metering import Meter
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox
from proxy.pool import UpstreamPool
from proxy.probes import DependencyProbes
from proxy.progress import ProgressJournal
from proxy.ratelimit import RateLimiter
from proxy.service import Gateway


@dataclass(frozen=True)
class ProxyState:
    settings: Settings
    config: ProxyConfig
    session_factory: sessionmaker[Session]
    metrics: ProxyMetrics
    intake: Intake
    gateway: Gateway
    pool: UpstreamPool
    meter: Meter
    outbox: Outbox
    limiter: RateLimiter
    models: tuple[str, ...]
    probes: DependencyProbes
    progress: ProgressJournal
    share_pusher: KVSharePusher
