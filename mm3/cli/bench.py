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
import re
import sys
from types import ModuleType

__all__ = ["add_arguments", "run", "load_harness", "cpu_notice", "PACKAGE"]

PACKAGE = "mm3_benchmarks"


def load_harness() -> ModuleType:
    """The harness module, ``mm3_benchmarks.harness``, imported on first use."""
    return importlib.import_module(f"{PACKAGE}.harness")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    load_harness().add_arguments(parser)


def cpu_notice(args: argparse.Namespace, harness: ModuleType) -> str:
    """What a full run on the CPU is about to do, said before it starts (it runs for a long time).

    Example:
        >>> ap = argparse.ArgumentParser(); add_arguments(ap)
        >>> print(cpu_notice(ap.parse_args(["--device", "cpu", "--only", "decode TP8 b1 ctx8K"]),
        ...                  load_harness()).splitlines()[0])
        mm3 bench: no GPU in use (device cpu). The full grid is MiniMax-M3 shapes for an H200:
    """
    grid = [c for c in harness.full_grid()
            if c.priority <= args.max_priority and (not args.only or re.search(args.only, c.name))]
    return (f"mm3 bench: no GPU in use (device {args.device}). The full grid is MiniMax-M3 shapes for an H200:\n"
            f"  this run times {len(grid)} configuration(s) on the CPU, each with paged caches of up to "
            f"{args.pool_gb:g} GB, for minutes apiece;\n"
            f"  a line is printed as each one finishes (priority > 0 rows stop after --budget-s "
            f"{args.budget_s:g} s).\n"
            f"  For a check of the pipeline in seconds: mm3 bench --tiny. To pick rows: --only REGEX.")


def run(args: argparse.Namespace) -> int:
    import torch

    harness = load_harness()
    on_cpu = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu"
    if args.tiny:
        # Tiny shapes check the pipeline; a copy and a matmul of such sizes say nothing about a device.
        args.no_ceilings = True
    elif on_cpu:
        args.device = args.device or "cpu"
        print(cpu_notice(args, harness), file=sys.stderr, flush=True)
    return int(harness.run(args))
