"""The shape of mm3/: five layers that only import downwards, no import cycle, small modules.

=========  ================================================  ====================
rank       packages                                          may import
=========  ================================================  ====================
0          ``mm3.contract``                                  itself
1          ``mm3.debug``                                     + contract
2          ``mm3.runtime``                                   + debug
3          ``mm3.testing``                                   + runtime
4          ``mm3`` (the public face) and ``mm3.cli``         everything
=========  ================================================  ====================

Edges are the import statements of each module, wherever they stand (a
function-level import is still an arrow), except those under
``if TYPE_CHECKING:``, which never run. docs/architecture.md draws the same map.
(That importing mm3 loads no backend, benchmark or Triton code:
tests/test_guard_rails.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

CORE = Path(__file__).resolve().parents[1] / "mm3"
MAX_LINES = 450
RANKS = {"mm3.contract": 0, "mm3.debug": 1, "mm3.runtime": 2, "mm3.testing": 3, "mm3.cli": 4, "mm3": 4}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """The mm3 modules ``path`` imports (a name imported from a package is its submodule when one exists)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mm3")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "mm3":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _rank(module: str) -> int:
    return max((rank, len(prefix)) for prefix, rank in RANKS.items()
               if module == prefix or module.startswith(prefix + "."))[0]


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}            # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_can_fail() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _imports(CORE / "runtime" / "layer.py") >= {"mm3.runtime.registry", "mm3.debug.guard"}


def test_mm3_has_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_import_points_down_the_layers() -> None:
    upward = [f"{src} (rank {_rank(src)}) imports {dst} (rank {_rank(dst)})"
              for src, targets in GRAPH.items() for dst in sorted(targets) if _rank(dst) > _rank(src)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_small(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (limit {MAX_LINES}): split it by concept"
