"""mm3's ops as ``torch.library`` custom ops: ``torch.ops.mm3.index_topk``, ``torch.ops.mm3.attention``
and ``torch.ops.mm3.sparse_attention`` (the two in one call: a layer's whole step).

Engines compile their models: ``torch.compile`` treats each op as one opaque
node (its fake kernel says what it returns and its schema which arguments it
writes), so the compiler never traces the selection, the checks or a
backend's launcher. The arguments are tensors and ints only: the step's
metadata flattened (:func:`batch_args`) and a *handle* naming the bound
backends the op dispatches to (:class:`OpTarget`, registered by
:class:`~mm3.SparseAttention` when it binds them). Behind the op, the call is
admitted at the step's boundary like any other (:mod:`mm3.runtime.step`), then
the bound backend's hook runs.

A compiled :class:`~mm3.SparseAttention` emits ``sparse_attention``: one
dispatcher hop and one admission per step, and the step's contents judged once
(by the indexer's launches where its backend ``judges_contents``), as the eager
layer does. ``index_topk`` and ``attention`` are for an engine that schedules
the two apart; each call is admitted and its contents judged by itself.

The top-k buffer (written by the indexer) and ``out`` (by the attention) are
the ops' declared mutations; both are passed whole, the op writes rows
``[0, T)`` where ``T`` is the step's token count. ``topk`` is either the
layer's own storage (``layer.topk_buffer.storage``: the op knows its layout),
or the logical ``[H, T, K]`` view of the caller's memory, read through its
strides (vLLM's convention: token-major ``[T, H, K]`` memory is passed as
``memory.permute(1, 0, 2)``). Both ops read the same argument the same way, so
what the indexer writes is what the attention reads, whatever the memory order.

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
from typing import Optional, Union

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import InputError
from mm3.contract.facts import OPS_NAMES
from mm3.contract.hookspecs import Op
from mm3.runtime.step import BOTH, OpTarget

__all__ = ["OpTarget", "batch_args", "batch_from_args", "register", "lookup", "sparse_attention"]

# the live targets by handle: an op names its target by an int (a schema takes no Python object). A plain dict
# of weak references, each removing its entry when its target dies: an op's lookup is one dict read and one
# call (a WeakValueDictionary's get runs Python code)
_TARGETS: "dict[int, weakref.ReferenceType[OpTarget]]" = {}
_NEXT = itertools.count(1)
_LOCK = threading.Lock()


def register(target: OpTarget) -> int:
    """Give ``target`` a handle the ops can name it by (its :attr:`~OpTarget.handle`); it stays
    registered while its owner holds it."""
    with _LOCK:
        handle = target.handle = next(_NEXT)
        _TARGETS[handle] = weakref.ref(target, lambda _, h=handle: _TARGETS.pop(h, None))  # type: ignore[misc]
    return handle


def lookup(handle: int) -> OpTarget:
    """The live target registered under ``handle``; :class:`~mm3.InputError` names a dead or unknown one."""
    ref = _TARGETS.get(handle)
    target = None if ref is None else ref()
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
    Token slots are not among them: such a batch is refused here, by name.
    """
    if batch.slots is not None:
        raise InputError("a batch of token slots (BatchMetadata.slots) cannot pass through torch.ops.mm3.*, whose "
                         "schema carries a block table only: run the layer eagerly (outside torch.compile), or "
                         "give it a batch of pages")
    return (batch.query_start_loc, batch.seq_lens, batch.context_lens, batch.block_table,
            batch.token_to_request, batch.token_positions, batch.num_decodes, batch.decode_query_len,
            batch.num_decode_tokens, batch.max_prefill_query_len, batch.block_size)


def batch_from_args(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                    block_table: torch.Tensor, token_to_request: torch.Tensor, token_positions: torch.Tensor,
                    num_decodes: int, decode_query_len: int, num_decode_tokens: int,
                    max_prefill_query_len: int, block_size: int) -> BatchMetadata:
    """The inverse of :func:`batch_args` (host lengths are read back only if a backend asks).

    A new batch every call (its facts read back when its tensors' shapes, dtypes and devices and its
    ints equal the last call's), as the ops build their cache and top-k wrappers anew: nothing they
    are given is kept past the call.
    Under ``torch.compile``'s CUDA graphs (``mode="reduce-overhead"``) an argument may live in the
    graph's memory pool, and a reference kept across steps is an allocation the graph does not own
    (H200: "6 tensors in the cudagraph pool not tracked as outputs"); and an engine may refill the
    tensors in place, so host facts read from their contents must be read afresh.
    """
    return BatchMetadata.assemble(query_start_loc, seq_lens, context_lens, block_table, token_to_request,
                                  token_positions, num_decodes=num_decodes, decode_query_len=decode_query_len,
                                  num_decode_tokens=num_decode_tokens,
                                  max_prefill_query_len=max_prefill_query_len, block_size=block_size)


# each op's name in errors and its ops, made once (an enum member's attribute lookup runs Python every call)
_INDEX_ENTRY, _INDEX_OPS = "torch.ops.mm3.index_topk", (Op.INDEX_TOPK,)
_ATTENTION_ENTRY, _ATTENTION_OPS = "torch.ops.mm3.attention", (Op.ATTENTION,)
_STEP_ENTRY = "torch.ops.mm3.sparse_attention"


def _call_parts(handle: int, entry: str, topk: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                block_table: torch.Tensor, token_to_request: torch.Tensor, token_positions: torch.Tensor,
                num_decodes: int, decode_query_len: int, num_decode_tokens: int, max_prefill_query_len: int,
                block_size: int, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                k_block_scale: Optional[torch.Tensor], v_block_scale: Optional[torch.Tensor],
                index_block_scale: Optional[torch.Tensor]) -> tuple[OpTarget, PagedKVCache, BatchMetadata, TopkBuffer]:
    """What an op's call runs on: its target, caches, batch and top-k buffer (:meth:`OpTarget.topk_of`). The
    wrappers are made anew each call; their facts are read back when the tensors' shapes, dtypes and devices
    equal the last call's (:func:`~mm3.contract.facts.cache_facts`, :func:`~mm3.contract.facts.shape_of_facts`)."""
    target = lookup(handle)
    caches = PagedKVCache.rewrap(k, v, index, k_scale, v_scale, k_block_scale=k_block_scale,
                                 v_block_scale=v_block_scale, index_block_scale=index_block_scale)
    batch = batch_from_args(query_start_loc, seq_lens, context_lens, block_table, token_to_request, token_positions,
                            num_decodes, decode_query_len, num_decode_tokens, max_prefill_query_len, block_size)
    return target, caches, batch, target.topk_of(topk, entry)


# Defined with torch.library.Library rather than the custom_op decorator: the decorator's eager
# call runs several Python layers (autograd, ADInplaceOrView, a dynamo-disable wrapper) that cost
# about 25 us per call on the CPU; a CompositeExplicitAutograd kernel is one dispatcher hop. The
# fake kernels and the schemas' mutations are what torch.compile needs.
_LIB = torch.library.Library("mm3", "DEF")
_BATCH = ("Tensor query_start_loc, Tensor seq_lens, Tensor context_lens, Tensor block_table, "
          "Tensor token_to_request, Tensor token_positions, SymInt num_decodes, SymInt decode_query_len, "
          "SymInt num_decode_tokens, SymInt max_prefill_query_len, SymInt block_size, int handle")
_CACHES = "Tensor k, Tensor v, Tensor index"
_SCALES = ("Tensor? k_scale=None, Tensor? v_scale=None, Tensor? k_block_scale=None, Tensor? v_block_scale=None, "
           "Tensor? index_block_scale=None")   # the block scales: NVFP4's (docs/spec.md §1)
_LIB.define(f"index_topk(Tensor index_q, {_CACHES}, Tensor(a!) topk, {_BATCH}, {_SCALES}) -> ()")
_LIB.define(f"attention(Tensor q, {_CACHES}, Tensor topk, {_BATCH}, Tensor(a!) out, {_SCALES}) -> ()")
_LIB.define(f"sparse_attention(Tensor q, Tensor index_q, {_CACHES}, Tensor(a!) topk, {_BATCH}, Tensor(b!) out, "
            f"{_SCALES}) -> ()")


def index_topk(index_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, topk: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
               block_table: torch.Tensor, token_to_request: torch.Tensor, token_positions: torch.Tensor,
               num_decodes: int, decode_query_len: int, num_decode_tokens: int, max_prefill_query_len: int,
               block_size: int, handle: int,
               k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
               k_block_scale: Optional[torch.Tensor] = None, v_block_scale: Optional[torch.Tensor] = None,
               index_block_scale: Optional[torch.Tensor] = None) -> None:
    """The indexer of the bound backend ``handle``: writes rows ``[0, T)`` of the top-k storage ``topk``."""
    target, caches, batch, own = _call_parts(
        handle, _INDEX_ENTRY, topk, k, v, index, query_start_loc, seq_lens, context_lens, block_table,
        token_to_request, token_positions, num_decodes, decode_query_len, num_decode_tokens, max_prefill_query_len,
        block_size, k_scale, v_scale, k_block_scale, v_block_scale, index_block_scale)
    target.run(_INDEX_ENTRY, _INDEX_OPS, caches=caches, batch=batch, topk=own, index_q=index_q, names=OPS_NAMES)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, topk: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
              block_table: torch.Tensor, token_to_request: torch.Tensor, token_positions: torch.Tensor,
              num_decodes: int, decode_query_len: int, num_decode_tokens: int, max_prefill_query_len: int,
              block_size: int, handle: int, out: torch.Tensor,
              k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
              k_block_scale: Optional[torch.Tensor] = None, v_block_scale: Optional[torch.Tensor] = None,
              index_block_scale: Optional[torch.Tensor] = None) -> None:
    """The attention of the bound backend ``handle``: reads the top-k storage, writes ``out[:T]``."""
    target, caches, batch, own = _call_parts(
        handle, _ATTENTION_ENTRY, topk, k, v, index, query_start_loc, seq_lens, context_lens, block_table,
        token_to_request, token_positions, num_decodes, decode_query_len, num_decode_tokens, max_prefill_query_len,
        block_size, k_scale, v_scale, k_block_scale, v_block_scale, index_block_scale)
    target.run(_ATTENTION_ENTRY, _ATTENTION_OPS, caches=caches, batch=batch, topk=own, q=q, out=out, names=OPS_NAMES)


def sparse_attention(q: torch.Tensor, index_q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                     topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     context_lens: torch.Tensor, block_table: torch.Tensor, token_to_request: torch.Tensor,
                     token_positions: torch.Tensor, num_decodes: int, decode_query_len: int, num_decode_tokens: int,
                     max_prefill_query_len: int, block_size: int, handle: int, out: torch.Tensor,
                     k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                     k_block_scale: Optional[torch.Tensor] = None, v_block_scale: Optional[torch.Tensor] = None,
                     index_block_scale: Optional[torch.Tensor] = None) -> None:
    """A layer's step on the bound backends ``handle``: the indexer writes rows ``[0, T)`` of ``topk``, then
    the attention reads them and writes ``out[:T]`` (what a compiled :class:`~mm3.SparseAttention` calls)."""
    target, caches, batch, own = _call_parts(
        handle, _STEP_ENTRY, topk, k, v, index, query_start_loc, seq_lens, context_lens, block_table,
        token_to_request, token_positions, num_decodes, decode_query_len, num_decode_tokens, max_prefill_query_len,
        block_size, k_scale, v_scale, k_block_scale, v_block_scale, index_block_scale)
    target.run(_STEP_ENTRY, BOTH, caches=caches, batch=batch, topk=own, index_q=index_q, q=q, out=out,
               names=OPS_NAMES)


_LIB.impl("index_topk", index_topk, "CompositeExplicitAutograd")
_LIB.impl("attention", attention, "CompositeExplicitAutograd")
_LIB.impl("sparse_attention", sparse_attention, "CompositeExplicitAutograd")


def _meta_argument(entry: str, named: dict[str, object]) -> None:
    """A real call with a ``meta`` tensor among its arguments: torch's dispatcher runs the fake kernel (the
    Meta key wins over the others), so the boundary would never see it; refuse it here, by name. Under
    ``torch.compile``'s fake tensors (``torch.library.get_ctx()`` answers only there) it is shape
    propagation, and a call whose every tensor is ``meta`` is one too: both pass."""
    try:
        torch.library.get_ctx()
        return
    except RuntimeError:
        pass
    tensors = {n: t for n, t in named.items() if isinstance(t, torch.Tensor)}
    devices = {t.device.type for t in tensors.values()}
    if "meta" in devices and len(devices) > 1:
        name = next(n for n, t in tensors.items() if t.device.type == "meta")
        others = sorted({str(t.device) for t in tensors.values() if t.device.type != "meta"})
        raise InputError(f"{entry}: {name} is on meta but the other inputs are on {', '.join(others)}; move every "
                         f"input of the step to one device (tensor.to(device))")


def _register_fake(name: str, entry: str) -> None:
    """The fake kernel of op ``name``: it returns nothing (the op's results are its declared mutations) and
    refuses a ``meta`` argument of a real call (:func:`_meta_argument`), naming it as the schema does."""
    names = [a.name for a in getattr(torch.ops.mm3, name).default._schema.arguments]

    def fake(*args: object, **kwargs: object) -> None:
        _meta_argument(entry, {**dict(zip(names, args)), **kwargs})

    torch.library.register_fake(f"mm3::{name}", fake, lib=_LIB)


for _name, _entry in (("index_topk", _INDEX_ENTRY), ("attention", _ATTENTION_ENTRY),
                      ("sparse_attention", _STEP_ENTRY)):
    _register_fake(_name, _entry)
