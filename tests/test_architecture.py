"""The shape of the installed packages: who may import whom, no import cycle, small modules.

mm3/ is five layers that only import downwards:

=========  ================================================  ====================
rank       packages                                          may import
=========  ================================================  ====================
0          ``mm3.contract``                                  itself
1          ``mm3.debug``                                     + contract
2          ``mm3.runtime``                                   + debug
3          ``mm3.testing``                                   + runtime
4          ``mm3`` (the public face) and ``mm3.cli``         everything
=========  ================================================  ====================

Beside it, ``backends/`` (installed as ``mm3_backends``) and ``benchmarks/``
(``mm3_benchmarks``), with these rules (:func:`forbidden`):

* ``mm3`` imports no backend and no benchmark;
* a backend imports no other plugin and no benchmark; the shared Triton package
  (``mm3_backends.triton``) imports none of its users (``cuda``, ``rocm``) and
  not ``mm3.testing`` (the kit that checks backends is no part of one);
* nothing installed imports a module of ``tests/`` or ``tools/``, which are
  not installed;
* no import cycle between modules, anywhere in the three.

Edges are the import statements of each module, wherever they stand (a
function-level import is still an arrow), except those under
``if TYPE_CHECKING:``, which never run. The package rules also read the
imports of its docstrings' examples, which run as tests and are read as
documentation (they run after the module is imported, so they make no cycle
and may use the public face).
docs/architecture.md draws the same map. (That importing mm3 loads no
backend, benchmark or Triton code: tests/test_guard_rails.py.)
"""

from __future__ import annotations

import ast
import doctest
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "mm3"
MAX_LINES = 450
RANKS = {"mm3.contract": 0, "mm3.debug": 1, "mm3.runtime": 2, "mm3.testing": 3, "mm3.cli": 4, "mm3": 4}
#: repository folder -> the name it installs under (pyproject.toml's package-dir)
INSTALLED = {"mm3": "mm3", "backends": "mm3_backends", "benchmarks": "mm3_benchmarks"}
#: the top-level names of modules that are not installed: a module of them imported by an installed one
NOT_INSTALLED = {"tests", "tools", *(p.stem for folder in ("tests", "tools") for p in (ROOT / folder).rglob("*.py"))}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = INSTALLED[parts[0]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for folder in INSTALLED for p in sorted((ROOT / folder).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _example_trees(tree: ast.AST) -> list[ast.AST]:
    """The statements of every docstring example in ``tree`` (module, classes, functions), parsed."""
    parser, trees = doctest.DocTestParser(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for example in parser.get_examples(ast.get_docstring(node) or ""):
                try:
                    trees.append(ast.parse(example.source))
                except SyntaxError:   # a fragment of a longer statement: nothing it imports runs alone
                    continue
    return trees


def _imports(path: Path, name: Optional[str] = None, examples: bool = False) -> set[str]:
    """What module ``name`` (at ``path``) imports: installed modules by name (a name imported from a
    package is its submodule when one exists), and ``tests_or_tools.X`` for their modules; with
    ``examples``, what its docstrings' examples import instead."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(module: str, names: list[str]) -> None:
        top = module.split(".")[0]
        if top in NOT_INSTALLED:
            found.add(f"tests_or_tools.{module}")
        elif top in INSTALLED.values():
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            found.update(subs if subs and len(subs) == len(names) else [module, *subs])

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, [])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            add(base, [a.name for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    tree = ast.parse(path.read_text())
    for t in (_example_trees(tree) if examples else [tree]):
        visit(t)
    return found - {name}


GRAPH = {name: _imports(path, name) for name, path in MODULES.items()}
EXAMPLES = {name: _imports(path, name, examples=True) for name, path in MODULES.items()}


def _rank(module: str) -> int:
    return max((rank, len(prefix)) for prefix, rank in RANKS.items()
               if module == prefix or module.startswith(prefix + "."))[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def forbidden(src: str, dst: str) -> str:
    """Why installed module ``src`` may not import ``dst`` ('' when it may)."""
    if dst.startswith("tests_or_tools."):
        return "an installed module imports a module of tests/ or tools/, which are not installed"
    if _within(src, "mm3") and not _within(dst, "mm3"):
        return "mm3 imports no backend and no benchmark"
    if _within(src, "mm3_backends"):
        if _within(dst, "mm3_benchmarks"):
            return "a backend imports no benchmark"
        if _within(src, "mm3_backends.triton") and (_within(dst, "mm3_backends") and
                                                     not _within(dst, "mm3_backends.triton")):
            return "the shared Triton package imports none of its users"
        if _within(src, "mm3_backends.triton") and _within(dst, "mm3.testing"):
            return "the shared Triton package does not import the testing kit"
        if _within(dst, "mm3") and dst not in ("mm3", "mm3.plugin") and not _within(dst, "mm3.testing"):
            return "a backend imports mm3 through mm3.plugin, the face a third-party plugin author is given"
        plugin, target = src.split(".")[:2], dst.split(".")[:2]
        if target[0] == "mm3_backends" and len(target) > 1 and target != plugin and target[1] != "triton":
            return "a backend imports no other plugin"
    return ""


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


def test_the_checks_can_fail(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _imports(CORE / "runtime" / "layer.py") >= {"mm3.runtime.registry", "mm3.runtime.binding"}
    assert "mm3_backends.triton.launch" in GRAPH["mm3_backends.triton.attention"]   # relative imports
    assert forbidden("mm3_backends.triton.launch", "mm3_backends.cuda.plugin")
    assert forbidden("mm3_backends.triton.tl_utils", "mm3.testing.factories")
    assert forbidden("mm3_backends.cuda.plugin", "mm3_backends.rocm.tuning")
    assert forbidden("mm3_backends.cpu_ref.plugin", "mm3_benchmarks.harness")
    assert forbidden("mm3.runtime.layer", "mm3_backends.cpu_ref.plugin")
    assert not forbidden("mm3_backends.cuda.plugin", "mm3_backends.triton.plugin_factory")
    assert not forbidden("mm3_benchmarks.variants", "mm3_backends.cuda.plugin")
    # a docstring example's import is an edge; an installed module importing a test helper is caught
    fake = tmp_path / "mm3_backends_fake.py"
    fake.write_text('"""Doc.\n\n    >>> from mm3_backends.cuda.plugin import NVIDIA_LAUNCH\n"""\n'
                    "import decode_steps\n")
    code, docs = _imports(fake, "mm3_backends.triton.fake"), _imports(fake, "mm3_backends.triton.fake", True)
    assert (code, docs) == ({"tests_or_tools.decode_steps"}, {"mm3_backends.cuda.plugin"}), (code, docs)
    assert all(forbidden("mm3_backends.triton.fake", dst) for dst in code | docs)


def test_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_import_points_down_the_layers() -> None:
    core = {src: {d for d in dsts if _within(d, "mm3")} for src, dsts in GRAPH.items() if _within(src, "mm3")}
    upward = [f"{src} (rank {_rank(src)}) imports {dst} (rank {_rank(dst)})"
              for src, targets in core.items() for dst in sorted(targets) if _rank(dst) > _rank(src)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("where", ["code", "examples"])
def test_packages_import_only_what_they_may(where: str) -> None:
    graph = GRAPH if where == "code" else EXAMPLES
    bad = [f"{src} imports {dst}: {why}" for src, targets in graph.items() for dst in sorted(targets)
           if (why := forbidden(src, dst))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not _within(n, "mm3_benchmarks")))
def test_module_is_small(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (limit {MAX_LINES}): split it by concept"
