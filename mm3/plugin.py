"""The backend author's API: everything a plugin imports, from one place.

A backend is a module of ``@hookimpl`` functions, registered under the
entry-point group ``mm3.backends`` of your distribution::

    # pyproject.toml
    [project.entry-points."mm3.backends"]
    my_attn = "my_attn.plugin"

The module declares what it can do, says whether it runs here, and computes
one or both ops (an attention-only backend is fine):

=====================================================  ==========================================
hook                                                   what it does
=====================================================  ==========================================
``backend_capabilities() -> BackendCapabilities``      required: name, ops, layouts, dtypes, limits
``backend_probe(device) -> Probe``                     can it run on ``device`` here? never raises
``alloc_topk_buffer(num_tokens, num_heads, topk,       optional: the persistent :class:`TopkBuffer`
device) -> TopkBuffer``
``index_topk(index_q, caches, batch, params, out)``    the indexer (docs/spec.md §3)
``attention_forward(q, caches, topk, batch, params,    the attention (docs/spec.md §4)
out)``
``index_scores(index_q, caches, batch, params, out)``  optional: the block scores (docs/spec.md §3.6)
``check_contents(batch, num_pages, word)``             optional: a batch's contents judged on its
                                                       device in one launch (docs/errors.md §2.6)
=====================================================  ==========================================

A hook takes any subset of its arguments, spelled as above. mm3 checks every
argument against the contract and your declared limits before your hook
runs, so a hook computes and, for what no capability field can say, raises
:class:`InputError` naming the argument, the value and what it needs.
:class:`BackendUnavailableError` is for "cannot run here" found only at call
time (the probe should have said so). Anything else a hook raises reaches
the caller as a ``PluginError`` naming your backend and hook; out-of-memory
errors keep their class.

Example (a complete attention-only backend, tried without installing it):
    >>> import torch
    >>> from mm3.plugin import BackendCapabilities, Probe, hookimpl
    >>> class Zeros:                                   # a module works the same way
    ...     @hookimpl
    ...     def backend_capabilities(self):
    ...         return BackendCapabilities(name="zeros", ops={"attention"}, device_types={"cpu"},
    ...                                    topk_layout="head_major")
    ...     @hookimpl
    ...     def backend_probe(self, device):
    ...         return Probe.yes("plain PyTorch") if device.type == "cpu" else Probe.no("CPU only")
    ...     @hookimpl
    ...     def attention_forward(self, batch, out):
    ...         out[:batch.num_tokens] = 0             # rows past the step's are not ours
    >>> from mm3.testing.helpers import RegistryFactory
    >>> backend = RegistryFactory()(Zeros()).get("zeros")
    >>> backend.capabilities.ops, backend.probe("cpu").reason
    (frozenset({'attention'}), 'plain PyTorch')

docs/plugins.md builds a complete backend step by step; docs/spec.md says what
each hook must compute; ``mm3 check NAME`` runs the conformance suite on it.
"""

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.capabilities import BackendCapabilities, Probe
from mm3.contract.errors import BackendUnavailableError, InputError
from mm3.contract.hookspecs import hookimpl
from mm3.contract.params import SparseAttentionParams
from mm3.contract.slots import TokenSlots, key_rows

__all__ = [
    # declare
    "hookimpl", "BackendCapabilities", "Probe",
    # receive
    "TopkBuffer", "PagedKVCache", "BatchMetadata", "SparseAttentionParams", "TokenSlots", "key_rows",
    # raise
    "InputError", "BackendUnavailableError",
]
