"""The package's import graph: no circle anywhere, and every arrow points down the layers.

Every import counts, wherever it stands (module top, function body, ``TYPE_CHECKING``): a lazy
import is still an arrow. Within a layer a module may import another; across layers only downwards.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

# Lowest first. A module belongs to the first entry its dotted name starts with (longest wins).
LAYERS: list[tuple[str, ...]] = [
    ("askonce.core",),
    ("askonce.errors", "askonce._stats", "askonce._context", "askonce._replies", "askonce._cli"),
    ("askonce.propagation", "askonce.verdict", "askonce.stores"),
    ("askonce._loop",),
    ("askonce.breakers", "askonce.retrying"),
    ("askonce",),  # the public facade: what an application imports
    ("askonce.client",),
    ("askonce.ledger",),
    ("askonce.integrations",),
    ("askonce.sim", "askonce.demo"),
    ("askonce.cli", "askonce.__main__"),
]


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # ``from askonce.x import y`` imports the module askonce.x.y when there is one
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{name} is in no layer: add it to LAYERS"
    return rank


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        _layer(name)


def test_no_import_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_arrows_point_down(name: str) -> None:
    up = sorted(t for t in GRAPH[name] if _layer(t) > _layer(name))
    assert up == [], f"{name} imports from a higher layer"


def test_the_core_does_no_io_and_never_sleeps() -> None:
    banned = {"asyncio", "socket", "time", "os", "subprocess", "select"}  # a lock is no I/O
    for name, path in MODULES.items():
        if not name.startswith("askonce.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not {m.split(".")[0] for m in mods} & banned, f"{name} imports {mods}"


def test_no_private_name_is_imported_across_modules() -> None:
    # A private module of one's own package (``from askonce.ledger import _redis``) is fine; a
    # private name from another module is a reach-in.
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("askonce"):
                for a in node.names:
                    target = f"{node.module}.{a.name}"
                    dunder = a.name.startswith("__") and a.name.endswith("__")
                    if a.name.startswith("_") and not dunder and target not in MODULES:
                        pytest.fail(f"{name} imports the private name {target}")
