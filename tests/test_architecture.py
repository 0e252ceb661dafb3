"""Package directions, read from the source (ARCHITECTURE.md; import circles:
``tests/test_import_graph.py``).

Allowed: ``kvtoll`` (core) imports none of ours; billing and engine import core;
web imports billing and core; migrations import billing and core; proxy imports
billing, core, web, and the engine only through its client API (``engine.api``) and
the block-hash function (``engine.kv.hashing``). ``bench`` and ``tests`` sit above
everything. Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ("kvtoll", "engine", "billing", "web", "migrations", "proxy")
ALLOWED: dict[str, frozenset[str]] = {
    "kvtoll": frozenset(),
    "engine": frozenset({"kvtoll"}),
    "billing": frozenset({"kvtoll"}),
    "web": frozenset({"kvtoll", "billing"}),
    "migrations": frozenset({"kvtoll", "billing"}),
    "proxy": frozenset({"kvtoll", "billing", "web", "engine"}),
}
# The only engine modules the gateway may import: the client API and the block hashes.
PROXY_ENGINE_API = ("engine.api", "engine.kv.hashing")


def imports_of(source: str, module: str) -> Iterator[str]:
    """Absolute names of the modules ``source`` (module ``module``) imports."""
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            yield name
            yield from (f"{name}.{alias.name}" for alias in node.names)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in RUNTIME
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def violations(module: str, imported: str) -> str | None:
    """Why ``module`` may not import ``imported``, or None if it may."""
    source, target = module.split(".")[0], imported.split(".")[0]
    if target == source or target not in (*RUNTIME, "bench", "tests"):
        return None
    if target not in ALLOWED[source]:
        return f"{source} may not import {target}"
    if source == "proxy" and target == "engine" and not any(
        imported == api or imported.startswith(api + ".") for api in PROXY_ENGINE_API
    ):
        return f"the gateway reaches the engine only through {' or '.join(PROXY_ENGINE_API)}"
    return None


def test_packages_import_only_in_the_allowed_directions() -> None:
    found = {
        f"{module} -> {imported}: {why}"
        for module, path in runtime_modules().items()
        for imported in imports_of(path.read_text(), module)
        if (why := violations(module, imported))
    }
    assert sorted(found) == []


@pytest.mark.parametrize(
    ("module", "imported"),
    [
        ("engine.cli", "proxy.stack"),
        ("billing.cli", "engine.config"),
        ("web.app", "proxy.app"),
        ("kvtoll.cli.main", "billing.cli"),
        ("proxy.stack", "engine.factory"),
        ("migrations.env", "web.app"),
    ],
)
def test_a_wrong_import_is_caught(module: str, imported: str) -> None:
    assert violations(module, imported) is not None


def test_the_allowed_seams_pass() -> None:
    assert violations("proxy.service", "engine.api.convert") is None
    assert violations("proxy.routing.router", "engine.kv.hashing") is None
    assert violations("web.app", "billing.usage") is None
    assert violations("engine.cli", "kvtoll.settings") is None
