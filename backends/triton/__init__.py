"""Stride-generic Triton kernels shared by the GPU plugins (``cuda``, ``rocm``); no plugin here.

* :mod:`.indexer` - decode and prefill indexers (docs/spec.md §3);
* :mod:`.attention` - decode (flash-decoding) and prefill block-sparse attention (docs/spec.md §4);
* :mod:`.nvfp4` - NVFP4 K/V and index-key tiles unpacked on chip (docs/spec.md §1);
* :mod:`.launch` - :class:`LaunchConfig` (groups the configs below) and the shape-only grid heuristics;
* :mod:`.kernel_configs`, :mod:`.prefill_config` - tile sizes, warps and stages per kernel family;
* :mod:`.algorithms` - which kernel variants run, and the kernels' numerics;
* :mod:`.interpreter_config` - a plugin's launch config under Triton's CPU interpreter (small tiles);
* :mod:`.interpreter`, :mod:`.interpreter_speed` - the interpreter made to compute bf16 as a GPU does,
  and exact shortcuts through it (applied under it);
* :mod:`.compat` - every private internal of Triton the modules here rely on, checked per release;
* :mod:`.checks` - what the plugins check themselves (device, index query dtype);
* :mod:`.plugin_factory` - builds a plugin's hooks from a :class:`TritonPlatform`;
* :mod:`.fast_launch`, :mod:`.plans`, :mod:`.scratch`, :mod:`.arrivals` - host time of a launch
  (the one launch function: direct launches and a recording of launches; launch parameters kept per
  shape class, kept scratch, last-program counters).

No module here knows a platform: each plugin (``backends/cuda``, ``backends/rocm``)
owns its launch config (``tuning.py``) and says which launch options apply.

Importing this package does not import Triton: the kernel modules load on
first use, after ``TRITON_INTERPRET`` has had its chance to be set.
"""

from .launch import LaunchConfig, override
from .plugin_factory import TritonPlatform, make_hookimpls

__all__ = ["LaunchConfig", "override", "TritonPlatform", "make_hookimpls"]
