"""``kvtoll serve``: the whole gateway in one command.

Without ``--worker`` it serves the bundled SmolLM2-135M-Instruct from an in-process
engine, with SQLite (migrated on start), in-process rate limits and semantic cache:
no service needed. With ``--worker URL`` (repeatable) it fronts kvtoll workers or any
OpenAI-compatible servers, routed by cached prefix, sending the worker token
(``--worker-token`` / ``KVTOLL_WORKER_TOKEN``, required outside dev mode) on every
call; ``--worker-tls-ca`` verifies ``https://`` workers; ``--worker-discovery`` also
takes workers with a signed registration in Redis. Every caller mistake prints one
line and exits 2 before the server starts.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
import uvicorn
from pydantic import SecretStr

from kvtoll.cli.errors import fail
from kvtoll.logs import configure_logging
from kvtoll.served_models import record_served_models
from kvtoll.server import check_port_free, uvicorn_config
from kvtoll.settings import Settings, load_settings

if TYPE_CHECKING:
    from proxy.stack import ServeOptions

DEFAULT_PORT = 8000


def server_config(app: Any, *, host: str, port: int, log_level: str = "info",
                  **options: Any) -> uvicorn.Config:
    """How the gateway is served (here, and by tests and benchmarks that serve it as
    ``kvtoll serve`` does): :func:`kvtoll.server.uvicorn_config` with fast I/O, lifespan
    on (the app starts and stops its background loops there)."""
    return uvicorn_config(app, host, port, log_level, fast=True, lifespan="on", **options)


def with_dev_admin_token(settings: Settings) -> tuple[Settings, str | None]:
    """In dev mode without ``KVTOLL_ADMIN_TOKEN``: the settings with a random admin token
    for this run and that token (printed once the gateway is built), so that
    ``/admin/dashboard`` works out of the box; else ``settings`` and ``None``."""
    if not settings.dev_mode or settings.admin_token.get_secret_value():
        return settings, None
    token = secrets.token_urlsafe(24)
    return settings.model_copy(update={"admin_token": SecretStr(token)}), token


def _run(host: str, port: int, options: ServeOptions, overrides: dict[str, object]) -> None:
    from proxy.stack import build_stack

    began = time.perf_counter()
    settings, dev_admin_token = with_dev_admin_token(load_settings(**overrides))
    configure_logging(settings.log_level)
    try:
        check_port_free(host, port)
        stack = build_stack(settings, options)
    except ValueError as exc:  # StackError and the port check
        fail(str(exc))
    try:
        record_served_models(settings.data_dir, stack.model_names)  # for `kvtoll price set`
        if dev_admin_token is not None:
            typer.echo(f"kvtoll serve: dev mode: admin token for /admin/dashboard and "
                       f"/admin/...: {dev_admin_token} (new each start; set "
                       "KVTOLL_ADMIN_TOKEN to choose one)", err=True)
        models = ", ".join(stack.model_names)
        typer.echo(f"kvtoll serve: {models} on http://{host}:{port}/v1 (started in "
                   f"{time.perf_counter() - began:.1f} s)", err=True)
        config = server_config(stack.app, host=host, port=port, log_level=settings.log_level,
                               access_log=settings.access_log)
        uvicorn.Server(config).run()
    finally:
        stack.close()


def register(app: typer.Typer) -> None:
    """Add ``kvtoll serve`` to the root CLI."""

    @app.command("serve")
    def serve(
        host: Annotated[str, typer.Option(help="Interface to listen on")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on")] = DEFAULT_PORT,
        worker: Annotated[
            list[str] | None,
            typer.Option(help="Upstream OpenAI-compatible server URL (repeatable); "
                         "default: the in-process engine"),
        ] = None,
        semantic_cache: Annotated[
            bool, typer.Option("--semantic-cache/--no-semantic-cache",
                               help="L3 semantic cache (loads the MiniLM embedder)")
        ] = True,
        routing_policy: Annotated[
            str, typer.Option(help="Prefix-routing policy when --worker is given")
        ] = "cache_aware",
        tokenizer: Annotated[
            str, typer.Option(help="With --worker: the workers' tokenizer for exact prompt "
                              "counts and prefix routing: auto (by model name), none, or a "
                              ".gguf file / model directory")
        ] = "auto",
        worker_token: Annotated[
            str | None, typer.Option(help="Token sent to the workers as a bearer (default: "
                                     "KVTOLL_WORKER_TOKEN; required outside dev mode)")
        ] = None,
        worker_tls_ca: Annotated[
            str | None, typer.Option(help="CA bundle (PEM) that https:// workers' certificates "
                                     "must chain to (default: KVTOLL_WORKER_TLS_CA, else the "
                                     "system's)")
        ] = None,
        worker_discovery: Annotated[
            bool | None,
            typer.Option("--worker-discovery/--no-worker-discovery",
                         help="Also route to workers registered in Redis with a record signed "
                              "by the worker token (default: KVTOLL_WORKER_DISCOVERY or off)"),
        ] = None,
    ) -> None:
        """Serve the OpenAI-compatible gateway (KVTOLL_* settings; see the README)."""
        from proxy.stack import ServeOptions

        options = ServeOptions(tuple(worker or ()), semantic_cache, routing_policy, tokenizer)
        flags = {"worker_token": worker_token, "worker_tls_ca": worker_tls_ca,
                 "worker_discovery": worker_discovery}
        _run(host, port, options, {k: v for k, v in flags.items() if v is not None})
