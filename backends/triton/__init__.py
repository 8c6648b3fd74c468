"""Stride-generic Triton kernels shared by the GPU plugins (``cuda``, ``rocm``); no plugin here.

* :mod:`.indexer` - decode and prefill indexers (docs/spec.md §3);
* :mod:`.attention` - decode (flash-decoding) and prefill block-sparse attention (docs/spec.md §4);
* :mod:`.launch` - per-platform launch configurations and shape-only grid heuristics;
* :mod:`.checks` - input validation at the plugin boundary;
* :mod:`.plugin_factory` - builds a plugin's hooks from a :class:`TritonPluginSpec`.

Importing this package does not import Triton: the kernel modules load on
first use, after ``TRITON_INTERPRET`` has had its chance to be set.
"""

from .launch import LaunchConfig
from .plugin_factory import TritonPluginSpec, make_hookimpls

__all__ = ["LaunchConfig", "TritonPluginSpec", "make_hookimpls"]
