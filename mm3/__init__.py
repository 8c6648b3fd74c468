"""mm3: MiniMax-M3-style block-sparse attention on any hardware through pluggable backends.

This is the engine's API: the layer, what a step is made of, the scoped
backend choice, the tensor-parallel layer and the errors. Backend authors
import from :mod:`mm3.plugin`. Everything else is internal and importable
from where it lives, in layers that only import downwards:

* :mod:`mm3.contract` - what a backend implements and receives (hooks,
  capabilities, buffers, batch, params, checks, errors);
* :mod:`mm3.debug` - the opt-in contract guard;
* :mod:`mm3.runtime` - discovery, the bound backends (``Backend``), the
  registry (``Registry``, ``default_registry``), settings (``Settings``),
  selection (``select``), the composed layer, tensor-parallel helpers;
* :mod:`mm3.testing` - oracle, factories, mock backend, conformance suite;
* :mod:`mm3.cli` - the ``mm3`` command.

Example:
    >>> import mm3
    >>> p = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
    >>> layer = mm3.SparseAttention(p, max_num_tokens=64, backend="cpu_ref")
    >>> layer.selection.attention.name
    'cpu_ref'
"""

import importlib as _importlib
import warnings as _warnings

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import (
    BackendUnavailableError, ConfigError, ContractViolation, InputError, MM3Error, NoBackendError,
    PluginError, UnknownBackendError,
)
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.distributed import TensorParallelSparseAttention
from mm3.runtime.layer import SparseAttention
from mm3.runtime.scope import use_backend

__version__ = "0.1.0"

__all__ = [
    # the layer and what a step is made of
    "SparseAttention", "SparseAttentionParams", "BatchMetadata", "PagedKVCache", "TopkBuffer",
    # choosing a backend for a block of code
    "use_backend",
    # tensor parallelism
    "TensorParallelSparseAttention",
    # errors
    "MM3Error", "InputError", "ConfigError", "UnknownBackendError", "BackendUnavailableError",
    "NoBackendError", "PluginError", "ContractViolation",
    "__version__",
]

# Names this module exported before it kept to the engine's API, and where they live now.
_MOVED = {
    **dict.fromkeys(["hookimpl", "BackendCapabilities", "Probe"], "mm3.plugin"),
    "hookspec": "mm3.contract.hookspecs",
    "Requirements": "mm3.contract.capabilities",
    **dict.fromkeys(["Settings", "explain_settings"], "mm3.runtime.config"),
    **dict.fromkeys(["select", "requirements_for", "Selection"], "mm3.runtime.selection"),
    **dict.fromkeys(["Registry", "default_registry", "reset_default_registry"], "mm3.runtime.registry"),
    "Backend": "mm3.runtime.backend",
    **dict.fromkeys(["RankShard", "rank_shard", "all_rank_shards", "shard_params", "concat_heads",
                     "gather_heads"], "mm3.runtime.distributed"),
}


def __getattr__(name: str) -> object:
    """A moved name still resolves, with a ``DeprecationWarning`` that says where it lives now."""
    if name not in _MOVED:
        raise AttributeError(f"module 'mm3' has no attribute {name!r}")
    home = _MOVED[name]
    _warnings.warn(f"mm3.{name} moved: import it from {home} (mm3 itself keeps the engine's API)",
                  DeprecationWarning, stacklevel=2)
    return getattr(_importlib.import_module(home), name)
