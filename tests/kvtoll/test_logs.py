"""Worker polls log at DEBUG, faiss's build probes are quiet (kvtoll.logs)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvtoll.logs import POLL_LOGGERS, PollFilter, configure_logging, is_poll_line


@pytest.fixture
def restore_loggers() -> Iterator[None]:
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters))
             for n in (*POLL_LOGGERS, "faiss.loader", "")}
    yield
    for name, (level, filters) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.filters[:] = filters


def _httpx_line(url: str) -> None:  # the exact call httpx makes per request
    logging.getLogger("httpx").info('HTTP Request: %s %s "%s %d %s"', "GET", url, "HTTP/1.1",
                                    200, "OK")


def test_polls_go_to_debug_and_requests_stay_at_info(
    restore_loggers: None, caplog: pytest.LogCaptureFixture
) -> None:
    configure_logging("info")
    caplog.set_level(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.INFO)
    _httpx_line("http://10.0.0.5:9000/load")
    _httpx_line("http://10.0.0.5:9000/kv/events?after=12")
    _httpx_line("http://10.0.0.5:9000/v1/chat/completions")
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET",
                                             "/load", "1.1", 200)
    assert [r.getMessage() for r in caplog.records] == [
        'HTTP Request: GET http://10.0.0.5:9000/v1/chat/completions "HTTP/1.1 200 OK"'
    ]
    caplog.clear()
    logging.getLogger("httpx").setLevel(logging.DEBUG)
    caplog.set_level(logging.DEBUG)
    _httpx_line("http://10.0.0.5:9000/load")
    assert [(r.levelname, r.name) for r in caplog.records] == [("DEBUG", "httpx")]


def test_faiss_probe_misses_are_quiet_unless_debug(restore_loggers: None) -> None:
    configure_logging("info")
    assert not logging.getLogger("faiss.loader").isEnabledFor(logging.INFO)
    assert logging.getLogger("faiss.loader").isEnabledFor(logging.WARNING)


@pytest.mark.parametrize(("line", "poll"), [
    ("GET http://w:1/load", True), ("GET /kv/events?after=1 HTTP/1.1", True),
    ("GET http://w:1/loader", False), ("GET http://w:1/v1/models", False),
    ("POST /v1/chat/completions", False), ("GET http://w:1/v1/load-test", False),
])
def test_poll_lines(line: str, poll: bool) -> None:
    assert is_poll_line(line) is poll
    record = logging.LogRecord("httpx", logging.INFO, __file__, 1, line, None, None)
    assert PollFilter().filter(record) is (not poll)
