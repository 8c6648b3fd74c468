"""Stride-generic Triton kernels shared by the GPU plugins (``cuda``, ``rocm``); no plugin here.

* :mod:`.indexer` - decode and prefill indexers (docs/spec.md §3);
* :mod:`.attention` - decode (flash-decoding) and prefill block-sparse attention (docs/spec.md §4);
* :mod:`.launch` - per-platform launch configurations and shape-only grid heuristics;
* :mod:`.checks` - what the plugins check themselves (device, index query dtype);
* :mod:`.plugin_factory` - builds a plugin's hooks from a :class:`TritonPlatform`.

Importing this package does not import Triton: the kernel modules load on
first use, after ``TRITON_INTERPRET`` has had its chance to be set.
"""

from .launch import LaunchConfig
from .plugin_factory import TritonPlatform, make_hookimpls

__all__ = ["LaunchConfig", "TritonPlatform", "make_hookimpls"]
