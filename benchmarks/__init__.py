"""mm3's GPU benchmark harness (``mm3 bench``); see :mod:`.harness`, BENCHMARKS.md and docs/performance.md.

Installed with mm3 as the package ``mm3_benchmarks`` (``pyproject.toml`` maps
this folder), so ``mm3 bench`` works from an installed distribution. Nothing
in ``mm3`` imports it except that command, on first use: the core never
imports benchmark or platform code.
"""
