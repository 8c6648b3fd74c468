"""mm3's ops as ``torch.library`` custom ops: ``torch.ops.mm3.index_topk`` and ``torch.ops.mm3.attention``.

Engines compile their models: ``torch.compile`` treats each op as one opaque
node (its fake kernel says what it returns and its schema which arguments it
writes), so the compiler never traces the selection, the checks or a
backend's launcher. The arguments are tensors and ints only: the step's
metadata flattened (:func:`batch_args`) and a *handle* naming the bound
backends the op dispatches to (:class:`OpTarget`, registered by
:class:`~mm3.SparseAttention` when it binds them). Behind the op, the bound
:class:`~mm3.Backend` runs as in eager mode: its checks, then the plugin.

The top-k buffer (written by the indexer) and ``out`` (by the attention) are
the ops' declared mutations; both are passed whole, the op writes rows
``[0, T)`` where ``T`` is the step's token count.

Example:
    >>> import torch, mm3
    >>> from mm3.testing.factories import make_case
    >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=16, backend="cpu_ref")
    >>> case = make_case(p, decodes=[40], prefills=[(5, 20)], dtype="float32")
    >>> target, c, b = layer.op_target, case.caches, case.batch
    >>> torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, layer.topk_buffer.storage,
    ...                          *batch_args(b), target.handle)
    >>> out = torch.zeros_like(case.q)
    >>> torch.ops.mm3.attention(case.q, c.k, c.v, c.index, layer.topk_buffer.storage, *batch_args(b),
    ...                         target.handle, out)
    >>> bool(torch.allclose(out, layer(case.q, case.index_q, c, b)))
    True
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import InputError

if TYPE_CHECKING:
    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.backend import Backend

__all__ = ["OpTarget", "batch_args", "batch_from_args", "run_index_topk", "run_attention"]

_TARGETS: "weakref.WeakValueDictionary[int, OpTarget]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)
_LOCK = threading.Lock()


@dataclass(eq=False)
class OpTarget:
    """What a custom op dispatches to: the bound backends, the params, the top-k layouts.

    Registered under :attr:`handle` when built; the op looks it up by that int.
    It lives as long as its owner (the layer) holds it.
    """

    indexer: "Backend"
    attention: "Backend"
    params: "SparseAttentionParams"
    topk_layout: str             # the layout of the buffer the indexer writes
    attention_topk_layout: str   # the layout of the buffer the attention reads
    handle: int = field(init=False)

    def __post_init__(self) -> None:
        with _LOCK:
            self.handle = next(_NEXT)
            _TARGETS[self.handle] = self

    @staticmethod
    def lookup(handle: int) -> "OpTarget":
        target = _TARGETS.get(handle)
        if target is None:
            raise InputError(f"mm3 op handle {handle} names no live layer; pass layer.op_target.handle of a "
                             f"SparseAttention that is still alive")
        return target


#: the flattened metadata of a step: 6 tensors, then 5 host ints (the shape class)
BatchArgs = tuple[Union[torch.Tensor, int], ...]


def batch_args(batch: BatchMetadata) -> BatchArgs:
    """``batch`` as the custom ops take it: its tensors, then the host ints of its shape class.

    The ints are the ones that stay fixed from one decode step to the next
    (decodes, decode query length, decode tokens, block size, longest prefill
    query), so a compiled graph is not specialised on sequence lengths.
    """
    return (batch.query_start_loc, batch.seq_lens, batch.context_lens, batch.block_table,
            batch.token_to_request, batch.token_positions, batch.num_decodes, batch.decode_query_len,
            batch.num_decode_tokens, batch.max_prefill_query_len, batch.block_size)


def batch_from_args(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                    block_table: torch.Tensor, token_to_request: torch.Tensor, token_positions: torch.Tensor,
                    num_decodes: int, decode_query_len: int, num_decode_tokens: int,
                    max_prefill_query_len: int, block_size: int) -> BatchMetadata:
    """The inverse of :func:`batch_args` (host lengths are read back only if a backend asks)."""
    return BatchMetadata.assemble(query_start_loc, seq_lens, context_lens, block_table, token_to_request,
                                  token_positions, num_decodes=num_decodes, decode_query_len=decode_query_len,
                                  num_decode_tokens=num_decode_tokens,
                                  max_prefill_query_len=max_prefill_query_len, block_size=block_size)


def run_index_topk(target: OpTarget, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                   topk: TopkBuffer) -> None:
    """The indexer of one step into ``topk.rows(0, T)`` (what ``torch.ops.mm3.index_topk`` runs)."""
    target.indexer.index_topk(index_q, caches, batch, target.params, topk.rows(0, batch.num_tokens))


def run_attention(target: OpTarget, q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
                  batch: BatchMetadata, out: torch.Tensor) -> None:
    """The attention of one step into ``out[:T]`` (what ``torch.ops.mm3.attention`` runs)."""
    T = batch.num_tokens
    target.attention.attention_forward(q, caches, topk.rows(0, T), batch, target.params, out[:T])


@torch.library.custom_op("mm3::index_topk", mutates_args=("topk",))
def index_topk(index_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
               topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               context_lens: torch.Tensor, block_table: torch.Tensor, token_to_request: torch.Tensor,
               token_positions: torch.Tensor, num_decodes: int, decode_query_len: int, num_decode_tokens: int,
               max_prefill_query_len: int, block_size: int, handle: int) -> None:
    """The indexer of the bound backend ``handle``: writes rows ``[0, T)`` of the top-k storage ``topk``."""
    target = OpTarget.lookup(handle)
    batch = batch_from_args(query_start_loc, seq_lens, context_lens, block_table, token_to_request,
                            token_positions, num_decodes, decode_query_len, num_decode_tokens,
                            max_prefill_query_len, block_size)
    run_index_topk(target, index_q, PagedKVCache(k, v, index), batch, TopkBuffer(topk, target.topk_layout))


@index_topk.register_fake
def _(index_q, k, v, index, topk, query_start_loc, seq_lens, context_lens, block_table,  # type: ignore[no-untyped-def]
      token_to_request, token_positions, num_decodes, decode_query_len, num_decode_tokens,
      max_prefill_query_len, block_size, handle) -> None:
    return None


@torch.library.custom_op("mm3::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, topk: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
              block_table: torch.Tensor, token_to_request: torch.Tensor, token_positions: torch.Tensor,
              num_decodes: int, decode_query_len: int, num_decode_tokens: int, max_prefill_query_len: int,
              block_size: int, handle: int, out: torch.Tensor) -> None:
    """The attention of the bound backend ``handle``: reads the top-k storage, writes ``out[:T]``."""
    target = OpTarget.lookup(handle)
    batch = batch_from_args(query_start_loc, seq_lens, context_lens, block_table, token_to_request,
                            token_positions, num_decodes, decode_query_len, num_decode_tokens,
                            max_prefill_query_len, block_size)
    run_attention(target, q, PagedKVCache(k, v, index), TopkBuffer(topk, target.attention_topk_layout),
                  batch, out)


@attention.register_fake
def _(q, k, v, index, topk, query_start_loc, seq_lens, context_lens, block_table,  # type: ignore[no-untyped-def]
      token_to_request, token_positions, num_decodes, decode_query_len, num_decode_tokens,
      max_prefill_query_len, block_size, handle, out) -> None:
    return None
