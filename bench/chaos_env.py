"""The services of one chaos run (:mod:`bench.chaos`): a fresh PostgreSQL database
(migrated, one tenant, key and price), two streaming workers (:mod:`bench.chaos_worker`)
in processes of their own, a loopback TCP proxy (:mod:`bench.tcp_proxy`) in front of
the database, Redis and each worker, and the gateway as ``kvtoll serve`` reaching all
of them through the proxies, with short timeouts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from bench.chaos_load import one_request
from bench.chaos_worker import MODEL
from bench.tcp_proxy import TcpProxy

WORKER_READ_TIMEOUT_S = 3.0
DB_CONNECT_TIMEOUT_S = 2.0
JOURNAL_TOKENS = 4
CLIENT_TIMEOUT_S = 30.0  # far past every gateway timeout: reaching it is a hang
NUM_WORDS = 12
WORD_DELAY_S = 0.03


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


@dataclass
class Env:
    """Everything one chaos run starts (see module doc)."""

    pg_base: str
    redis_url: str
    work: Path
    db_name: str = field(default_factory=lambda: f"kvtoll_chaos_{uuid.uuid4().hex[:12]}")
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    proxies: dict[str, TcpProxy] = field(default_factory=dict)
    worker_ports: dict[str, int] = field(default_factory=dict)
    gateway_port: int = 0
    key: str = ""
    tmpfs: Path | None = None

    @property
    def db_url(self) -> str:
        return make_url(self.pg_base).set(database=self.db_name).render_as_string(
            hide_password=False)

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start(self) -> None:
        admin = create_engine(self.pg_base, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        admin.dispose()
        from billing import accounts, migrate, pricing
        from billing.db import make_engine, session_factory

        migrate.upgrade(self.db_url)
        engine = make_engine(self.db_url)
        with session_factory(engine).begin() as s:
            accounts.create_tenant(s, "chaos")
            _, self.key = accounts.create_key(s, "chaos", requests_per_minute=1_000_000,
                                              tokens_per_minute=1_000_000_000)
            pricing.set_price(s, MODEL, "1", "0.5", "2", "0.1")
        engine.dispose()
        pg, redis = make_url(self.pg_base), make_url(self.redis_url)
        self.proxies["db"] = TcpProxy(pg.host or "127.0.0.1", pg.port or 5432)
        self.proxies["redis"] = TcpProxy(redis.host or "127.0.0.1", redis.port or 6379)
        for name in ("w1", "w2"):
            self.worker_ports[name] = _free_port()
            self.start_worker(name)
            self.proxies[name] = TcpProxy("127.0.0.1", self.worker_ports[name])
        for proxy in self.proxies.values():
            proxy.start()
        self.gateway_port = _free_port()
        self.start_gateway()
        self.warm_up()

    def warm_up(self, num_requests: int = 5) -> None:
        """A few requests before any fault: the key is then one seen recently."""
        import openai

        client = openai.OpenAI(base_url=self.gateway + "/v1", api_key=self.key, max_retries=0)
        for _ in range(num_requests):
            result = one_request(client, NUM_WORDS)
            if result.status != "200":
                raise RuntimeError(f"warm-up request failed: {result}")

    def start_worker(self, name: str) -> None:
        port = self.worker_ports[name]
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "bench.chaos_worker", str(port), str(NUM_WORDS),
             str(WORD_DELAY_S)], env=_child_env())
        _wait_http(f"http://127.0.0.1:{port}/healthz")

    def data_dir(self) -> Path:
        return self.tmpfs if self.tmpfs is not None else self.work / "data"

    def start_gateway(self) -> None:
        db = make_url(self.db_url).set(host="127.0.0.1", port=self.proxies["db"].port)
        redis = make_url(self.redis_url).set(host="127.0.0.1", port=self.proxies["redis"].port)
        env = {**_child_env(), "KVTOLL_DEV_MODE": "1",
               "KVTOLL_DATABASE_URL": db.render_as_string(hide_password=False),
               "KVTOLL_REDIS_URL": redis.render_as_string(hide_password=False),
               "KVTOLL_DATA_DIR": str(self.data_dir()), "KVTOLL_LOG_LEVEL": "warning",
               "KVTOLL_WORKER_READ_TIMEOUT_S": str(WORKER_READ_TIMEOUT_S),
               "KVTOLL_WORKER_CONNECT_TIMEOUT_S": "2",
               "KVTOLL_DB_CONNECT_TIMEOUT_S": str(DB_CONNECT_TIMEOUT_S),
               "KVTOLL_PROGRESS_EVERY_TOKENS": str(JOURNAL_TOKENS)}
        args = [sys.executable, "-c", "from kvtoll.cli.main import main; main()", "serve",
                "--port",
                str(self.gateway_port), "--no-semantic-cache", "--tokenizer", "none",
                "--routing-policy", "round_robin"]
        for name in ("w1", "w2"):
            args += ["--worker", f"http://127.0.0.1:{self.proxies[name].port}"]
        with open(self.work / "gateway.log", "ab") as log:
            self.procs["gateway"] = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                                     stderr=log)
        try:
            _wait_http(self.gateway + "/healthz")
        except RuntimeError:
            tail = (self.work / "gateway.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the gateway did not start:\n{tail}") from None

    def ledger(self, request_ids: set[str]) -> list[tuple[str, int, bool]]:
        """(request id, completion tokens, cut) of the ledger rows of ``request_ids``."""
        from billing.models import UsageRecord

        engine = create_engine(self.db_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(select(UsageRecord.request_id, UsageRecord.completion_tokens,
                                           UsageRecord.cut)
                                    .where(UsageRecord.request_id.in_(request_ids))).all()
                total = conn.execute(select(func.count()).select_from(UsageRecord)).scalar()
        finally:
            engine.dispose()
        assert total is not None
        return [(str(r[0]), int(r[1]), bool(r[2])) for r in rows]

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        for proxy in self.proxies.values():
            proxy.stop()
        if self.tmpfs is not None:
            subprocess.run(["umount", str(self.tmpfs)], check=False)
        admin = create_engine(self.pg_base, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
        admin.dispose()


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
