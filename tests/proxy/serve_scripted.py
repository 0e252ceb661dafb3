"""Run the real gateway over a scripted upstream in its own process (for kill -9 tests).

    python -m tests.proxy.serve_scripted DATABASE_URL DATA_DIR PORT [NUM_WORDS DELAY_S]
"""

from __future__ import annotations

import sys

import uvicorn

from billing.db import make_engine, session_factory
from kvtoll.settings import load_settings
from proxy.config import ProxyConfig
from tests.proxy.helpers import ADMIN_TOKEN, build_app
from tests.proxy.scripted import ScriptedUpstream


def main(database_url: str, data_dir: str, port: int, num_words: int = 5,
         delay_s: float = 0.0) -> None:
    settings = load_settings(database_url=database_url, admin_token=ADMIN_TOKEN,
                             secret="test-server-secret", data_dir=data_dir, redis_url=None)
    factory = session_factory(make_engine(database_url))
    config = ProxyConfig(ledger_retry_interval_s=0.1)
    upstream = ScriptedUpstream(num_words=num_words, delay_s=delay_s)
    app = build_app(settings, factory, upstreams=[upstream], config=config)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    extra = sys.argv[4:6]
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]),
         *([int(extra[0]), float(extra[1])] if extra else []))
