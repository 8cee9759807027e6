"""The package's imports point one way: no cycle, and the passes never import the pass manager, the backend or the
kernel layer (they insert ``torch.ops.nsa.*`` by name).

The graph is read from the source (``ast``), not by importing. It includes imports inside functions: a deferred
import is still a dependency at run time, and deferring one is the usual way to hide a cycle, which this test is
there to catch. Imports under ``if TYPE_CHECKING:`` never run and are left out. An edge goes to the module named
(``from .base import X`` -> ``patterns.base``; ``from . import x`` -> ``patterns.x`` when ``x`` is a module), not to
the parent packages Python initialises on the way, which every package with submodules would otherwise "cycle"
through.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "nsa_inductor"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import statements, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def edges(name: str, path: pathlib.Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: edges(name, path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_is_read():
    assert f"{PACKAGE}.patterns.base" in GRAPH[f"{PACKAGE}.pass_manager"] | GRAPH[f"{PACKAGE}.patterns"]
    assert f"{PACKAGE}.patterns" in GRAPH[f"{PACKAGE}.pass_manager"]
    assert f"{PACKAGE}.patterns.base" in GRAPH[f"{PACKAGE}.patterns.topk_indices"]


def test_import_graph_is_acyclic():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith(f"{PACKAGE}.patterns")))
def test_passes_import_neither_the_manager_nor_the_kernels(name):
    forbidden = {f"{PACKAGE}.pass_manager", f"{PACKAGE}.backend"}
    bad = {m for m in GRAPH[name] if m in forbidden or m.startswith(f"{PACKAGE}.lowering")}
    assert not bad, f"{name} imports {sorted(bad)}"
