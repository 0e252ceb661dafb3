"""The other gateways that ``proxy_overhead.py`` measures beside kvtoll, in the same run.

The issue reads kvtoll's added latency against figures measured elsewhere on localhost
(Bifrost 0.44 ms, Portkey 2.37 ms, LiteLLM 4.34 ms p50). A single time on this shared
2-core machine says little; the same gateway measured in the same run, in front of the
same upstream, does. So each peer that ``bench/install_peers.sh`` installed under
``.bench-peers/`` is started here, pointed at the bench's fixed-latency upstream, and
called like kvtoll is::

    portkey   Portkey's open-source gateway (Node.js): the OpenAI provider with the
              upstream as its custom host, headers x-portkey-provider / -custom-host
    litellm   the LiteLLM proxy (Python, its own venv): one model entry whose api_base
              is the upstream, a master key, no database (so no spend tracking)

Each is run as its documentation starts it, with its default logging; what it does per
request differs from kvtoll (neither meters into a ledger nor rate-limits here), which
the figures leave as it is: this is what a user who swaps one gateway for another sees.
Bifrost is not among them: its npm launcher downloads a Go binary from its own site,
which this machine cannot reach.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / ".bench-peers"
# p50 added latency the issue quotes, measured elsewhere on localhost (ms)
REFERENCE_ADDED_P50_MS = {"bifrost": 0.44, "portkey": 2.37, "litellm": 4.34}
LITELLM_MASTER_KEY = "sk-bench-0123456789abcdef0123456789abcdef"


@dataclass(frozen=True)
class PeerLaunch:
    """How to start one peer gateway and call it."""

    name: str
    argv: list[str]
    headers: dict[str, str]
    health_path: str
    env: dict[str, str] = field(default_factory=dict)


def portkey(port: int, upstream_url: str, work_dir: Path) -> PeerLaunch | str:
    """Portkey's gateway, or why it cannot run here."""
    script = PEER_DIR / "portkey/node_modules/@portkey-ai/gateway/build/start-server.js"
    node = shutil.which("node")
    if node is None:
        return "node is not on PATH"
    if not script.exists():
        return f"not installed ({script} missing; run bench/install_peers.sh)"
    return PeerLaunch(
        "portkey",
        [node, str(script), f"--port={port}", "--headless"],
        {
            "x-portkey-provider": "openai",
            "x-portkey-custom-host": upstream_url + "/v1",
            "Authorization": "Bearer sk-bench",
        },
        "/",
    )


def litellm(port: int, upstream_url: str, work_dir: Path) -> PeerLaunch | str:
    """The LiteLLM proxy, or why it cannot run here."""
    binary = PEER_DIR / "litellm/bin/litellm"
    if not binary.exists():
        return f"not installed ({binary} missing; run bench/install_peers.sh)"
    config = work_dir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: fixed-latency\n"
        "    litellm_params:\n"
        "      model: openai/fixed-latency\n"
        f"      api_base: {upstream_url}/v1\n"
        "      api_key: sk-bench\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_MASTER_KEY}\n"
    )
    return PeerLaunch(
        "litellm",
        [
            str(binary),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        {"Authorization": f"Bearer {LITELLM_MASTER_KEY}"},
        "/health/liveliness",
        # the model cost map from the package, not from GitHub; no usage telemetry
        {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"},
    )


LAUNCHERS = {"portkey": portkey, "litellm": litellm}


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_seconds(pid: int, *, descendants: bool = True) -> float:
    """User + system CPU seconds of ``pid`` and (unless ``descendants`` is False) of every
    live descendant: a peer may run its server in a child process. One read of /proc."""
    if not descendants:
        stat = _stat(str(pid))
        return 0.0 if stat is None else stat[1]
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        stat = _stat(entry) if entry.isdigit() else None
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry))
            cpu[int(entry)] = stat[1]
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += cpu.get(current, 0.0)
        todo.extend(children.get(current, []))
    return total
