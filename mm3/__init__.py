"""mm3: MiniMax-M3-style block-sparse attention on any hardware through pluggable backends.

The public face. Behind it, in layers that only import downwards:

* :mod:`mm3.contract` - what a backend implements and receives (hooks,
  capabilities, buffers, batch, params, checks, errors);
* :mod:`mm3.debug` - the opt-in contract guard;
* :mod:`mm3.runtime` - discovery, the bound backends, registry, settings,
  selection, the composed layer, tensor parallelism;
* :mod:`mm3.testing` - oracle, factories, mock backend, conformance suite;
* :mod:`mm3.cli` - the ``mm3`` command.

Example:
    >>> import mm3
    >>> p = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
    >>> layer = mm3.SparseAttention(p, max_num_tokens=64, backend="cpu_ref")
    >>> layer.selection.attention.name
    'cpu_ref'
"""

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.capabilities import BackendCapabilities, Probe, Requirements
from mm3.contract.errors import (
    BackendUnavailableError, ConfigError, ContractViolation, InputError, MM3Error, NoBackendError,
    PluginError, UnknownBackendError,
)
from mm3.contract.hookspecs import hookimpl, hookspec
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.backend import Backend
from mm3.runtime.config import Settings, explain_settings
from mm3.runtime.distributed import (
    RankShard, TensorParallelSparseAttention, all_rank_shards, concat_heads, gather_heads, rank_shard,
    shard_params,
)
from mm3.runtime.layer import SparseAttention
from mm3.runtime.registry import Registry, default_registry, reset_default_registry
from mm3.runtime.scope import use_backend
from mm3.runtime.selection import Selection, requirements_for, select

__version__ = "0.1.0"

__all__ = [
    # the composed op and what a step is made of
    "SparseAttention", "SparseAttentionParams", "BatchMetadata", "PagedKVCache", "TopkBuffer",
    # choosing backends
    "use_backend", "Settings", "explain_settings", "select", "requirements_for", "Selection",
    "Registry", "default_registry", "reset_default_registry", "Backend",
    # writing a backend
    "hookimpl", "hookspec", "BackendCapabilities", "Requirements", "Probe",
    # tensor parallelism
    "TensorParallelSparseAttention", "RankShard", "rank_shard", "all_rank_shards", "shard_params",
    "concat_heads", "gather_heads",
    # errors
    "MM3Error", "InputError", "ConfigError", "UnknownBackendError", "BackendUnavailableError",
    "NoBackendError", "PluginError", "ContractViolation",
    "__version__",
]
