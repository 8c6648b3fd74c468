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

import functools
from typing import Callable, Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache
from mm3.contract.hookspecs import ALL_OPS, Op
from mm3.contract.errors import BackendUnavailableError, InputError
from mm3.contract.params import SparseAttentionParams
from mm3.debug.guard import capturing
from mm3.integrations.block_scores import block_scores, score_width, select_topk
from mm3.integrations.no_grad import without_grad
from mm3.integrations.targets import Binding, bind_call
from mm3.integrations.vllm_inputs import (
    DECODE_NAMES, FP8_DTYPES, VLLM_NAMES, attention_caches, cdiv, check_heads, decode_batch, index_caches, int32_arg,
    out_rows, prefill_batch, tensor_arg, topk_view,
)
from mm3.runtime.selection import requirements_for
from mm3.runtime.step import OpTarget

__all__ = ["minimax_m3_index_decode", "minimax_m3_index_decode_score", "minimax_m3_index_score",
           "minimax_m3_index_topk", "minimax_m3_sparse_attn", "minimax_m3_sparse_attn_decode", "SPARSE_BLOCK_SIZE"]

SPARSE_BLOCK_SIZE = 128
"""vLLM's sparse block (= KV page) size; :func:`minimax_m3_index_topk` assumes it unless told otherwise."""


@functools.lru_cache(maxsize=1024)
def _index_params(heads: int, index_head_dim: int, block_size: int, topk: int, init_blocks: int,
                  local_blocks: int) -> SparseAttentionParams:
    # an index op has no attention: its shapes stand in for the attention's (one query head per KV head)
    return SparseAttentionParams(num_heads=heads, num_kv_heads=heads, head_dim=index_head_dim, num_index_heads=heads,
                                 index_head_dim=index_head_dim, block_size=block_size, topk=topk,
                                 init_blocks=init_blocks, local_blocks=local_blocks)


@functools.lru_cache(maxsize=1024)
def _attention_params(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, topk: int,
                      scale: float) -> SparseAttentionParams:
    # an attention op has no indexer: its shapes stand in for the indexer's, no forced blocks
    return SparseAttentionParams(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 num_index_heads=num_kv_heads, index_head_dim=head_dim, block_size=block_size,
                                 topk=topk, init_blocks=0, local_blocks=0, scale=scale)


def _params(fn: str, build: Callable[..., SparseAttentionParams], *args: object) -> SparseAttentionParams:
    try:
        return build(*args)
    except InputError as e:
        raise InputError(f"{fn}: {e}") from None


# -- the bound backends --------------------------------------------------------------------------
def _bound(fn: str, op: Op, params: SparseAttentionParams, dtype: torch.dtype, index_dtype: torch.dtype,
           kv_dtype: torch.dtype, slot_scales: bool, device: torch.device, decode_query_len: int,
           graph: bool) -> Binding:
    """The backends of a call of ``op``; one choice serves its eager and captured calls (as a layer's
    does), so a captured call of a backend that is not CUDA-graph safe is refused here, with the reason.
    Every op is selected (block scores too), so one choice serves each of the six functions."""
    bound = bind_call(("vllm", params, dtype, index_dtype, kv_dtype, slot_scales, device, decode_query_len),
                      lambda: requirements_for(params, dtype, index_dtype, device, decode_query_len=decode_query_len,
                                               kv_dtype=kv_dtype, kv_slot_scales=slot_scales).for_ops(*ALL_OPS),
                      params, device, graph)
    sel = bound.selection
    be = sel.indexer if op is Op.INDEX_TOPK else sel.attention if op is Op.ATTENTION else sel.scorer
    if graph and be is not None and not be.capabilities.cuda_graph_safe:
        why = " (among the backends that read k_scale/v_scale per token slot)" if slot_scales else ""
        raise BackendUnavailableError(
            f"{fn}: backend {be.name!r}{why}, selected for this call, is not CUDA-graph safe (it does not "
            f"declare cuda_graph_safe): run this call outside CUDA-graph capture, or select a backend that "
            f"is (MM3_BACKEND, mm3.use_backend); its selection:\n{sel.explain()}")
    return bound


def _index_call(fn: str, op: Op, idx_q: torch.Tensor, index_cache: torch.Tensor, params: SparseAttentionParams,
                decode_query_len: int, graph: bool) -> tuple[torch.Tensor, PagedKVCache, OpTarget]:
    """What an index op's call runs on: ``(index queries, caches, target)``."""
    if idx_q.dtype in FP8_DTYPES:   # mm3's index queries are in the attention dtype: widen (exact)
        idx_q = idx_q.to(torch.bfloat16)
    caches = index_caches(index_cache, params.num_kv_heads, idx_q.dtype, graph)
    target = _bound(fn, op, params, idx_q.dtype, index_cache.dtype, idx_q.dtype, False, idx_q.device,
                    decode_query_len, graph).target
    return idx_q, caches, target


#: how the index and score functions spell their outputs, for a decode batch and a prefill batch (made once)
_INDEX_NAMES = (DECODE_NAMES._replace(topk="out"), VLLM_NAMES._replace(topk="out"))
_SCORE_NAMES = (DECODE_NAMES._replace(out="score_out"), VLLM_NAMES._replace(out="score_out"))


def _run_index(fn: str, idx_q: torch.Tensor, index_cache: torch.Tensor, batch: BatchMetadata, rows: torch.Tensor,
               params: SparseAttentionParams, max_decode_query_len: int, graph: bool) -> None:
    idx_q, caches, target = _index_call(fn, Op.INDEX_TOPK, idx_q, index_cache, params, max_decode_query_len, graph)
    names = _INDEX_NAMES[not batch.num_decodes]
    target.run(fn, (Op.INDEX_TOPK,), caches=caches, batch=batch, topk=topk_view(fn, "out", rows), index_q=idx_q,
               graph=graph, names=names)


def _run_attention(fn: str, q: torch.Tensor, caches: PagedKVCache, topk_idx: torch.Tensor, batch: BatchMetadata,
                   output: torch.Tensor, params: SparseAttentionParams, decode_query_len: int, graph: bool) -> None:
    target = _bound(fn, Op.ATTENTION, params, q.dtype, q.dtype, caches.dtype, caches.slot_scaled, q.device,
                    decode_query_len, graph).target
    target.run(fn, (Op.ATTENTION,), caches=caches, batch=batch, topk=topk_view(fn, "topk_idx", topk_idx), q=q,
               out=output, graph=graph, names=DECODE_NAMES if batch.num_decodes else VLLM_NAMES)


def _run_scores(fn: str, idx_q: torch.Tensor, index_cache: torch.Tensor, batch: BatchMetadata, out: torch.Tensor,
                params: SparseAttentionParams, max_query_len: int, decode_query_len: int, graph: bool) -> None:
    """``batch``'s block scores into every element of ``out`` (``[H, T, N]``, any strides): the selected
    backend's ``index_scores``, or, where it has none (its selection's trace says so), mm3's torch scorer
    on a call admitted at the same boundary."""
    idx_q, caches, target = _index_call(fn, Op.INDEX_SCORES, idx_q, index_cache, params, decode_query_len, graph)
    names = _SCORE_NAMES[not batch.num_decodes]
    call = dict(caches=caches, batch=batch, index_q=idx_q, out=out, graph=graph, names=names)
    if target.scorer is not None:
        target.run(fn, (Op.INDEX_SCORES,), **call)  # type: ignore[arg-type]
        return
    target.admit_call(fn, (Op.INDEX_SCORES,), **call)  # type: ignore[arg-type]
    N = out.shape[2]
    out.copy_(block_scores(idx_q, index_cache, batch, num_blocks=N, max_query_len=max_query_len,
                           forced=(params.init_blocks, params.local_blocks))[:, :, :N])


def _decode_scores(fn: str, idx_q: torch.Tensor, index_kv_cache: torch.Tensor, batch: BatchMetadata,
                   params: SparseAttentionParams, max_seq_len: int, dql: int, max_dql: int,
                   score_out: Optional[torch.Tensor], graph: bool) -> torch.Tensor:
    """The decode scores into columns ``[0, cdiv(max_seq_len, B))`` of ``score_out`` (returned), or into all
    columns of a new tensor of :func:`~mm3.integrations.block_scores.score_width` of them."""
    H, T = params.num_kv_heads, batch.num_tokens
    nblk = cdiv(max_seq_len, index_kv_cache.shape[1])
    if score_out is None:
        score_out = out = torch.empty((H, T, score_width(nblk)), dtype=torch.float32, device=idx_q.device)
    else:
        tensor_arg(fn, "score_out", score_out, 3, "[num_kv_heads, total_q, >= max_block]")
        if score_out.shape[0] != H or score_out.shape[1] != T or score_out.shape[2] < nblk:
            raise InputError(f"{fn}: score_out has shape {tuple(score_out.shape)}, needs [{H}, {T}, >= {nblk}] "
                             f"(num_kv_heads, total_q, cdiv(max_seq_len, block size))")
        out = score_out[:, :, :nblk]
    if T and out.shape[2]:
        _run_scores(fn, idx_q, index_kv_cache, batch, out, params, dql, max_dql, graph)
    return score_out


# -- vLLM's six functions -----------------------------------------------------------------------

@without_grad
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
    fn = "minimax_m3_index_decode"
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
    params = _params(fn, _index_params, H, Di, B, topk, init_blocks, local_blocks)
    if score_out is not None:
        _decode_scores(fn, idx_q, index_kv_cache, batch, params, max_seq_len, decode_query_len, max_decode_query_len,
                       score_out, graph)
    if T:
        _run_index(fn, idx_q, index_kv_cache, batch, rows, params, max_decode_query_len, graph)
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
    params = _params(fn, _index_params, H, Di, B, max(1, init_blocks + local_blocks), init_blocks, local_blocks)
    return _decode_scores(fn, idx_q, index_kv_cache, batch, params, max_seq_len, decode_query_len,
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
        params = _params(fn, _index_params, H, Di, B, 1, 0, 0)
        _run_scores(fn, idx_q, index_kv_cache, batch, scores, params, max_query_len, 1, capturing(idx_q))
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
        params = _params(fn, _attention_params, Hq, num_kv_heads, D, B, topk_idx.shape[2], sm_scale)
        _run_attention(fn, q, caches, topk_idx, batch, output, params, 1, graph)


@without_grad
def minimax_m3_sparse_attn_decode(q: torch.Tensor, kv_cache: torch.Tensor, topk_idx: torch.Tensor,
                                  block_table: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
                                  sm_scale: float, output: torch.Tensor, decode_query_len: int,
                                  k_scale: Optional[torch.Tensor] = None,
                                  v_scale: Optional[torch.Tensor] = None) -> None:
    """Block-sparse attention of a decode batch over the blocks in ``topk_idx``, written into ``output``.

    The selected backend's attention; arguments as in :func:`minimax_m3_sparse_attn`, the batch as in
    :func:`minimax_m3_index_decode` (``seq_lens.shape[0] * decode_query_len`` tokens).
    """
    fn = "minimax_m3_sparse_attn_decode"
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
        params = _params(fn, _attention_params, Hq, num_kv_heads, D, B, topk_idx.shape[2], sm_scale)
        _run_attention(fn, q, caches, topk_idx, batch, output, params, decode_query_len, graph)
