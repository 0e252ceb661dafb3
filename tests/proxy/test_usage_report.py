"""A gateway in front of an OpenAI-compatible upstream whose usage lacks
``prompt_tokens_details`` (vLLM without ``--enable-prompt-tokens-details``): one
WARNING at its first response, and ``/readyz`` names it under ``billing_warnings``."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from sqlalchemy.orm import Session, sessionmaker

from kvtoll.settings import Settings
from proxy.upstream.http import HttpUpstream, HttpUpstreamConfig
from tests.proxy.helpers import MODEL, LiveServer, Tenants, build_app, free_port
from tests.proxy.upstream.upstream_helpers import Script, chat_event, scripted_server


def test_readyz_names_an_upstream_that_reports_no_cached_tokens(
    settings: Settings, db: sessionmaker[Session], tenants: Tenants,
    caplog: pytest.LogCaptureFixture,
) -> None:
    script = Script(events=[chat_event(0, "Hi", "stop"),
                            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}])
    port = free_port()
    vllm = uvicorn.Server(uvicorn.Config(scripted_server(script), host="127.0.0.1", port=port,
                                         log_level="warning"))
    thread = threading.Thread(target=vllm.run, daemon=True)
    thread.start()
    while not vllm.started:
        time.sleep(0.02)
    upstream = HttpUpstream(HttpUpstreamConfig(f"http://127.0.0.1:{port}", send_salt=False))
    try:
        with LiveServer(build_app(settings, db, upstreams=[upstream])) as server:
            before = httpx.get(server.url + "/readyz", timeout=30).json()
            assert before["billing_warnings"] == []  # nothing known before a response
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            with caplog.at_level("WARNING", logger="proxy.upstream.usage_report"):
                for _ in range(2):
                    answer = httpx.post(server.url + "/v1/chat/completions", json=body,
                                        headers={"Authorization": f"Bearer {tenants.key_a}"},
                                        timeout=30)
                    assert answer.status_code == 200
                    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            after = httpx.get(server.url + "/readyz", timeout=30).json()
    finally:
        vllm.should_exit = True
        thread.join(timeout=10)
    [warning] = after["billing_warnings"]
    assert f"127.0.0.1:{port}" in warning and "--enable-prompt-tokens-details" in warning
    assert [r.getMessage() for r in caplog.records
            if r.name == "proxy.upstream.usage_report"] == [warning]
