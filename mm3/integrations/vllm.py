"""vLLM's MiniMax-M3 ops served by mm3: the same names, arguments and results, on the backend mm3 selects.

vLLM 0.33's MiniMax-M3 layer calls six functions of
``vllm.models.minimax_m3.common.ops``. This module has the six, so the layer
runs on whichever backend mm3's selection picks (``MM3_BACKEND``, a
``mm3.use_backend`` scope, :func:`mm3.integrations.targets.configure`) once its
import names this module instead (docs/engines.md, "vLLM"):

=================================  ==========================================================
vLLM function                      served by
=================================  ==========================================================
``minimax_m3_index_decode``        the selected backend's indexer (``index_topk``), decode batch
``minimax_m3_sparse_attn_decode``  the selected backend's attention, decode batch
``minimax_m3_sparse_attn``         the selected backend's attention, prefill batch
``minimax_m3_index_score``         the selected indexer's block scores (``index_scores``), prefill
                                   batch; mm3's torch scorer (:mod:`~mm3.integrations.block_scores`)
                                   where that backend does not write scores (its selection says so)
``minimax_m3_index_decode_score``  the same, decode batch, forced blocks set
``minimax_m3_index_topk``          :func:`~mm3.integrations.block_scores.select_topk` on the scores
=================================  ==========================================================

vLLM's conventions hold: the KV cache ``[num_blocks, num_kv_heads, B, 2 * head_dim]``
(K, then V, in the last axis) is split into two views, no copy; the index cache
is ``[num_blocks, B, index_head_dim]``; top-k ids are a logical
``[num_kv_heads, total_q, topk]`` view of any storage, read through its strides
(:class:`~mm3.TopkBuffer` built from the view: token-major storage behind a head-major view
is right); in a row, ``-1``, ids outside the token's visible blocks and repeats
select nothing more; ``out=`` gets ``out[:, :total_q]`` written and returned (a
stable address for CUDA graphs); fp8 K/V take scalar scales, per-KV-head
``[num_kv_heads]`` ones or per-(KV head, slot) ``[num_kv_heads, num_slots]`` ones.
Decode batches are ``seq_lens.shape[0]`` requests of ``decode_query_len`` tokens
each (``seq_len == 0`` rows are padding: all ``-1`` ids, zero outputs); prefill
batches are described by ``cu_seqlens_q`` (starting at 0) and ``seq_lens``. The
step's metadata is built on the device from those tensors (no host copy); the
block size (vLLM's 128) is read from the caches.

Errors are :class:`~mm3.InputError` naming the function and the argument; a
call no backend can serve raises selection's explanation
(:class:`~mm3.NoBackendError`, :class:`~mm3.BackendUnavailableError`).
"""

from __future__ import annotations

from typing import Optional

import torch

from mm3.contract.buffers import PagedKVCache
from mm3.contract.errors import InputError
from mm3.debug.guard import capturing
from mm3.integrations.block_scores import score_width, select_topk
from mm3.integrations.no_grad import without_grad
from mm3.integrations.targets import context, remember
from mm3.integrations.vllm_calls import (
    ATTENTION_KINDS, ATTENTION_OPS, DECODE_INDEX_NAMES, INDEX_KINDS, INDEX_OPS, Kind, attention_params, decode_scores,
    index_params, params_of, plain, run_attention, run_index, run_scores,
)
from mm3.integrations.vllm_inputs import (
    DECODE_NAMES, attention_caches, cdiv, check_heads, decode_batch, int32_arg, out_rows, prefill_batch, tensor_arg,
    topk_view,
)

__all__ = ["minimax_m3_index_decode", "minimax_m3_index_decode_score", "minimax_m3_index_score",
           "minimax_m3_index_topk", "minimax_m3_sparse_attn", "minimax_m3_sparse_attn_decode", "SPARSE_BLOCK_SIZE"]

SPARSE_BLOCK_SIZE = 128
"""vLLM's sparse block (= KV page) size; :func:`minimax_m3_index_topk` assumes it unless told otherwise."""
_new = object.__new__
_grad_on = torch.is_grad_enabled


# -- vLLM's six functions -----------------------------------------------------------------------

def minimax_m3_index_decode(idx_q: torch.Tensor, index_kv_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, max_seq_len: int, topk: int, init_blocks: int,
                            local_blocks: int, num_kv_heads: int, decode_query_len: int,
                            max_decode_query_len: int, out: Optional[torch.Tensor] = None,
                            score_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The top-k blocks of each decode token: ``[num_kv_heads, total_q, topk]`` int32, ``-1`` padded.

    The selected backend's indexer on the decode batch. ``out`` (``[num_kv_heads,
    >= total_q, topk]``, any storage behind that view) gets rows ``[0, total_q)``,
    returned; ``score_out``, when given, also gets the block scores
    (:func:`minimax_m3_index_decode_score`'s). The order of the ids in a row is the
    backend's; ``max_seq_len`` only sizes ``score_out``.
    """
    if _grad_on():     # as without_grad, without its frame (an engine calls with gradients off)
        with torch.no_grad():
            return minimax_m3_index_decode(idx_q, index_kv_cache, block_table, seq_lens, max_seq_len, topk,
                                           init_blocks, local_blocks, num_kv_heads, decode_query_len,
                                           max_decode_query_len, out, score_out)
    fn = "minimax_m3_index_decode"
    key: Optional[tuple[object, ...]]
    try:
        T, H, Di = idx_q.shape
        key = (idx_q.dtype, H, Di, index_kv_cache.shape, index_kv_cache.dtype, idx_q.device, index_kv_cache.device,
               topk, init_blocks, local_blocks, num_kv_heads, decode_query_len, max_decode_query_len)
        kind = INDEX_KINDS.get(key)
    except (AttributeError, TypeError, ValueError):    # not a 3-D tensor, an unhashable int: the checked path
        key = kind = None
    if kind is not None and score_out is None and kind.context == context():
        graph = capturing(idx_q)
        if kind.graph_safe or not graph:
            batch = decode_batch(fn, seq_lens, block_table, decode_query_len, T, kind.block_size, graph)
            rows = out_rows(fn, out, H, T, topk, idx_q.device)
            if T:
                caches = _new(PagedKVCache)
                caches.__dict__.update(kind.caches, index=index_kv_cache)
                kind.target.run(fn, INDEX_OPS, caches=caches, batch=batch, topk=topk_view(fn, "out", rows),
                                index_q=idx_q.to(torch.bfloat16) if kind.widen else idx_q, graph=graph,
                                names=DECODE_INDEX_NAMES)
            return rows
    return _index_decode(fn, idx_q, index_kv_cache, block_table, seq_lens, max_seq_len, topk, init_blocks,
                         local_blocks, num_kv_heads, decode_query_len, max_decode_query_len, out, score_out, key)


def _index_decode(fn: str, idx_q: torch.Tensor, index_kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, max_seq_len: int, topk: int, init_blocks: int, local_blocks: int,
                  num_kv_heads: int, decode_query_len: int, max_decode_query_len: int, out: Optional[torch.Tensor],
                  score_out: Optional[torch.Tensor], key: Optional[tuple[object, ...]]) -> torch.Tensor:
    """:func:`minimax_m3_index_decode` checked step by step; a call that runs eagerly keeps its kind under
    ``key`` (its host facts, as the caller read them; ``None``: keeps none)."""
    tensor_arg(fn, "idx_q", idx_q, 3, "[total_q, num_kv_heads, index_head_dim]")
    tensor_arg(fn, "index_kv_cache", index_kv_cache, 3, "[num_blocks, block_size, index_head_dim]")
    T, H, Di = idx_q.shape
    check_heads(fn, "idx_q", H, num_kv_heads)
    if decode_query_len > max_decode_query_len:
        raise InputError(f"{fn}: decode_query_len={decode_query_len} > max_decode_query_len={max_decode_query_len}")
    graph = capturing(idx_q)
    B = index_kv_cache.shape[1]
    batch = decode_batch(fn, seq_lens, block_table, decode_query_len, T, B, graph)
    rows = out_rows(fn, out, H, T, topk, idx_q.device)
    params = params_of(fn, index_params, H, Di, B, topk, init_blocks, local_blocks)
    if score_out is not None:
        decode_scores(fn, idx_q, index_kv_cache, batch, params, max_seq_len, decode_query_len, max_decode_query_len,
                      score_out, graph)
    if T:
        ctx = context()
        q, caches, bound = run_index(fn, idx_q, index_kv_cache, batch, rows, params, max_decode_query_len, graph)
        if key is not None and not graph and plain(topk, init_blocks, local_blocks, num_kv_heads, decode_query_len,
                                                   max_decode_query_len):
            kind = Kind(ctx, bound, bound.selection.indexer, B, caches, ("index",))
            kind.widen = q is not idx_q
            remember(INDEX_KINDS, key, kind)
    return rows


@without_grad
def minimax_m3_index_decode_score(idx_q: torch.Tensor, index_kv_cache: torch.Tensor, block_table: torch.Tensor,
                                  seq_lens: torch.Tensor, max_seq_len: int, init_blocks: int, local_blocks: int,
                                  num_kv_heads: int, decode_query_len: int, max_decode_query_len: int,
                                  score_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block scores of each decode token, forced blocks set: ``[num_kv_heads, total_q, >= max_block]`` float32.

    The selected indexer's block scores (``index_scores``, docs/spec.md §3.6), or mm3's torch
    scorer (:func:`~mm3.integrations.block_scores.block_scores`) where that backend writes
    none (its selection says so). Blocks a token cannot see score ``-inf``; its init blocks
    ``1e30``, its local blocks ``1e29``, a NaN block ``-1e30``. ``score_out`` (any strides) gets
    columns ``[0, cdiv(max_seq_len, block size))`` and is returned; without it, a new tensor of
    ``round_up(max_block, 16)`` columns.
    """
    fn = "minimax_m3_index_decode_score"
    tensor_arg(fn, "idx_q", idx_q, 3, "[total_q, num_kv_heads, index_head_dim]")
    tensor_arg(fn, "index_kv_cache", index_kv_cache, 3, "[num_blocks, block_size, index_head_dim]")
    T, H, Di = idx_q.shape
    check_heads(fn, "idx_q", H, num_kv_heads)
    if decode_query_len > max_decode_query_len:
        raise InputError(f"{fn}: decode_query_len={decode_query_len} > max_decode_query_len={max_decode_query_len}")
    graph = capturing(idx_q)
    B = index_kv_cache.shape[1]
    batch = decode_batch(fn, seq_lens, block_table, decode_query_len, T, B, graph)
    # block scores select nothing: the least top-k the forced blocks allow stands in for one
    params = params_of(fn, index_params, H, Di, B, max(1, init_blocks + local_blocks), init_blocks, local_blocks)
    return decode_scores(fn, idx_q, index_kv_cache, batch, params, max_seq_len, decode_query_len,
                         max_decode_query_len, score_out, graph)


@without_grad
def minimax_m3_index_score(idx_q: torch.Tensor, index_kv_cache: torch.Tensor, block_table: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, prefix_lens: torch.Tensor,
                           max_query_len: int, max_seq_len: int, num_kv_heads: int) -> torch.Tensor:
    """Block scores of each prefill token: ``[num_kv_heads, total_q, round_up(max_block, 16)]`` float32.

    As :func:`minimax_m3_index_decode_score` (the selected indexer's, else mm3's torch
    scorer), with no forced blocks (:func:`minimax_m3_index_topk` sets them). ``prefix_lens``
    must be ``seq_lens`` minus the query lengths (checked with the step's contents).
    """
    fn = "minimax_m3_index_score"
    tensor_arg(fn, "idx_q", idx_q, 3, "[total_q, num_kv_heads, index_head_dim]")
    tensor_arg(fn, "index_kv_cache", index_kv_cache, 3, "[num_blocks, block_size, index_head_dim]")
    T, H, Di = idx_q.shape
    check_heads(fn, "idx_q", H, num_kv_heads)
    B = index_kv_cache.shape[1]
    batch = prefill_batch(fn, cu_seqlens_q, seq_lens, block_table, T, max_query_len, B, prefix_lens)
    scores = torch.empty((H, T, score_width(cdiv(max_seq_len, B))), dtype=torch.float32, device=idx_q.device)
    if T:
        params = params_of(fn, index_params, H, Di, B, 1, 0, 0)
        run_scores(fn, idx_q, index_kv_cache, batch, scores, params, max_query_len, 1, capturing(idx_q))
    return scores


@without_grad
def minimax_m3_index_topk(score: torch.Tensor, cu_seqlens_q: torch.Tensor, prefix_lens: torch.Tensor,
                          max_query_len: int, topk: int, init_blocks: int, local_blocks: int,
                          out: Optional[torch.Tensor] = None, *, block_size: int = SPARSE_BLOCK_SIZE) -> torch.Tensor:
    """The top-k blocks of each token from ``score`` (``[num_kv_heads, total_q, >= max_block]``).

    docs/spec.md §3.4-3.5 on the given scores (:func:`~mm3.integrations.block_scores.select_topk`):
    token ``i`` of request ``r`` sits at ``prefix_lens[r] + i`` and sees its blocks up to its
    own; NaN scores rank last, init and local blocks are forced, equal scores go to the
    lowest block id; ids highest score first, then ``-1``. ``out`` as in
    :func:`minimax_m3_index_decode`. ``block_size``: mm3's addition, vLLM's is 128.
    """
    fn = "minimax_m3_index_topk"
    tensor_arg(fn, "score", score, 3, "[num_kv_heads, total_q, max_block]")
    cu = int32_arg(fn, "cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")
    pl = int32_arg(fn, "prefix_lens", prefix_lens, 1, "[batch]")
    H, T, _ = score.shape
    if pl.shape[0] != cu.shape[0] - 1:
        raise InputError(f"{fn}: prefix_lens has {pl.shape[0]} requests, cu_seqlens_q {cu.shape[0] - 1}")
    rows = out_rows(fn, out, H, T, topk, score.device)
    # the positions as a prefill batch derives them: seq_len = prefix + query length, no block table
    seq = pl + (cu[1:] - cu[:-1])
    batch = prefill_batch(fn, cu, seq, torch.zeros((pl.shape[0], 0), dtype=torch.int32, device=score.device), T,
                           max_query_len, block_size)
    select_topk(score, batch.token_positions, rows, block_size=block_size, init_blocks=init_blocks,
                local_blocks=local_blocks)
    return rows


@without_grad
def minimax_m3_sparse_attn(q: torch.Tensor, kv_cache: torch.Tensor, topk_idx: torch.Tensor,
                           block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                           prefix_lens: torch.Tensor, max_query_len: int, num_kv_heads: int, sm_scale: float,
                           output: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None) -> None:
    """Block-sparse attention of a prefill batch over the blocks in ``topk_idx``, written into ``output``.

    The selected backend's attention. ``topk_idx`` is ``[num_kv_heads, >= total_q, topk]``
    (any storage behind that view); ``output`` ``[total_q, num_heads, head_dim]`` in q's
    dtype. ``prefix_lens`` must be ``seq_lens`` minus the query lengths (checked where the
    guard checks a step).
    """
    fn = "minimax_m3_sparse_attn"
    tensor_arg(fn, "q", q, 3, "[total_q, num_heads, head_dim]")
    tensor_arg(fn, "kv_cache", kv_cache, 4, "[num_blocks, num_kv_heads, block_size, 2 * head_dim]")
    tensor_arg(fn, "topk_idx", topk_idx, 3, "[num_kv_heads, total_q, topk]")
    T, Hq, D = q.shape
    check_heads(fn, "kv_cache", kv_cache.shape[1], num_kv_heads)
    graph = capturing(q)
    B = kv_cache.shape[2]
    bt = int32_arg(fn, "block_table", block_table, 2, "[batch, max_blocks]")
    batch = prefill_batch(fn, cu_seqlens_q, seq_lens, bt, T, max_query_len, B, prefix_lens)
    if T:
        caches = attention_caches(fn, kv_cache, k_scale, v_scale, q, graph)
        params = params_of(fn, attention_params, Hq, num_kv_heads, D, B, topk_idx.shape[2], sm_scale)
        run_attention(fn, q, caches, topk_idx, batch, output, params, 1, graph)


def minimax_m3_sparse_attn_decode(q: torch.Tensor, kv_cache: torch.Tensor, topk_idx: torch.Tensor,
                                  block_table: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
                                  sm_scale: float, output: torch.Tensor, decode_query_len: int,
                                  k_scale: Optional[torch.Tensor] = None,
                                  v_scale: Optional[torch.Tensor] = None) -> None:
    """Block-sparse attention of a decode batch over the blocks in ``topk_idx``, written into ``output``.

    The selected backend's attention; arguments as in :func:`minimax_m3_sparse_attn`, the batch as in
    :func:`minimax_m3_index_decode` (``seq_lens.shape[0] * decode_query_len`` tokens).
    """
    if _grad_on():     # as without_grad, without its frame
        with torch.no_grad():
            return minimax_m3_sparse_attn_decode(q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads, sm_scale,
                                                 output, decode_query_len, k_scale, v_scale)
    fn = "minimax_m3_sparse_attn_decode"
    key: Optional[tuple[object, ...]] = None
    kind = None
    if k_scale is None and v_scale is None:
        try:
            T, Hq, D = q.shape
            _, _, K = topk_idx.shape
            key = (q.dtype, Hq, D, kv_cache.shape, kv_cache.stride(), kv_cache.dtype, q.device, kv_cache.device, K,
                   num_kv_heads, sm_scale, decode_query_len)
            kind = ATTENTION_KINDS.get(key)
        except (AttributeError, TypeError, ValueError):   # not a tensor of its dims, an unhashable int
            key = None
    if kind is not None and kind.context == context():
        graph = capturing(q)
        if kind.graph_safe or not graph:
            batch = decode_batch(fn, seq_lens, block_table, decode_query_len, T, kind.block_size, graph)
            if T:
                at = kv_cache.storage_offset()
                caches = _new(PagedKVCache)
                caches.__dict__.update(kind.caches, k=kv_cache.as_strided(kind.size, kind.stride, at),
                                       v=kv_cache.as_strided(kind.size, kind.stride, at + kind.v_at))
                kind.target.run(fn, ATTENTION_OPS, caches=caches, batch=batch,
                                topk=topk_view(fn, "topk_idx", topk_idx), q=q, out=output, graph=graph,
                                names=DECODE_NAMES)
            return
    _attn_decode(fn, q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads, sm_scale, output, decode_query_len,
                 k_scale, v_scale, key)


def _attn_decode(fn: str, q: torch.Tensor, kv_cache: torch.Tensor, topk_idx: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int, sm_scale: float,
                 output: torch.Tensor, decode_query_len: int, k_scale: Optional[torch.Tensor],
                 v_scale: Optional[torch.Tensor], key: Optional[tuple[object, ...]]) -> None:
    """:func:`minimax_m3_sparse_attn_decode` checked step by step; a call that runs eagerly, without scales,
    keeps its kind under ``key`` (its host facts, as the caller read them; ``None``: keeps none)."""
    tensor_arg(fn, "q", q, 3, "[total_q, num_heads, head_dim]")
    tensor_arg(fn, "kv_cache", kv_cache, 4, "[num_blocks, num_kv_heads, block_size, 2 * head_dim]")
    tensor_arg(fn, "topk_idx", topk_idx, 3, "[num_kv_heads, total_q, topk]")
    T, Hq, D = q.shape
    check_heads(fn, "kv_cache", kv_cache.shape[1], num_kv_heads)
    graph = capturing(q)
    B = kv_cache.shape[2]
    batch = decode_batch(fn, seq_lens, block_table, decode_query_len, T, B, graph)
    if T:
        caches = attention_caches(fn, kv_cache, k_scale, v_scale, q, graph)
        params = params_of(fn, attention_params, Hq, num_kv_heads, D, B, topk_idx.shape[2], sm_scale)
        ctx = context()
        bound = run_attention(fn, q, caches, topk_idx, batch, output, params, decode_query_len, graph)
        if key is not None and not graph and plain(num_kv_heads, decode_query_len, sm_scale):
            kind = Kind(ctx, bound, bound.selection.attention, B, caches, ("k", "v"))
            kind.size, kind.stride = tuple(caches.k.shape), caches.k.stride()
            kind.v_at = int(caches.v.storage_offset() - caches.k.storage_offset())
            remember(ATTENTION_KINDS, key, kind)
