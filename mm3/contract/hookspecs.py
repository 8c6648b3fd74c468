"""The backend contract: pluggy hook specifications for project ``"mm3"``.

One plugin is one backend: a module or object with ``@hookimpl`` functions.
Every hook is ``firstresult``; the registry binds each backend's own
implementations directly (see :mod:`mm3.runtime.backend`), so hooks of different
backends never mix and no ``pm.hook`` call happens per forward.

A minimal attention-only plugin::

    from mm3.plugin import hookimpl, BackendCapabilities, Probe

    @hookimpl
    def backend_capabilities():
        return BackendCapabilities(name="mine", ops={"attention"},
                                   device_types={"cpu"}, topk_layout="token_major")

    @hookimpl
    def backend_probe(device):
        return Probe.yes()

    @hookimpl
    def attention_forward(q, caches, topk, batch, params, out):
        ...  # read topk.head_major() / topk.strides(); write out[:batch.num_tokens]

Register it under the entry-point group ``mm3.backends`` in your
``pyproject.toml``; see docs/plugins.md. What each hook must compute and write: docs/spec.md §7.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

import pluggy

if TYPE_CHECKING:
    import torch

    from mm3.contract.batch import BatchMetadata
    from mm3.contract.buffers import PagedKVCache, TopkBuffer
    from mm3.contract.capabilities import BackendCapabilities, Probe
    from mm3.contract.params import SparseAttentionParams

__all__ = ["PROJECT", "hookspec", "hookimpl", "HOOK_NAMES", "Op", "ALL_OPS", "STEP_OPS", "INDEX_OPS"]

PROJECT = "mm3"
hookspec = pluggy.HookspecMarker(PROJECT)


class _HookimplMarker(pluggy.HookimplMarker):
    """``@hookimpl`` marks a function of your plugin as the implementation of the mm3 hook of its name.

    Name the function after its hook and take any subset of the hook's
    arguments, spelled as in the spec; a misspelled name or argument gets the
    plugin excluded, with the reason in ``mm3 backends``.

    Example:
        >>> from mm3.plugin import BackendCapabilities, hookimpl
        >>> class Mine:                  # a plugin object; a module of functions works the same way
        ...     @hookimpl
        ...     def backend_capabilities(self):
        ...         return BackendCapabilities(name="mine", ops={"attention"}, device_types={"cpu"},
        ...                                    topk_layout="head_major")
        ...     @hookimpl
        ...     def attention_forward(self, batch, out):
        ...         out[:batch.num_tokens] = 0
        >>> from mm3.testing.helpers import RegistryFactory
        >>> RegistryFactory()(Mine()).names()
        ['mine']
    """

    __slots__ = ()


hookimpl = _HookimplMarker(PROJECT)


class Op(str, enum.Enum):
    """An operation a backend can provide: the name capabilities declare, and the hook that runs it.

    A member *is* its name (``Op.ATTENTION == "attention"``), so capabilities
    may list plain strings, and it prints as that name wherever it is shown.

    ``index_topk`` and ``attention`` are a step's two ops; ``index_scores`` is
    optional: the block scores an engine's op hands to a separate top-k
    (vLLM's ``minimax_m3_index_score``), for backends that can write them.

    Example:
        >>> Op("attention").hook, [op.value for op in Op]
        ('attention_forward', ['index_topk', 'attention', 'index_scores'])
    """

    hook: str

    def __new__(cls, name: str, hook: str) -> "Op":
        op = str.__new__(cls, name)
        op._value_ = name
        op.hook = hook
        return op

    INDEX_TOPK = ("index_topk", "index_topk")
    ATTENTION = ("attention", "attention_forward")
    INDEX_SCORES = ("index_scores", "index_scores")

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


ALL_OPS: frozenset[Op] = frozenset(Op)
#: the ops of a step (what a layer runs and selection always chooses a backend for)
STEP_OPS: frozenset[Op] = frozenset({Op.INDEX_TOPK, Op.ATTENTION})
#: the ops that read the index cache (the indexer's limits apply to them)
INDEX_OPS: frozenset[Op] = frozenset({Op.INDEX_TOPK, Op.INDEX_SCORES})


@hookspec(firstresult=True)
def backend_capabilities() -> "BackendCapabilities":
    """Static declaration of the backend (name, ops, layouts, limits). Required.

    Must be cheap and must not touch a GPU.
    """


@hookspec(firstresult=True)
def backend_probe(device: "torch.device") -> "Probe":
    """Can this backend run on ``device`` here? Return ``Probe.no(reason)`` if not.

    Lazy and cheap: import optional dependencies here, not at module import.
    Raising is treated as "unavailable" and reported with the exception.
    """


@hookspec(firstresult=True)
def alloc_topk_buffer(num_tokens: int, num_heads: int, topk: int,
                      device: "torch.device") -> "TopkBuffer":
    """Allocate a persistent top-k buffer in this backend's declared ``topk_layout``.

    Optional: without it the core allocates ``TopkBuffer.allocate(..., layout=topk_layout)``.
    """


@hookspec(firstresult=True)
def index_topk(index_q: "torch.Tensor", caches: "PagedKVCache", batch: "BatchMetadata",
               params: "SparseAttentionParams", out: "TopkBuffer",
               page_faults: "Optional[torch.Tensor]") -> None:
    """The indexer (docs/spec.md §3): write rows ``[0, batch.num_tokens)`` of ``out``.

    ``index_q`` is ``[T, Hidx, Di]``; ``out`` holds exactly the step's rows.
    ``page_faults``: ``None``, or (for a backend that declares
    ``reports_bad_page_ids``) a one-element int64 tensor on the batch's device,
    maybe over host memory mapped into it: lower it (a plain load and store, no
    atomics) to ``request << 32 | block`` for every used block-table entry
    that is not a page id in ``[0, caches.num_pages)``, and
    read such an entry's page as a clamped id, never as an address outside the
    cache. Take the argument only if you declare the capability (a hook may
    name any subset of its spec's arguments). A backend that also declares
    ``judges_contents`` lowers it for the batch's contents too, as
    :func:`check_contents` does: mm3 then makes no ``check_contents`` call before it.
    """


@hookspec(firstresult=True)
def attention_forward(q: "torch.Tensor", caches: "PagedKVCache", topk: "TopkBuffer",
                      batch: "BatchMetadata", params: "SparseAttentionParams",
                      out: "torch.Tensor") -> None:
    """Block-sparse attention (docs/spec.md §4): write ``out[:T]`` (``[T, Hq, D]``, q's dtype)."""


@hookspec(firstresult=True)
def index_scores(index_q: "torch.Tensor", caches: "PagedKVCache", batch: "BatchMetadata",
                 params: "SparseAttentionParams", out: "torch.Tensor",
                 page_faults: "Optional[torch.Tensor]") -> None:
    """Optional: the indexer's block scores (docs/spec.md §3.6), written into every element of ``out``.

    ``out`` is float32 ``[Hidx, T, N]`` (any strides): ``out[h, t, b]`` is
    token ``t``'s score S(b) after §3.4 (NaN blocks ``-1e30``, the forced
    blocks of ``params.init_blocks`` / ``params.local_blocks`` ``1e30`` / ``1e29``)
    for each block ``b < min(nb, N)`` it sees, ``-inf`` for every other column
    and every column of a padding token. ``page_faults`` as for :func:`index_topk`.
    Declare ``"index_scores"`` in the capabilities' ``ops`` with it.
    """


@hookspec(firstresult=True)
def check_contents(batch: "BatchMetadata", num_pages: int, word: "torch.Tensor") -> None:
    """Optional: judge what ``batch``'s tensors hold, on its device, without a synchronisation.

    The rules of docs/errors.md §2.6 (query starts, decode and prefill query lengths, ``seq_len`` against
    the query length and the block table's width, every token's position and request, the context
    lengths when the batch has its own, every used block-table entry a page id in ``[0, num_pages)``):
    lower ``word`` (a one-element int64 tensor on the batch's device, maybe over mapped host memory: a
    plain load and store, no atomics) to a fault word of :mod:`mm3.contract.contents`
    (``fault_word(request, block)`` for a page id, ``LENGTHS | rule << 40 | index`` for the others),
    the smallest one a program meets. mm3 calls it at every eager call that reads a device batch (an
    engine edits a batch's tensors in place between steps), instead of its own check of about sixty
    torch operations; ``mm3.contract.contents.lengths_word`` and ``pages_word`` are the reference. A
    backend that declares ``addressings`` "slots" judges a batch of token slots here too (``batch.slots``:
    every slot a used position names, ``slots_word`` the reference).
    Implement it as one launch, and only on devices your probe accepts.
    """


HOOK_NAMES: tuple[str, ...] = tuple(name for name, fn in list(globals().items())
                                    if hasattr(fn, f"{PROJECT}_spec"))
"""Every hook of the contract, in the order above (read from pluggy's spec markers)."""
