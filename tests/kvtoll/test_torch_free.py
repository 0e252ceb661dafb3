"""torch is imported only where tensors are made: the CLI, the gateway in front of
remote workers and importing proxy, billing or web never load it (each case runs in a
fresh interpreter and reports ``sys.modules``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RUN_CLI = """
import sys
from kvtoll.cli.main import main
for argv in {argvs!r}:
    sys.argv = ["kvtoll", *argv]
    try:
        main()
    except SystemExit:
        pass
"""

IMPORT_ALL = """
import importlib, pkgutil
for name in ("proxy", "billing", "web", "kvtoll"):
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(info.name)
"""

GATEWAY = """
import json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Worker(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "remote-model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Worker)
threading.Thread(target=server.serve_forever, daemon=True).start()
from kvtoll.settings import load_settings
from proxy.stack import ServeOptions, build_stack
url = f"http://127.0.0.1:{server.server_address[1]}"
stack = build_stack(load_settings(), ServeOptions(workers=(url,), semantic=SEMANTIC))
assert stack.model_names == ("remote-model",), stack.model_names
"""


def _loads_torch(code: str, env_dir: Path) -> bool:
    probe = code + "\nimport sys\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "KVTOLL_DEV_MODE": "1",
        "KVTOLL_DATABASE_URL": f"sqlite:///{env_dir / 'k.db'}",
        "KVTOLL_DATA_DIR": str(env_dir / "data"),
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(probe)], cwd=env_dir,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1] == "TORCH"


def test_the_probe_sees_torch(tmp_path: Path) -> None:
    assert _loads_torch("import engine.config", tmp_path)


@pytest.mark.parametrize(
    "argvs",
    [[["--help"]], [["db", "upgrade"], ["tenant", "create", "acme"], ["tenant", "list"]],
     [["key", "--help"]], [["invoice", "list"]], [["price", "list"]],
     [["db", "upgrade"], ["budget", "list"], ["invoice", "preview", "--tenant", "x"]]],
    ids=["help", "tenant", "key-help", "invoice-list", "price-list", "budget-list"],
)
def test_cli_commands_run_without_torch(argvs: list[list[str]], tmp_path: Path) -> None:
    assert not _loads_torch(RUN_CLI.format(argvs=argvs), tmp_path)


def test_importing_proxy_billing_and_web_loads_no_torch(tmp_path: Path) -> None:
    assert not _loads_torch(IMPORT_ALL, tmp_path)


def test_a_gateway_in_front_of_workers_loads_no_torch(tmp_path: Path) -> None:
    assert not _loads_torch("SEMANTIC = False\n" + GATEWAY, tmp_path)
