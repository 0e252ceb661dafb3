"""Starting the gateway and its peers as processes for the gateway benchmarks
(``proxy_overhead.py``, ``profile_gateway.py``, ``semantic_http.py``): a seeded SQLite
ledger, ``kvtoll serve --worker`` as a user starts it, a peer gateway from its launch
recipe (``gateway_peers.py``), and the wait for a server's health check."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench import gateway_peers
from bench.fixed_upstream import MODEL

ROOT = Path(__file__).resolve().parents[1]


def seed_database(url: str) -> str:
    """Migrate a fresh SQLite file, add a tenant, an unthrottled key and a price."""
    from billing import accounts, pricing
    from billing.db import make_engine, session_factory
    from billing.migrate import upgrade

    upgrade(url)
    engine = make_engine(url)
    with session_factory(engine).begin() as session:
        accounts.create_tenant(session, "bench")
        _, key = accounts.create_key(session, "bench", requests_per_minute=accounts.MAX_LIMIT,
                                     tokens_per_minute=accounts.MAX_LIMIT)
        pricing.set_price(session, MODEL, "1", "0.5", "2", "0.1")
    engine.dispose()
    return key


GATEWAY_ENV = {"KVTOLL_ADMIN_TOKEN": "bench-admin-token-0123456789",
               "KVTOLL_SECRET": "bench-secret", "KVTOLL_LOG_LEVEL": "warning",
               "KVTOLL_WORKER_TOKEN": "bench-worker-token-0123456"}  # sent upstream too


def spawn_gateway(upstream_url: str, database_url: str, data_dir: str, port: int,
                  ledger_writer: str, nice: int = 0) -> subprocess.Popen[bytes]:
    """``kvtoll serve --worker <upstream>`` as a user starts it (the CLI's entry point)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **GATEWAY_ENV,
           "KVTOLL_DATABASE_URL": database_url, "KVTOLL_DATA_DIR": data_dir,
           "KVTOLL_LEDGER_WRITER": ledger_writer}
    env.pop("KVTOLL_REDIS_URL", None)
    argv = [sys.executable, "-c", "from kvtoll.cli.main import main; main()", "serve",
            "--host", "127.0.0.1", "--port", str(port), "--worker", upstream_url,
            "--no-semantic-cache", "--tokenizer", "none"]
    return subprocess.Popen(argv, cwd=ROOT, env=env,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120,
               health_path: str = "/healthz") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + health_path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def spawn_peer(launch: gateway_peers.PeerLaunch, log_path: Path,
               nice: int = 0) -> subprocess.Popen[bytes]:
    """Start a peer gateway; its output goes to ``log_path`` (read it if it fails)."""
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(launch.argv, cwd=log_path.parent,
                                env={**os.environ, **launch.env}, stdout=log,
                                stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
