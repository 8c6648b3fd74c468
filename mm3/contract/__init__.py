"""The contract: what a backend implements and what it receives.

Everything a plugin author needs lives here, and nothing here knows about
discovery, selection or configuration (those are :mod:`mm3.runtime`'s):

* :mod:`.hookspecs` - the pluggy hook specifications and markers;
* :mod:`.capabilities` - what a backend declares (:class:`BackendCapabilities`),
  what a call needs (:class:`Requirements`) and the probe answer (:class:`Probe`);
* :mod:`.buffers` - :class:`TopkBuffer` and :class:`PagedKVCache`, tensors that carry their layout;
* :mod:`.batch` - :class:`BatchMetadata`, the decode-first mixed batch;
* :mod:`.params` - :class:`SparseAttentionParams`, the layer's shapes and policy;
* :mod:`.facts` - what a call's argument checks read, one value (and what a batch, a cache and a
  top-k buffer work out about themselves);
* :mod:`.checks` - the argument checks of a step, over its facts;
* :mod:`.contents` - the data checks of a step (lengths, positions, page ids), on the host or the device;
* :mod:`.errors` - the exceptions.
"""

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import TORCH_DTYPES, PagedKVCache, TopkBuffer, dtype_name
from mm3.contract.capabilities import (
    BackendCapabilities, DType, IndexDType, KVCacheLayout, KVDType, Probe, Requirements, TopkLayout,
)
from mm3.contract.checks import Plan, check, check_layer_args
from mm3.contract.facts import StepFacts
from mm3.contract.errors import (
    BackendUnavailableError, ConfigError, ContractViolation, InputError, MM3Error, NoBackendError,
    PluginError, UnknownBackendError,
)
from mm3.contract.hookspecs import ALL_OPS, HOOK_NAMES, INDEX_OPS, PROJECT, STEP_OPS, Op, hookimpl, hookspec
from mm3.contract.kv_scales import FP8_KV_DTYPES
from mm3.contract.params import MINIMAX_M3_MAX_DECODE_QUERY_LEN, SparseAttentionParams

__all__ = [
    # hooks
    "PROJECT", "hookspec", "hookimpl", "HOOK_NAMES", "Op", "ALL_OPS", "STEP_OPS", "INDEX_OPS",
    # declarations
    "BackendCapabilities", "Requirements", "Probe", "TopkLayout", "KVCacheLayout",
    "DType", "IndexDType", "KVDType",
    # what a hook receives
    "TopkBuffer", "PagedKVCache", "BatchMetadata", "SparseAttentionParams",
    "MINIMAX_M3_MAX_DECODE_QUERY_LEN", "TORCH_DTYPES", "FP8_KV_DTYPES", "dtype_name",
    # checks
    "check", "Plan", "StepFacts", "check_layer_args",
    # errors
    "MM3Error", "InputError", "ConfigError", "UnknownBackendError", "BackendUnavailableError",
    "NoBackendError", "PluginError", "ContractViolation",
]
