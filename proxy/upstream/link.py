"""How the gateway reaches its workers: the worker token on every call, TLS if asked.

One :class:`WorkerLink` is built from the settings (``KVTOLL_WORKER_TOKEN`` /
``--worker-token``, ``KVTOLL_WORKER_TLS_CA`` / ``--worker-tls-ca``) and handed to
everything that calls a worker: the upstreams (completions, health), the registry's
``/load`` probes, the ``/kv/events`` feeds and the start-up ``/v1/models`` listing.
With a CA bundle, ``https://`` workers are verified against it (hostname included);
without one, against the system's trust store.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import httpx

from kvtoll.worker_auth import bearer_headers


@dataclass(frozen=True)
class WorkerLink:
    """The worker token to send (empty: none, dev mode) and the CA to trust."""

    token: str = ""
    tls_ca: str | None = None

    def headers(self) -> dict[str, str]:
        return bearer_headers(self.token)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The context for https workers (``None``: the default one); ``ValueError`` if the
        CA bundle cannot be read."""
        if self.tls_ca is None:
            return None
        try:
            return ssl.create_default_context(cafile=self.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot read --worker-tls-ca {self.tls_ca}: {exc}") from None

    def httpx_options(self) -> dict[str, Any]:
        """``headers`` and ``verify`` for an httpx client that calls workers."""
        context = self.ssl_context()
        return {"headers": self.headers(), "verify": context if context is not None else True}

    def async_client(self, timeout_s: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout_s, **self.httpx_options())
