"""``mm3 bench``: the benchmark harness of a source checkout, loaded by path.

The harness lives in the repository's ``benchmarks/`` folder, not in the
installed package: it times vendor kernels against vendor peers and is free
to ask which device it runs on, which the core never does. This command finds
that folder and hands over to ``benchmarks.harness``. Search order:

1. ``MM3_BENCH_HARNESS`` (a path to the ``benchmarks`` folder);
2. ``benchmarks/`` next to this package's parent (a source checkout);
3. ``benchmarks/`` in the current directory.

Example:
    $ mm3 bench --tiny --out /tmp/bench        # whole pipeline on tiny shapes, CPU is fine
    $ mm3 bench --out results/                  # the full GPU run (ceilings, decode, prefill, peers)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

from mm3.contract.errors import MM3Error

__all__ = ["add_arguments", "run", "find_harness", "load_harness"]

ENV = "MM3_BENCH_HARNESS"
PACKAGE = "mm3_benchmarks"


class HarnessNotFound(MM3Error):
    """No ``benchmarks/`` folder could be found."""


def find_harness() -> Path:
    """The ``benchmarks`` folder to load (see the module docstring for the order)."""
    candidates = []
    env = os.environ.get(ENV)
    if env:
        candidates.append(Path(env))
    candidates += [Path(__file__).resolve().parents[1] / "benchmarks", Path.cwd() / "benchmarks"]
    for c in candidates:
        if (c / "harness.py").is_file() and (c / "__init__.py").is_file():
            return c
    raise HarnessNotFound(
        f"mm3 bench needs the benchmarks/ folder of an mm3 source checkout (looked in "
        f"{', '.join(str(c) for c in candidates)}); run it from the checkout or set {ENV}=/path/to/benchmarks")


def load_harness(folder: Optional[Path] = None) -> ModuleType:
    """Import ``folder`` as the package ``mm3_benchmarks`` and return its ``harness`` module."""
    folder = folder or find_harness()
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        if spec is None or spec.loader is None:
            raise HarnessNotFound(f"cannot load {folder} as a package")
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{PACKAGE}.harness")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    load_harness().add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return int(load_harness().run(args))
