"""Process-wide configuration, read once from the environment (prefix ``KVTOLL_``).

Build it with :func:`load_settings` at the edge (CLI command, app factory, Alembic
env) and pass plain values down; nothing reads the environment at import time.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtoll.dev_secret import dev_secret
from kvtoll.worker_auth import MIN_TOKEN_LENGTH, WorkerTokens

WELL_KNOWN_ADMIN_TOKENS = frozenset(
    {"admin", "password", "changeme", "secret", "token", "test", "kvtoll", "123456"}
)
DEFAULT_DATABASE_URL = "sqlite:///./kvtoll.db"
EMPTY_ADMIN_TOKEN = "KVTOLL_ADMIN_TOKEN is empty: set it to use the operator dashboard and APIs"


class Settings(BaseSettings):
    """Frozen settings; every field maps to ``KVTOLL_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="KVTOLL_", frozen=True, extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str | None = None
    # the semantic cache's verifier (KVTOLL_SEMANTIC_VERIFIER): pair-encoder, cross-encoder
    # or logistic;
    # None: proxy.semantic.factory.default_verifier()
    semantic_verifier: Literal["pair-encoder", "cross-encoder", "logistic"] | None = None
    admin_token: SecretStr = SecretStr("")
    secret: SecretStr = SecretStr("")
    dev_mode: bool = False
    # Gateway <-> worker link (kvtoll.worker_auth): the gateway sends worker_token, a
    # worker accepts it and worker_token_previous (during a rotation).
    worker_token: SecretStr = SecretStr("")
    worker_token_previous: SecretStr = SecretStr("")
    worker_discovery: bool = False  # gateway: also take workers registered in Redis
    worker_tls_ca: str | None = None  # gateway: CA bundle for https:// workers
    tls_cert: str | None = None  # worker: serve https with this certificate ...
    tls_key: str | None = None  # ... and this private key
    metrics_token: SecretStr = SecretStr("")  # bearer for /metrics (the admin token works too)
    data_dir: str = "./kvtoll-data"
    model_path: str | None = Field(default=None, description="GGUF file or HF directory")
    dtype: str | None = None
    attention_backend: str = "auto"
    device: str = "cpu"  # the in-process engine's and `kvtoll worker`'s: cpu, cuda, cuda:N
    cuda_graphs: bool = False  # decode steps as CUDA graphs (engine.decode_graphs)
    gpu_memory_utilization: float = 0.9  # on a GPU: its share for the engine (engine.gpu_memory)
    # Tier 2 KV (engine.kv.tier), `kvtoll worker`: host MiB (0 = off), shared store
    kv_tier_mb: int = 0
    kv_shared: str = "off"  # redis | peer | off
    kv_tier_mode: str = "raw"  # raw (the KV dtype) | int8 (per-block scales)
    kv_tier_tenant_fraction: float = 0.5  # one tenant's cap, as a share of the tier
    kv_tier_spill_dir: str | None = None
    kv_tier_spill_mb: int = 0
    kv_tier_ttl_s: int = 3600
    kv_tier_timeout_s: float = 0.25
    log_level: str = "info"
    # gateway: where the usage outbox is drained to the ledger: "process" (a writer
    # process of its own, off the serving process's GIL) or "thread" (in-process)
    ledger_writer: Literal["process", "thread"] = "process"
    # gateway: per-key rate limits for keys without their own (token buckets holding
    # rate_limit_burst_s seconds of the rate; proxy.ratelimit)
    rate_limit_requests_per_minute: int = Field(default=6000, ge=1)
    rate_limit_tokens_per_minute: int = Field(default=1_000_000, ge=1)
    rate_limit_burst_s: float = Field(default=10.0, gt=0)
    # Timeouts: everywhere a request waits on something (proxy.config.from_settings).
    db_connect_timeout_s: float = Field(default=5.0, gt=0)
    db_statement_timeout_ms: int = Field(default=5000, ge=0)  # 0: none
    sqlite_busy_timeout_ms: int = Field(default=5000, ge=0)
    redis_socket_timeout_s: float = Field(default=0.5, gt=0)
    worker_connect_timeout_s: float = Field(default=5.0, gt=0)
    worker_read_timeout_s: float = Field(default=60.0, gt=0)  # first byte, and between two
    # a non-streamed request's whole answer (asked of the worker in one piece)
    worker_response_timeout_s: float = Field(default=600.0, gt=0)
    # Crash-safe metering: a stream's progress is journaled every N tokens or M ms.
    progress_every_tokens: int = Field(default=16, ge=1)
    progress_every_ms: int = Field(default=500, ge=1)
    access_log: bool = False  # gateway: one INFO line per request served (uvicorn's)
    # gateway: share of the semantic hits the error bound would serve that are answered by
    # the engine instead and compared (proxy.semantic.explore), billed as misses
    semantic_explore_rate: float = Field(default=0.05, ge=0, le=1)

    @model_validator(mode="after")
    def _normalise(self) -> Settings:
        if self.redis_url == "":
            object.__setattr__(self, "redis_url", None)
        for name in ("worker_tls_ca", "tls_cert", "tls_key", "kv_tier_spill_dir"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        return self

    def admin_token_problem(self) -> str | None:
        """Why the admin API must not start with this token, or ``None`` if it may."""
        token = self.admin_token.get_secret_value()
        if self.dev_mode:
            return None
        if not token:
            return "KVTOLL_ADMIN_TOKEN is empty (set it, or KVTOLL_DEV_MODE=1 for local use)"
        if token.lower() in WELL_KNOWN_ADMIN_TOKENS or len(token) < 16:
            return "KVTOLL_ADMIN_TOKEN is well known or shorter than 16 characters"
        return None

    def admin_disabled_reason(self) -> str | None:
        """Why operator access (admin API and admin dashboard) is off, or ``None`` if it is
        on. Dev mode accepts a weak token but not an empty one. Every admin surface answers
        503 ``admin_disabled`` with this reason, and 401 to a wrong token."""
        if problem := self.admin_token_problem():
            return problem
        return None if self.admin_token.get_secret_value() else EMPTY_ADMIN_TOKEN

    def admin_token_matches(self, candidate: str) -> bool:
        """Constant-time comparison with the admin token (of SHA-256 digests: any length,
        any text). Check :meth:`admin_disabled_reason` first."""
        expected = hashlib.sha256(self.admin_token.get_secret_value().encode()).digest()
        return hmac.compare_digest(hashlib.sha256(candidate.encode()).digest(), expected)

    def server_secret(self) -> bytes:
        """Secret for tenant salts and sessions; in dev mode an empty one is the random
        secret of the data directory (:mod:`kvtoll.dev_secret`). ``ValueError`` if none."""
        value = self.secret.get_secret_value()
        if value:
            return value.encode()
        if not self.dev_mode:
            raise ValueError("KVTOLL_SECRET is empty (set it, or KVTOLL_DEV_MODE=1)")
        return dev_secret(self.data_dir)

    def worker_tokens(self) -> WorkerTokens:
        """The worker token(s); ``ValueError`` when unsafe outside dev mode (empty or short)."""
        tokens = WorkerTokens(self.worker_token.get_secret_value(),
                              self.worker_token_previous.get_secret_value())
        if self.dev_mode:
            return tokens
        if not tokens.enabled:
            raise ValueError("KVTOLL_WORKER_TOKEN is empty (set it or --worker-token on the "
                             "gateway and every worker, or KVTOLL_DEV_MODE=1 for local use)")
        if any(len(t) < MIN_TOKEN_LENGTH for t in tokens.accepted()):
            raise ValueError(f"the worker token must be at least {MIN_TOKEN_LENGTH} characters")
        return tokens

    def metrics_open(self) -> bool:
        """``/metrics`` without a token: only in dev mode with no metrics token set."""
        return self.dev_mode and not self.metrics_token.get_secret_value()


class SettingsError(ValueError):
    """A setting (``KVTOLL_*`` variable or override) that is not valid, in one line."""


def _describe(exc: ValidationError, overrides: dict[str, object]) -> str:
    """One line naming each bad setting: its variable (or the override) and why."""
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "settings"
        name = f"--{field.replace('_', '-')}" if field in overrides else f"KVTOLL_{field.upper()}"
        value = error.get("input")
        shown = "" if isinstance(value, dict) or value is None else f"={value}"
        reason = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{name}{shown}: {reason[:1].lower()}{reason[1:]}")
    return "; ".join(parts)


def load_settings(**overrides: object) -> Settings:
    """Read the environment once; ``overrides`` win over it (CLI flags, tests).
    ``SettingsError`` (one line naming the variable) when a value is not valid."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise SettingsError(f"invalid setting {_describe(exc, overrides)}") from None
