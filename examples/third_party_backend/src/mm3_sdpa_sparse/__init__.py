"""mm3-sdpa-sparse: an attention-only mm3 backend on ``scaled_dot_product_attention``.

Installing this distribution is all it takes: mm3 finds the backend through
the ``mm3.backends`` entry point (see ``pyproject.toml``). Importing this
package is not needed and has no side effects.

Example:
    >>> from mm3.runtime.registry import default_registry
    >>> "torch_sdpa_sparse" in default_registry()     # doctest: +SKIP
    True
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__", "BACKEND_NAME", "DISTRIBUTION"]

BACKEND_NAME = "torch_sdpa_sparse"
DISTRIBUTION = "mm3-sdpa-sparse"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
