"""The docstring examples of the built-in backends, the benchmark harness and the example plugin run.

``mm3/`` is collected by ``--doctest-modules`` (pyproject.toml). The folders
below install under other names (``backends/`` as ``mm3_backends``,
``benchmarks/`` as ``mm3_benchmarks``), so their examples are run here, by
the names users import them under.
"""

from __future__ import annotations

import doctest
import importlib
import io
import sys
from pathlib import Path

import pytest

EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "examples" / "third_party_backend" / "src"

ROOT = Path(__file__).resolve().parents[1]


def _with_examples(folder: str, package: str) -> list[str]:
    """Every module of ``folder`` (installed as ``package``) whose source holds an example: found, not
    listed, so a new module's examples cannot be left out (a list here once missed six)."""
    names = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            names.append(".".join((package, *parts)).removesuffix(".__init__"))
    return names


MODULES = [*_with_examples("backends", "mm3_backends"), *_with_examples("benchmarks", "mm3_benchmarks"),
           "mm3_sdpa_sparse", "mm3_sdpa_sparse.plugin", "mm3_sdpa_sparse.attention"]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if name.startswith("mm3_sdpa_sparse"):
        monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = doctest.DocTestFinder().find(module)
    for test in tests:
        runner.run(test, out=out.write)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted, f"{name} has no examples: drop it from MODULES"
    assert not failed, out.getvalue()
