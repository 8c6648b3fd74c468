"""mm3's GPU benchmark harness (``mm3 bench``); see :mod:`benchmarks.harness` and NOTES.md.

Not part of the installed ``mm3`` package: ``mm3 bench`` loads this folder by
path from a checkout (or from ``MM3_BENCH_HARNESS``), so the core never
imports benchmark or platform code.
"""
