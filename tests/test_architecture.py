"""Package directions and import cycles, read from the source (ARCHITECTURE.md).

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
        ("engine.cli", "proxy.settings"),
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


def _graph() -> dict[str, set[str]]:
    modules = runtime_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for imported in imports_of(path.read_text(), module):
            # "from a.b import c" names a.b.c, which is a module or a name in a.b.
            name = imported if imported in modules else imported.rsplit(".", 1)[0]
            if name in modules and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_modules() -> None:
    # A package's __init__ re-exporting its submodules is not a cycle of concerns.
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in _graph().items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
