"""``mm3 bench``: the GPU benchmark harness, installed with mm3 as the package ``mm3_benchmarks``.

The harness lives in the repository's ``benchmarks/`` folder, which
``pyproject.toml`` installs as ``mm3_benchmarks`` (as ``backends/`` becomes
``mm3_backends``). It times vendor kernels against vendor peers and is free
to ask which device it runs on, which the core never does, so nothing in
``mm3`` imports it: this command loads it on first use.

Example:
    $ mm3 bench --tiny --out /tmp/bench        # whole pipeline on tiny shapes, CPU is fine
    $ mm3 bench --out results/                  # the full GPU run (ceilings, decode, prefill, peers)
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

__all__ = ["add_arguments", "run", "load_harness", "PACKAGE"]

PACKAGE = "mm3_benchmarks"


def load_harness() -> ModuleType:
    """The harness module, ``mm3_benchmarks.harness``, imported on first use."""
    return importlib.import_module(f"{PACKAGE}.harness")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    load_harness().add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return int(load_harness().run(args))
