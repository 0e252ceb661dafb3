"""The chaos run's load (:mod:`bench.chaos`): client threads streaming chat
completions through the OpenAI SDK, each request's outcome as a :class:`Result`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.chaos_worker import MODEL

CLIENT_TIMEOUT_S = 30.0  # far past every gateway timeout: reaching it is a hang


@dataclass
class Result:
    started: float
    ended: float
    status: str  # "200", "cut", "conn_error", "502", ...
    request_id: str | None
    tokens: int
    worker: str | None = None


class Load:
    """``clients`` threads streaming chat completions through the OpenAI SDK."""

    def __init__(self, gateway: str, key: str, max_tokens: int, clients: int) -> None:
        self._gateway, self._key, self._max_tokens = gateway, key, max_tokens
        self._stop = threading.Event()
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._mid_stream = 0  # streams that received a token and have not ended
        self._streaming = threading.Condition(self._lock)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def wait_mid_stream(self, timeout_s: float) -> bool:
        """Wait until some stream has received a token and not ended (so a fault
        injected now cuts a live stream); False if none did within ``timeout_s``."""
        with self._streaming:
            return self._streaming.wait_for(lambda: self._mid_stream > 0, timeout_s)

    def _note_streaming(self, live: bool) -> None:
        with self._streaming:
            self._mid_stream += 1 if live else -1
            self._streaming.notify_all()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self._gateway + "/v1", api_key=self._key,
                               max_retries=0, timeout=CLIENT_TIMEOUT_S)
        while not self._stop.is_set():
            result = one_request(client, self._max_tokens, self._note_streaming)
            with self._lock:
                self.results.append(result)
            if result.status == "conn_error":
                time.sleep(0.05)


def one_request(client: Any, max_tokens: int = 16,
                streaming: Callable[[bool], None] | None = None) -> Result:
    """One streamed request: its status, request id, tokens received and worker;
    ``streaming(True)`` at its first token and ``streaming(False)`` when it ends."""
    import openai

    started = time.monotonic()
    request_id, tokens, status, worker = None, 0, "conn_error", None
    live = False
    try:
        with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "chaos"}], stream=True,
            max_tokens=max_tokens, stream_options={"include_usage": True},
        ) as response:
            request_id = response.headers.get("x-kvtoll-request-id")
            worker = response.headers.get("x-kvtoll-worker")
            status = "cut"
            done = errored = False
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errored = True
                    continue
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        tokens += 1
                        if not live and streaming is not None:
                            live = True
                            streaming(True)
            if done and not errored:
                status = "200"
    except openai.APIStatusError as exc:
        status = str(exc.status_code)
        request_id = exc.response.headers.get("x-kvtoll-request-id")
    except openai.APITimeoutError:  # the client gave up: a hang (CLIENT_TIMEOUT_S)
        status = "client_timeout"
    except Exception:  # the connection broke (the SDK's transport raises its own types)
        status = "cut" if request_id else "conn_error"
    finally:
        if live and streaming is not None:
            streaming(False)
    return Result(started, time.monotonic(), status, request_id, tokens, worker)
