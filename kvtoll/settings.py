"""Process-wide configuration, read once from the environment (prefix ``KVTOLL_``).

Build it with :func:`load_settings` at the edge (CLI command, app factory, Alembic
env) and pass plain values down; nothing reads the environment at import time.
"""

from __future__ import annotations

import hashlib
import hmac

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    admin_token: SecretStr = SecretStr("")
    secret: SecretStr = SecretStr("")
    dev_mode: bool = False
    data_dir: str = "./kvtoll-data"
    model_path: str | None = Field(default=None, description="GGUF file or HF directory")
    dtype: str | None = None
    attention_backend: str = "auto"
    device: str = "cpu"  # the in-process engine's and `kvtoll worker`'s: cpu, cuda, cuda:N
    cuda_graphs: bool = False  # decode steps as CUDA graphs (engine.decode_graphs)
    gpu_memory_utilization: float = 0.9  # on a GPU: its share for the engine (engine.gpu_memory)
    log_level: str = "info"

    @model_validator(mode="after")
    def _normalise(self) -> Settings:
        if self.redis_url == "":
            object.__setattr__(self, "redis_url", None)
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
        """Secret for server-side salts; in dev mode an empty one falls back to a fixed value."""
        value = self.secret.get_secret_value()
        if not value:
            if not self.dev_mode:
                raise ValueError("KVTOLL_SECRET is empty (set it, or KVTOLL_DEV_MODE=1)")
            value = "kvtoll-dev-secret"
        return value.encode()


def load_settings(**overrides: object) -> Settings:
    """Read the environment once; ``overrides`` win over it (CLI flags, tests)."""
    return Settings(**overrides)  # type: ignore[arg-type]
