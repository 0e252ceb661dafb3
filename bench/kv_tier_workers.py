"""Part (b) and (c) of :mod:`bench.kv_tier` on real worker processes.

Three fleets of 2 ``kvtoll worker`` subprocesses each (the real model, small pools
of ``--pool-blocks``): tier off, tier 2 only (``--kv-tier-mb``), tier 2 + shared
(``--kv-tier-mb … --kv-shared redis``, Redis from ``KVTOLL_REDIS_URL``). All six run
for the whole measurement and every trace request is sent to each fleet in turn
(the machine's load varies alike for all three), alternating between the fleet's two
workers (round robin: a conversation's next turn usually lands on the other worker).
Requests go over HTTP (``/v1/completions``, token-id prompts, streamed with usage):
TTFT is the time to the first streamed token, the cached tokens and the tier that
served them come from the usage (``prompt_tokens_details``). Between requests the
bench waits until each worker's write-behind queue is empty
(``kvtoll_kv_tier_write_queue_blocks``, bounded), as an idle gap between turns would.

The workers run in dev mode without a worker token, so they do not announce
themselves in Redis; the tenant salt is fresh per run (no block from an earlier run
can be hit) and its shared-tier keys are deleted at the end.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

FLEETS: dict[str, list[str]] = {
    "tier_off": [],
    "tier2": ["--kv-tier-mb", "{mb}"],
    "tier2_shared": ["--kv-tier-mb", "{mb}", "--kv-shared", "redis"],
}


@dataclass
class Worker:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Any = field(default=None)
    model: str = ""  # what it answers to (GET /v1/models), once ready


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(name: str, flags: list[str], pool_blocks: int, redis_url: str, logdir: str) -> Worker:
    port = _free_port()
    cmd = [sys.executable, "-c", "from kvtoll.cli.main import main; main()", "worker",
           "--port", str(port),
           "--num-blocks", str(pool_blocks), "--max-model-len", "1024",
           "--max-batched-tokens", "512", *flags]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTOLL_WORKER_TOKEN")}
    env.update(KVTOLL_DEV_MODE="1", KVTOLL_LOG_LEVEL="warning", KVTOLL_REDIS_URL=redis_url)
    log = open(os.path.join(logdir, f"{name}.log"), "wb")  # noqa: SIM115 - closed in _stop
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Worker(name, f"http://127.0.0.1:{port}", proc, log)


def _wait_ready(workers: list[Worker], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(workers)
    while pending:
        for w in list(pending):
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.name} exited {w.proc.returncode}; see its log")
            try:
                if httpx.get(f"{w.url}/healthz", timeout=2).status_code == 200:
                    models = httpx.get(f"{w.url}/v1/models", timeout=10).json()
                    w.model = models["data"][0]["id"]
                    pending.remove(w)
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready: {[w.name for w in pending]}")
        time.sleep(0.5)


def _stop(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        if w.log is not None:
            w.log.close()


@contextmanager
def fleets(pool_blocks: int, tier_mb: int, redis_url: str, logdir: str) -> Iterator[
        dict[str, list[Worker]]]:
    """The three fleets of two worker processes, ready; stopped on exit."""
    started: dict[str, list[Worker]] = {}
    try:
        for name, flags in FLEETS.items():
            args = [f.format(mb=tier_mb) for f in flags]
            started[name] = [_start(f"{name}-{i}", args, pool_blocks, redis_url, logdir)
                             for i in range(2)]  # fmt: skip
        _wait_ready([w for ws in started.values() for w in ws])
        yield started
    finally:
        _stop([w for ws in started.values() for w in ws])


def ask(client: httpx.Client, w: Worker, prompt: list[int], salt: str,
        max_tokens: int = 4) -> tuple[float, int, dict[str, int] | None]:  # fmt: skip
    """(TTFT s, cached tokens, the tier split) of one streamed completion."""
    body = {"model": w.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    with client.stream("POST", f"{w.url}/v1/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{w.name}: {resp.status_code} {resp.read()!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c.get("text") for c in event.get("choices") or []):
                first = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    if first is None:  # no text at all (a token that decodes to nothing): end of stream
        first = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    return first, int(details.get("cached_tokens") or 0), details.get("kvtoll_tier_cached_tokens")


def metrics(client: httpx.Client, w: Worker) -> dict[str, float]:
    text = client.get(f"{w.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvtoll_kv_tier"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def settle(client: httpx.Client, workers: list[Worker], timeout_s: float = 10.0) -> None:
    """Wait until the workers' write-behind queues are empty (at most ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        while metrics(client, w).get("kvtoll_kv_tier_write_queue_blocks", 0) > 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)


def run_trace(prompts: list[list[int]], pool_blocks: int, tier_mb: int, redis_url: str,
              salt: str, logdir: str) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """(b) results per fleet and (c) each tiered worker's tier metrics."""
    total = sum(len(p) for p in prompts)
    out: dict[str, Any] = {"requests": len(prompts), "pool_blocks": pool_blocks,
                           "workers": "2 kvtoll worker processes per configuration"}  # fmt: skip
    with fleets(pool_blocks, tier_mb, redis_url, logdir) as fl, httpx.Client() as client:
        for ws in fl.values():  # warm-up: first-use compilation, a foreign salt
            for i, w in enumerate(ws):
                ask(client, w, [1000 + i + j for j in range(40)], salt[::-1])
        ttfts: dict[str, list[float]] = {name: [] for name in fl}
        cached = dict.fromkeys(fl, 0)
        tiers = {name: {"host": 0, "shared": 0} for name in fl}
        for i, prompt in enumerate(prompts):
            for name, ws in fl.items():
                t, c, tier = ask(client, ws[i % 2], prompt, salt)
                if name != "tier_off":
                    settle(client, ws)
                ttfts[name].append(t)
                cached[name] += c
                for k in ("host", "shared"):
                    tiers[name][k] += int((tier or {}).get(k, 0))
        tier_metrics = {w.name: metrics(client, w) for name in ("tier2", "tier2_shared")
                        for w in fl[name]}  # fmt: skip
    for name in ttfts:
        out[name] = {"prefix_hit_ratio": round(cached[name] / total, 4),
                     "mean_ttft_s": round(statistics.mean(ttfts[name]), 4),
                     "cached_tokens": cached[name], "tier_cached_tokens": tiers[name]}
    off = out["tier_off"]
    for name in ("tier2", "tier2_shared"):
        out[name]["hit_ratio_vs_off"] = round(
            out[name]["prefix_hit_ratio"] / max(off["prefix_hit_ratio"], 1e-9), 3)
        out[name]["mean_ttft_vs_off"] = round(out[name]["mean_ttft_s"] / off["mean_ttft_s"], 3)
    return out, tier_metrics
