"""What the checks of a step read: its shape class, as one immutable value.

:class:`StepFacts` holds everything the argument checks
(:func:`mm3.contract.checks.check`) look at — the shapes, dtypes, devices and,
where a rule needs them, strides of every input, the batch's host ints, the
parameters, the bound backends and, for a layer, what it was built for — and
nothing else: the checks take this value alone, so a check cannot read a fact
that is not part of it. Two steps of one class are equal values; the boundary
(:mod:`mm3.runtime.step`) remembers the classes that passed, keyed by the value
itself, and builds a new one from the tensors every step (nothing is remembered
about a tensor object, so an input rewritten in place is judged as it is now).
Tensor *contents* (page ids, lengths) are not facts: they are checked every
step (:mod:`mm3.contract.contents`).

:class:`ArgNames` says how the caller spells each argument, so an error names
the function and the argument the caller wrote (``minimax_m3_sparse_attn:
output ...``), not mm3's internal names.

Example:
    >>> import torch
    >>> a, b = torch.zeros(4, 2, 8), torch.ones(4, 2, 8)
    >>> TensorFacts(a.shape, a.dtype, a.device) == TensorFacts(b.shape, b.dtype, b.device)  # contents are no fact
    True
    >>> batch_kind(num_requests=3, num_decodes=2, decode_query_len=1)
    'mixed'
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

__all__ = ["TensorFacts", "CacheFacts", "BatchFacts", "LayerFacts", "StepFacts", "ArgNames", "batch_kind",
           "LAYER_NAMES", "OPS_NAMES"]


def batch_kind(num_requests: int, num_decodes: int, decode_query_len: int) -> str:
    """``"decode"``, ``"prefill"``, ``"mixed"`` or ``"empty"``, with ``"speculative "`` in front when the
    decodes carry draft tokens (``decode_query_len > 1``).

    Example:
        >>> batch_kind(3, 2, 2), batch_kind(4, 0, 1)
        ('speculative mixed', 'prefill')
    """
    if num_requests <= 0:
        return "empty"
    kind = "decode" if num_decodes == num_requests else "prefill" if num_decodes == 0 else "mixed"
    return f"speculative {kind}" if num_decodes and decode_query_len > 1 else kind


class TensorFacts(NamedTuple):
    """Shape, dtype and device of one tensor, and its strides where a rule reads them (else ``None``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: Optional[tuple[int, ...]] = None


class CacheFacts(NamedTuple):
    """The paged caches: K, V, index keys, and the K/V scales (``None`` when unscaled)."""

    k: TensorFacts
    v: TensorFacts
    index: TensorFacts
    k_scale: Optional[TensorFacts]
    v_scale: Optional[TensorFacts]


class BatchFacts(NamedTuple):
    """The batch's host ints and its tensors' facts (``context_lens``: ``None`` until derived)."""

    num_decodes: int
    decode_query_len: int
    block_size: int
    num_decode_tokens: int
    max_prefill_query_len: int
    query_start_loc: TensorFacts
    seq_lens: TensorFacts
    block_table: TensorFacts
    token_to_request: TensorFacts
    token_positions: TensorFacts
    context_lens: Optional[TensorFacts]

    @property
    def num_tokens(self) -> int:
        return self.token_positions.shape[0] if len(self.token_positions.shape) == 1 else -1

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0] if len(self.seq_lens.shape) == 1 else -1

    @property
    def kind(self) -> str:
        """The batch's kind (:func:`batch_kind`): the guard's policy guards the first step of each."""
        return batch_kind(self.num_requests, self.num_decodes, self.decode_query_len)


class LayerFacts(NamedTuple):
    """What a layer was built for (a layer's step must match it; other entry points have none)."""

    dtype: torch.dtype
    index_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    capacity: int
    max_decode_query_len: int


class ArgNames(NamedTuple):
    """How an entry point's caller spells each input (errors name these).

    ``where_made``: where the caller's batch tensors come from, so advice about their contents
    points there (``BatchMetadata.build(...)``, or vLLM's metadata).
    """

    q: str = "q"
    index_q: str = "index_q"
    out: str = "out"
    topk: str = "the top-k buffer"
    k: str = "caches.k"
    v: str = "caches.v"
    index: str = "caches.index"
    k_scale: str = "caches.k_scale"
    v_scale: str = "caches.v_scale"
    query_start_loc: str = "batch.query_start_loc"
    seq_lens: str = "batch.seq_lens"
    context_lens: str = "batch.context_lens"
    block_table: str = "batch.block_table"
    token_to_request: str = "batch.token_to_request"
    token_positions: str = "batch.token_positions"
    where_made: str = "BatchMetadata.build(...), which checks them where they are made"


LAYER_NAMES = ArgNames()
"""The layer's and a bound backend's spelling (``SparseAttention.forward``, ``Backend.index_topk``)."""
OPS_NAMES = ArgNames(topk="topk", k="k", v="v", index="index", k_scale="k_scale", v_scale="v_scale",
                     query_start_loc="query_start_loc", seq_lens="seq_lens", context_lens="context_lens",
                     block_table="block_table", token_to_request="token_to_request",
                     token_positions="token_positions",
                     where_made="mm3.runtime.ops.batch_args(batch) of a BatchMetadata")
"""``torch.ops.mm3.*``'s spelling: their schema's argument names."""


class StepFacts(NamedTuple):
    """Everything the checks of one call read (:func:`mm3.contract.checks.check`): its shape class.

    ``ops``: the hooks the call runs (a layer's step runs both). ``indexer`` /
    ``attention``: the bound backends of those ops (objects fixed for the
    process: their capabilities and probe answers are what the checks read);
    ``indexer`` is the one of an index op (``index_topk`` or ``index_scores``),
    ``None`` for an op no bound backend provides (the caller does its work).
    ``layer``: a layer's own promises, ``None`` for other entry points.
    ``out``: the call's output tensor (the attention's, or the block scores of
    ``index_scores``); ``topk``: the top-k buffer, ``None`` for a call that has
    none (``index_scores``).

    The boundary builds the nested facts as plain tuples in their fields' order
    (it does so every step, and a tuple is the cheapest value); the rules name
    them (:func:`mm3.contract.checks.view`). Equal either way: a tuple compares and hashes by
    its items.
    """

    entry: str
    names: ArgNames
    ops: tuple[str, ...]
    params: Any
    indexer: Any
    attention: Any
    layer: Optional[LayerFacts]
    index_q: Optional[TensorFacts]
    q: Optional[TensorFacts]
    out: Optional[TensorFacts]
    topk_layout: Optional[str]
    topk: Optional[TensorFacts]
    caches: CacheFacts
    batch: BatchFacts

