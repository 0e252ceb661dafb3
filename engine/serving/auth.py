"""The worker's front door: every request must carry a worker token it accepts.

A raw ASGI wrapper around the worker app (before routing and body parsing): a
request whose ``Authorization: Bearer`` token is missing or not one of the worker's
tokens (:class:`kvtoll.worker_auth.WorkerTokens`: current, and previous during a
rotation) is answered 401 in OpenAI's error shape, says nothing about why, and logs
one WARNING line (method, path, peer, missing or wrong; never the token). Nothing of
the request reaches the engine, so its ``cache_salt`` is only ever read from an
authenticated gateway. Without tokens (dev mode) every request passes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvtoll.worker_auth import WorkerTokens, presented_token

log = logging.getLogger(__name__)

_BODY = json.dumps({"error": {"message": "unauthorized", "type": "invalid_request_error",
                              "param": None, "code": "invalid_worker_token"}}).encode()
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode()),
            (b"www-authenticate", b"Bearer")]


class WorkerAuth:
    """ASGI middleware: refuse requests without an accepted worker token."""

    def __init__(self, app: Any, tokens: WorkerTokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tokens.enabled:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        token = presented_token(header.decode("latin-1")) if header is not None else None
        if token is not None and self.tokens.matches(token):
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        log.warning("refused %s %s from %s: %s worker token", scope.get("method"),
                    scope.get("path"), client[0], "missing" if token is None else "wrong")
        await send({"type": "http.response.start", "status": 401, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": _BODY})
