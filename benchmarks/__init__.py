"""mm3's GPU benchmark harness (``mm3 bench``); see :mod:`.harness` and NOTES.md.

Installed with mm3 as the package ``mm3_benchmarks`` (``pyproject.toml`` maps
this folder), so ``mm3 bench`` works from an installed distribution. Nothing
in ``mm3`` imports it except that command, on first use: the core never
imports benchmark or platform code.
"""
