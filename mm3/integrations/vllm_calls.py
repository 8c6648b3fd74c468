"""What a call of vLLM's MiniMax-M3 functions runs on: its params, its bound backends, the decode pair's kinds.

:mod:`mm3.integrations.vllm` has vLLM's six functions; here is what they share:
the params a call's shapes stand for (an index op's stand in for an attention's and
the other way round), the backends bound for a call (:func:`bound_for`, one choice
serving all six functions), the index, attention and score runs, and the decode
pair's kinds of call (:class:`Kind`): what a call of the pair works out from its
host values, kept so that a later call of that kind does only what its tensors need.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache
from mm3.contract.errors import BackendUnavailableError, InputError
from mm3.contract.hookspecs import ALL_OPS, Op
from mm3.contract.params import SparseAttentionParams
from mm3.integrations.block_scores import block_scores, score_width
from mm3.integrations.targets import Binding, bind_call, memo
from mm3.integrations.vllm_inputs import (
    DECODE_NAMES, FP8_DTYPES, VLLM_NAMES, cdiv, index_caches, tensor_arg, topk_view,
)
from mm3.runtime.selection import requirements_for

__all__ = ["index_params", "attention_params", "params_of", "bound_for", "index_call", "INDEX_NAMES", "SCORE_NAMES",
           "Kind", "INDEX_KINDS", "ATTENTION_KINDS", "INDEX_OPS", "ATTENTION_OPS", "DECODE_INDEX_NAMES",
           "plain", "run_index", "run_attention", "run_scores", "decode_scores"]


@functools.lru_cache(maxsize=1024)
def index_params(heads: int, index_head_dim: int, block_size: int, topk: int, init_blocks: int,
                 local_blocks: int) -> SparseAttentionParams:
    # an index op has no attention: its shapes stand in for the attention's (one query head per KV head)
    return SparseAttentionParams(num_heads=heads, num_kv_heads=heads, head_dim=index_head_dim, num_index_heads=heads,
                                 index_head_dim=index_head_dim, block_size=block_size, topk=topk,
                                 init_blocks=init_blocks, local_blocks=local_blocks)


@functools.lru_cache(maxsize=1024)
def attention_params(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, topk: int,
                     scale: float) -> SparseAttentionParams:
    # an attention op has no indexer: its shapes stand in for the indexer's, no forced blocks
    return SparseAttentionParams(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 num_index_heads=num_kv_heads, index_head_dim=head_dim, block_size=block_size,
                                 topk=topk, init_blocks=0, local_blocks=0, scale=scale)


def params_of(fn: str, build: Callable[..., SparseAttentionParams], *args: object) -> SparseAttentionParams:
    try:
        return build(*args)
    except InputError as e:
        raise InputError(f"{fn}: {e}") from None


# -- the bound backends --------------------------------------------------------------------------
def bound_for(fn: str, op: Op, params: SparseAttentionParams, dtype: torch.dtype, index_dtype: torch.dtype,
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


def index_call(fn: str, op: Op, idx_q: torch.Tensor, index_cache: torch.Tensor, params: SparseAttentionParams,
               decode_query_len: int, graph: bool) -> tuple[torch.Tensor, PagedKVCache, Binding]:
    """What an index op's call runs on: ``(index queries, caches, bound backends)``."""
    if idx_q.dtype in FP8_DTYPES:   # mm3's index queries are in the attention dtype: widen (exact)
        idx_q = idx_q.to(torch.bfloat16)
    caches = index_caches(index_cache, params.num_kv_heads, idx_q.dtype, graph)
    bound = bound_for(fn, op, params, idx_q.dtype, index_cache.dtype, idx_q.dtype, False, idx_q.device,
                      decode_query_len, graph)
    return idx_q, caches, bound


#: how the index and score functions spell their outputs, for a decode batch and a prefill batch (made once)
INDEX_NAMES = (DECODE_NAMES._replace(topk="out"), VLLM_NAMES._replace(topk="out"))
SCORE_NAMES = (DECODE_NAMES._replace(out="score_out"), VLLM_NAMES._replace(out="score_out"))


# -- the decode pair's kinds of call --------------------------------------------------------------
# An engine calls the decode pair in every layer of every step, each step of a new batch shape: what a call
# works out from its host values (shapes but the token count, dtypes, devices, ints) is kept per kind of
# call, so a later call of that kind does only what its tensors need: the arguments that vary (the batch's,
# ``out``), the batch (:func:`~mm3.integrations.vllm_inputs.decode_batch`), the caches as a copy of the
# kind's template, and the target's run, which checks the call's facts against its plan. A kind is kept only
# after a call of it passed every check eagerly, and only for the backend names, settings and registry it was
# bound under (:func:`~mm3.integrations.targets.context`); a call it does not fit takes the checked path.

class Kind:
    """What calls of one kind share: the target and what it was bound under, the caches' template."""

    __slots__ = ("context", "target", "graph_safe", "block_size", "caches", "widen", "size", "stride", "v_at")
    size: tuple[int, ...]
    stride: tuple[int, ...]
    v_at: int

    def __init__(self, ctx: tuple[object, ...], bound: Binding, be: object, block_size: int,
                 caches: PagedKVCache, per_call: tuple[str, ...]) -> None:
        self.context, self.target, self.block_size = ctx, bound.target, block_size
        self.graph_safe = be is None or be.capabilities.cuda_graph_safe      # type: ignore[attr-defined]
        self.caches = dict(caches.__dict__)
        self.caches.update(dict.fromkeys(per_call))   # this call's tensors: none kept past it
        self.widen, self.size, self.stride, self.v_at = False, (), (), 0


#: kinds by what they are made of (forgotten with the bound choices: targets.configure)
INDEX_KINDS: dict[tuple[object, ...], Kind] = memo()
ATTENTION_KINDS: dict[tuple[object, ...], Kind] = memo()
INDEX_OPS, ATTENTION_OPS = (Op.INDEX_TOPK,), (Op.ATTENTION,)
DECODE_INDEX_NAMES = INDEX_NAMES[0]


def plain(*numbers: object) -> bool:
    """Whether a call's numbers are Python ints and floats: a kind is kept by them (a tensor would be kept by
    its identity, whatever it holds next)."""
    return all(type(n) is int or type(n) is float for n in numbers)


def run_index(fn: str, idx_q: torch.Tensor, index_cache: torch.Tensor, batch: BatchMetadata, rows: torch.Tensor,
              params: SparseAttentionParams, max_decode_query_len: int,
              graph: bool) -> tuple[torch.Tensor, PagedKVCache, Binding]:
    """Run the index op; returns what it ran on (:func:`index_call`)."""
    made = idx_q, caches, bound = index_call(fn, Op.INDEX_TOPK, idx_q, index_cache, params, max_decode_query_len,
                                             graph)
    names = INDEX_NAMES[not batch.num_decodes]
    bound.target.run(fn, (Op.INDEX_TOPK,), caches=caches, batch=batch, topk=topk_view(fn, "out", rows), index_q=idx_q,
                     graph=graph, names=names)
    return made


def run_attention(fn: str, q: torch.Tensor, caches: PagedKVCache, topk_idx: torch.Tensor, batch: BatchMetadata,
                  output: torch.Tensor, params: SparseAttentionParams, decode_query_len: int, graph: bool) -> Binding:
    bound = bound_for(fn, Op.ATTENTION, params, q.dtype, q.dtype, caches.dtype, caches.slot_scaled, q.device,
                      decode_query_len, graph)
    bound.target.run(fn, (Op.ATTENTION,), caches=caches, batch=batch, topk=topk_view(fn, "topk_idx", topk_idx), q=q,
                     out=output, graph=graph, names=DECODE_NAMES if batch.num_decodes else VLLM_NAMES)
    return bound


def run_scores(fn: str, idx_q: torch.Tensor, index_cache: torch.Tensor, batch: BatchMetadata, out: torch.Tensor,
               params: SparseAttentionParams, max_query_len: int, decode_query_len: int, graph: bool) -> None:
    """``batch``'s block scores into every element of ``out`` (``[H, T, N]``, any strides): the selected
    backend's ``index_scores``, or, where it has none (its selection's trace says so), mm3's torch scorer
    on a call admitted at the same boundary."""
    idx_q, caches, bound = index_call(fn, Op.INDEX_SCORES, idx_q, index_cache, params, decode_query_len, graph)
    target = bound.target
    names = SCORE_NAMES[not batch.num_decodes]
    call = dict(caches=caches, batch=batch, index_q=idx_q, out=out, graph=graph, names=names)
    if target.scorer is not None:
        target.run(fn, (Op.INDEX_SCORES,), **call)  # type: ignore[arg-type]
        return
    target.admit_call(fn, (Op.INDEX_SCORES,), **call)  # type: ignore[arg-type]
    N = out.shape[2]
    out.copy_(block_scores(idx_q, index_cache, batch, num_blocks=N, max_query_len=max_query_len,
                           forced=(params.init_blocks, params.local_blocks))[:, :, :N])


def decode_scores(fn: str, idx_q: torch.Tensor, index_kv_cache: torch.Tensor, batch: BatchMetadata,
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
        run_scores(fn, idx_q, index_kv_cache, batch, out, params, dql, max_dql, graph)
    return score_out
