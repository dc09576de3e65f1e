"""The package's layers import only downward, and no module imports itself back through others.

Every ``import`` counts: module level, inside functions and under ``TYPE_CHECKING`` alike, since a function-local
import is still a dependency and only hides a cycle. See ``docs/ARCHITECTURE.md`` for the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module may import from its own layer (siblings such as ``hf`` -> ``model``) or any layer below.
LAYERS: list[set[str]] = [
    {"config"},
    {"model", "devices", "frames", "wire", "data", "hf", "inference", "interop", "optim", "compression", "sentinel", "trust",
     "presets", "plan"},
    {"net"},
    {"client"},
    {"server"},
    {"ops"},
    {"roles"},
    {"lab"},
    {"bench"},
    {"cli"},
]


def layer_of(module: str) -> int:
    parts = module.split(".")
    if parts == ["agora"]:
        return len(LAYERS)  # the package's __init__ sits above everything (it imports nothing today)
    for index, names in enumerate(LAYERS):
        if parts[1] in names:
            return index
    raise AssertionError(f"module {module} belongs to no layer: add its package to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "agora").rglob("*.py"))}


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The agora modules ``module`` imports anywhere in its file (``from a import b`` counts ``a.b`` when that is
    a module, else ``a``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == "agora" or name.startswith("agora."):
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules)
    # Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, but those are their own modules: only the
    # named module is an edge, so a package's __init__ re-exporting a submodule is not a cycle with it.
    return {name: imported(name, path, known) for name, path in modules.items()}


def test_every_module_has_a_layer():
    for name in all_modules():
        layer_of(name)


def test_imports_only_go_down():
    upward = []
    for module, targets in import_graph().items():
        for target in sorted(targets):
            if target == "agora":
                continue
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("source, expected", [
    ("from agora.net import transport\n", {"agora.net.transport"}),
    ("def f():\n    from agora.server.node import StageNode\n", {"agora.server.node"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agora.ops import metrics\n", {"agora.ops.metrics"}),
    ("from ..wire import Boundary\n", {"agora.wire"}),
    ("import torch\nfrom agora.config import Manifest, load_manifest\n", {"agora.config"}),
])
def test_import_parser_sees_every_kind_of_import(tmp_path, source, expected):
    """The checker itself: function-level, TYPE_CHECKING and relative imports all count."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    known = set(all_modules())
    assert imported("agora.net.probe", path, known) == expected
