"""The engine package does not import the proxy (the proxy builds on the engine).

``engine/cli.py`` is the exception: it is a command of the root ``kvtoll`` CLI and
reads the shared settings and error helper from there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import engine

ALLOWED = {"cli.py"}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_engine_never_imports_the_proxy() -> None:
    root = Path(engine.__file__).parent
    offenders = {
        str(path.relative_to(root)): sorted(m for m in _imported_modules(path)
                                            if m == "proxy" or m.startswith("proxy."))
        for path in root.rglob("*.py")
        if str(path.relative_to(root)) not in ALLOWED
    }
    assert {k: v for k, v in offenders.items() if v} == {}
