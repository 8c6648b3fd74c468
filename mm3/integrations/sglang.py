"""SGLang's MiniMax-M3 sparse attention served by mm3: the same names, arguments and results.

SGLang 0.5.23 runs MiniMax-M3's sparse layers through two entry points of
``sglang.srt.layers.attention.minimax_sparse_ops.minimax_sparse`` and four
kernel-level functions of ``sglang.kernels.ops.attention.minimax_sparse``. This
module has the six, with SGLang's names, positional order, defaults and
results, run on the backends mm3's selection picks (``MM3_BACKEND``,
``mm3.use_backend``, :func:`mm3.integrations.targets.configure`); docs/engines.md,
"SGLang: change one import":

=======================================  ================================================================
SGLang function                          served by
=======================================  ================================================================
``minimax_sparse_decode``                the selected indexer and attention on the decode rows
``minimax_sparse_prefill``               the same on the extend batch (chunked prefill, mixed, verify)
``flash_decode_with_topk_idx``           the selected indexer on decode rows (returns ``(None, ids, None)``)
``flash_prefill_with_topk_index``        the selected indexer on an extend batch (returns ``(None, ids)``)
``flash_decode_with_gqa_share_sparse``   the selected attention on decode rows
``flash_prefill_with_gqa_share_sparse``  the selected attention on an extend batch
=======================================  ================================================================

SGLang's conventions hold: K and V are token-major ``[max_slots, num_kv_heads,
head_dim]`` and the index keys ``[max_slots, 1, idx_head_dim]``, read as pages of
``block_size_k`` tokens through views (no copy); a token of row ``b`` lives at
``req_to_token[slot_ids[b], position]``; the top-k ids SGLang's functions return
are ``[num_kv_heads, rows, topk]`` int32, ascending, ``-1`` at the tail; fp8 K/V
(``float8_e4m3fn``, ``float8_e5m2``) take per-tensor ``k_scale``/``v_scale``
floats, and ``q_scale`` folds into ``sm_scale``; outputs are new tensors in q's
dtype (bfloat16 for fp8 queries). The step's metadata is built on the device.

Both of SGLang's addressings are read without a copy. With a ``page_size`` that is a
multiple of ``block_size_k`` (``--page-size 128``, MiniMax-M3's block) mm3 reads
pages: each block must be one aligned page of contiguous slots, which every call
checks on the device (a fault is an :class:`~mm3.InputError` at the next eager
call, or at once for a table in host memory). With any other ``page_size`` (1,
SGLang's default; 0) it reads token slots (docs/spec.md §2): each token's row
through ``req_to_token[slot_ids[b], position]``, on backends that declare them.
A batch-local ``page_table`` (keyword only, mm3's addition) replaces
``req_to_token``/``slot_ids``. An attention reads the valid ids of a row as a set,
wherever they sit (SGLang's reads the first ``count(ids >= 0)``).

Refused by name (:class:`~mm3.InputError` naming the function and argument):
``score_type="lse"``, an attention ``sink`` or ``idx_sink``, the index value
branch (``disable_index_value=False``), ``block_size_q > 1``, fnuz fp8 K/V,
a negative ``page_size``, more index heads than KV heads,
and SGLang's hooks into other kernels (``dense_main_attn_fn``,
``hisparse_swap_in_fn``, ``hisparse_slots``, ``loc_mapping``, ``indexer_cp``,
``use_dense_main_attn``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import BackendUnavailableError, InputError
from mm3.contract.hookspecs import STEP_OPS, Op
from mm3.contract.params import SparseAttentionParams
from mm3.debug.guard import capturing
from mm3.integrations import sglang_inputs as si
from mm3.integrations.no_grad import without_grad
from mm3.integrations.sglang_inputs import RELEASE
from mm3.integrations.targets import bind_call, context, memo, remember
from mm3.integrations.vllm_inputs import kept, stand_in
from mm3.runtime.selection import requirements_for
from mm3.runtime.step import BOTH, OpTarget

__all__ = ["minimax_sparse_decode", "minimax_sparse_prefill", "flash_decode_with_topk_idx",
           "flash_prefill_with_topk_index", "flash_decode_with_gqa_share_sparse",
           "flash_prefill_with_gqa_share_sparse", "RELEASE"]


@functools.lru_cache(maxsize=1024)
def _make_params(num_heads: int, num_kv_heads: int, head_dim: int, num_index_heads: int, index_head_dim: int,
                 block_size: int, topk: int, init_blocks: int, local_blocks: int,
                 scale: float) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 num_index_heads=num_index_heads, index_head_dim=index_head_dim,
                                 block_size=block_size, topk=topk, init_blocks=init_blocks,
                                 local_blocks=local_blocks, scale=scale)


def _params(fn: str, *args: Any) -> SparseAttentionParams:
    try:
        return _make_params(*args)
    except (InputError, ValueError) as e:
        raise InputError(f"{fn}: {e}") from None


#: ``(params, context bound under, target, graph safe)`` by what a call's choice is made of (``params`` by identity,
#: kept with it: ``_make_params`` hands calls of the same numbers one object); emptied by targets.configure
_TARGETS: dict[tuple[object, ...], tuple[SparseAttentionParams, tuple[object, ...], OpTarget, bool]] = memo()


def _target(fn: str, op: Optional[Op], params: SparseAttentionParams, dtype: torch.dtype, index_dtype: torch.dtype,
            kv_dtype: torch.dtype, device: torch.device, graph: bool, batch: Any) -> OpTarget:
    """The bound backends of a call (one choice per requirements serves every function of this module); a
    captured call of a backend that is not CUDA-graph safe is refused with the reason. A call like an earlier
    one, in the same context (backend names, settings, registry), takes its target."""
    addressing = batch.facts.addressing    # token slots: only a backend that declares them is chosen
    key = (op, id(params), dtype, index_dtype, kv_dtype, device, addressing)
    got = _TARGETS.get(key)
    ctx = context()
    if got is not None and got[0] is params and got[1] == ctx and (got[3] or not graph):
        return got[2]
    bound = bind_call(("sglang", params, dtype, index_dtype, kv_dtype, device, addressing),
                      lambda: requirements_for(params, dtype, index_dtype, device, kv_dtype=kv_dtype,
                                               addressing=addressing).for_ops(*STEP_OPS), params, device, graph)
    sel = bound.selection
    unsafe = [be for be in ((sel.indexer, sel.attention) if op is None else
                            (sel.indexer if op == Op.INDEX_TOPK else sel.attention,))
              if not be.capabilities.cuda_graph_safe]
    if graph and unsafe:
        raise BackendUnavailableError(
            f"{fn}: backend {unsafe[0].name!r}, selected for this call, is not CUDA-graph safe (it does not declare "
            f"cuda_graph_safe): run this call outside CUDA-graph capture, or select a backend that is "
            f"(MM3_BACKEND, mm3.use_backend); its selection:\n{sel.explain()}")
    if not graph:
        remember(_TARGETS, key, (params, ctx, bound.target, not unsafe))
    return bound.target


def _run(fn: str, ops: tuple[Op, ...], target: OpTarget, caches: PagedKVCache, batch: Any, word: Any,
         names: Any, graph: bool, **call: Any) -> None:
    si.record_pages(target.flag, word, fn, names, batch, caches.num_pages, graph)
    # SGLang's order: the rows an index op writes come back ascending, and rows SGLang hands in are
    target.run(fn, ops, caches=caches, batch=batch, graph=graph, names=names, order=si.ORDER, **call)


def _attention_step(fn: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: object,
                    v_scale: object, sm_scale: Optional[float], q_scale: object, block_size: int, topk: int,
                    index: Optional[tuple[torch.Tensor, torch.Tensor]], init_local: tuple[int, int],
                    graph: bool, page: int) -> tuple[torch.Tensor, PagedKVCache, SparseAttentionParams, torch.Tensor]:
    """``(q, caches, params, out)`` of a call that attends (``index``: ``(idx_q, idx_k_cache)`` when it
    also selects; ``page``: the tokens of a cache page, :func:`_page_rows`)."""
    si.tensor_arg(fn, "q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    kv = si.kv_caches(fn, k_cache, v_cache, k_scale, v_scale, page, graph)
    q = si.widen(q)
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    scale = (D ** -0.5 if sm_scale is None else si.positive(fn, "sm_scale", sm_scale)) * \
        si.positive(fn, "q_scale", q_scale)
    if index is None:   # no indexer: its shapes stand in (one index head per KV head, nothing forced)
        shape = (*kv[0].shape[:2], D)     # an attention never reads the index keys: a one-element stand-in
        (index_keys,) = kept(("stand-in", q.dtype, q.device, shape), graph, stand_in, q.dtype, q.device, shape)
        caches = PagedKVCache.rewrap(kv[0], kv[1], index_keys, *kv[2:])  # type: ignore[arg-type]
        params = _params(fn, Hq, Hkv, D, Hkv, D, block_size, topk, 0, 0, scale)
    else:
        idx_q, idx_k_cache = index
        si.one_index_head(fn, idx_q.shape[1], Hkv)
        caches = si.index_caches(fn, idx_k_cache, Hkv, page, graph, kv)  # type: ignore[arg-type]
        params = _params(fn, Hq, Hkv, D, Hkv, idx_q.shape[2], block_size, topk, *init_local, scale)
    return q, caches, params, torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)


def _index_query(fn: str, name: str, q: object, scales: tuple[tuple[str, object], ...]) -> torch.Tensor:
    """The index queries, their dtype widened where mm3 reads another, after checking the factors ``scales``
    (positive factors on every index score: the ranking, all mm3 returns, is theirs)."""
    si.tensor_arg(fn, name, q, 3, "[num_tokens, num_idx_heads, idx_head_dim]")
    for scale, value in scales:
        si.positive(fn, scale, value)
    return si.widen(q)  # type: ignore[arg-type]


def _index_step(fn: str, q: torch.Tensor, k_cache: torch.Tensor, block_size: int, topk: int, init_blocks: int,
                local_blocks: int, scales: tuple[tuple[str, object], ...],
                page: int, graph: bool) -> tuple[torch.Tensor, PagedKVCache, SparseAttentionParams]:
    """``(idx_q, caches, params)`` of a kernel-level index call (each index head stands for a KV head)."""
    q = _index_query(fn, "q", q, scales)
    H, Di = q.shape[1], q.shape[2]
    caches = si.index_caches(fn, k_cache, H, page, graph, dtype=q.dtype)
    return q, caches, _params(fn, H, H, Di, H, Di, block_size, topk, init_blocks, local_blocks, 1.0)


def _topk_out(fn: str, name: str, t: Optional[torch.Tensor], shape: tuple[int, int, int],
              device: torch.device) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=torch.int32, device=device)
    si.tensor_arg(fn, name, t, 3, "[num_kv_heads, num_tokens, topk]")
    if tuple(t.shape) != shape or t.dtype != torch.int32:
        raise InputError(f"{fn}: {name} is {tuple(t.shape)} {t.dtype}, needs {list(shape)} int32 (num_kv_heads, "
                         f"query tokens, topk)")
    return t


# -- the entry points ----------------------------------------------------------------------------

@without_grad
def minimax_sparse_decode(q: torch.Tensor, sink: Optional[torch.Tensor], k_cache: torch.Tensor,
                          v_cache: torch.Tensor, idx_q: torch.Tensor, idx_sink: Optional[torch.Tensor],
                          idx_k_cache: torch.Tensor, idx_v_cache: Optional[torch.Tensor],
                          req_to_token: Optional[torch.Tensor], slot_ids: Optional[torch.Tensor],
                          seq_lens: torch.Tensor, max_seqlen: int, block_size_q: int, block_size_k: int, topk: int,
                          init_blocks: int, local_blocks: int, sm_scale: Optional[float] = None,
                          idx_sm_scale: Optional[float] = None, score_type: str = "max",
                          disable_index_value: bool = False, dense_main_attn_fn: Optional[Callable] = None,
                          page_size: int = 1, use_msa: bool = False, msa_kv_indices: Optional[torch.Tensor] = None,
                          msa_plan: Any = None, q_scale: Optional[float] = None, k_scale: Optional[float] = None,
                          v_scale: Optional[float] = None, idx_q_scale: Optional[float] = None,
                          idx_k_scale: Optional[float] = None, idx_v_scale: Optional[float] = None,
                          cached_topk_idx: Optional[torch.Tensor] = None, topk_out: Optional[torch.Tensor] = None,
                          hisparse_swap_in_fn: Optional[Callable] = None, indexer_cp: Any = None,
                          packed_queries: int = 1, *,
                          page_table: Optional[torch.Tensor] = None) -> tuple[None, torch.Tensor]:
    """One decode step of a sparse layer: ``(None, o)``, ``o`` ``[rows, num_q_heads, head_dim]``.

    Each row of ``q``/``idx_q`` is one query token at position ``seq_lens[b] - 1`` of the request in
    ``slot_ids[b]`` (speculative verify rows each carry their own ``seq_len``; ``packed_queries`` is a
    hint mm3 does not need). ``cached_topk_idx``: attend over these ids and select nothing;
    ``topk_out``: also receives the selection, ascending, ``-1`` last. ``use_msa``, ``msa_kv_indices``,
    ``msa_plan`` pick SGLang's own attention kernel and are not read; ``idx_sm_scale``, ``idx_q_scale``,
    ``idx_k_scale`` scale every index score alike and leave the selection as it is.
    """
    fn = "minimax_sparse_decode"
    si.refusals(fn, score_type=score_type, sink=sink, idx_sink=idx_sink, disable_index_value=disable_index_value,
            block_size_q=block_size_q, page_size=page_size, block_size_k=block_size_k,
            hooks=(("dense_main_attn_fn", dense_main_attn_fn), ("hisparse_swap_in_fn", hisparse_swap_in_fn),
                   ("indexer_cp", indexer_cp)))
    graph = capturing(q)
    idx_q = _index_query(fn, "idx_q", idx_q, (("idx_sm_scale", idx_sm_scale), ("idx_q_scale", idx_q_scale),
                                               ("idx_k_scale", idx_k_scale)))
    index = None if cached_topk_idx is not None else (idx_q, idx_k_cache)
    q, caches, params, o = _attention_step(fn, q, k_cache, v_cache, k_scale, v_scale, sm_scale, q_scale,
                                           block_size_k, topk, index, (init_blocks, local_blocks), graph,
                                           si.page_rows(page_size, block_size_k))
    sl = si.int_arg(fn, "seq_lens", seq_lens, 1, "[batch]")
    T, Hkv = q.shape[0], caches.num_kv_heads
    if sl.shape[0] != T:
        raise InputError(f"{fn}: seq_lens has {sl.shape[0]} rows, q {T}: one query token per row")
    bt, word, slots = si.addressing(fn, req_to_token, slot_ids, page_table, sl, max_seqlen, block_size_k, page_size,
                           caches.num_pages)
    batch = si.decode_batch(sl, bt, block_size_k, slots)
    names = si.names(block_size_k, page_table is not None, prefill=False)
    if cached_topk_idx is not None:
        ids = si.topk_arg(fn, "cached_topk_idx", cached_topk_idx, Hkv, T)
        target = _target(fn, Op.ATTENTION, params, q.dtype, caches.index_dtype, caches.dtype, q.device, graph, batch)
        if T:
            _run(fn, (Op.ATTENTION,), target, caches, batch, word, names, graph, topk=ids, q=q, out=o)
        return None, o
    ids_t = _topk_out(fn, "topk_out", topk_out, (Hkv, T, topk), q.device)
    target = _target(fn, None, params, q.dtype, caches.index_dtype, caches.dtype, q.device, graph, batch)
    if T:
        _run(fn, BOTH, target, caches, batch, word, names, graph, topk=TopkBuffer(ids_t), index_q=idx_q, q=q, out=o)
    return None, o


@without_grad
def minimax_sparse_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           sink: Optional[torch.Tensor], idx_q: torch.Tensor, idx_k_cache: torch.Tensor,
                           idx_v_cache: Optional[torch.Tensor], idx_sink: Optional[torch.Tensor],
                           req_to_token: Optional[torch.Tensor], slot_ids: Optional[torch.Tensor],
                           cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, prefix_lens: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, block_size_q: int, block_size_k: int, topk: int,
                           init_blocks: int, local_blocks: int, sm_scale: Optional[float] = None,
                           idx_sm_scale: Optional[float] = None, score_type: str = "max",
                           disable_index_value: bool = False, use_msa: bool = False,
                           cu_seqblocks_q: Optional[torch.Tensor] = None, max_seqblock_q: Optional[int] = None,
                           all_seqblock_q: Optional[int] = None, seqlens_cpu: Optional[list[int]] = None,
                           q_scale: Optional[float] = None, k_scale: Optional[float] = None,
                           v_scale: Optional[float] = None, idx_q_scale: Optional[float] = None,
                           idx_k_scale: Optional[float] = None, idx_v_scale: Optional[float] = None,
                           cached_topk_idx: Optional[torch.Tensor] = None, return_topk_idx: bool = False,
                           loc_mapping: Optional[torch.Tensor] = None, page_size: int = 1,
                           seq_lens_cpu: Optional[torch.Tensor] = None, *,
                           page_table: Optional[torch.Tensor] = None) -> tuple[Any, ...]:
    """One extend step of a sparse layer: ``(None, o)``, or ``(None, o, topk_idx)`` with ``return_topk_idx``.

    Request ``r`` holds query tokens ``[cu_seqlens[r], cu_seqlens[r + 1])`` at positions from
    ``prefix_lens[r]`` on; ``seq_lens[r]`` counts its cached tokens including this chunk's
    (chunked prefill; SGLang's mixed chunks and speculative verify are extends too). ``topk_idx``
    is ``[num_kv_heads, num_tokens, topk]``, ascending, ``-1`` last (``cached_topk_idx`` itself when
    given). The seqblock metadata, ``seqlens_cpu`` and ``seq_lens_cpu`` are SGLang's precomputed
    helpers and are not read.
    """
    fn = "minimax_sparse_prefill"
    si.refusals(fn, score_type=score_type, sink=sink, idx_sink=idx_sink, disable_index_value=disable_index_value,
            block_size_q=block_size_q, page_size=page_size, block_size_k=block_size_k,
            hooks=(("loc_mapping", loc_mapping),))
    graph = capturing(q)
    idx_q = _index_query(fn, "idx_q", idx_q, (("idx_sm_scale", idx_sm_scale), ("idx_q_scale", idx_q_scale),
                                               ("idx_k_scale", idx_k_scale)))
    index = None if cached_topk_idx is not None else (idx_q, idx_k_cache)
    q, caches, params, o = _attention_step(fn, q, k_cache, v_cache, k_scale, v_scale, sm_scale, q_scale,
                                           block_size_k, topk, index, (init_blocks, local_blocks), graph,
                                           si.page_rows(page_size, block_size_k))
    T, Hkv = q.shape[0], caches.num_kv_heads
    sl = si.int_arg(fn, "seq_lens", seq_lens, 1, "[batch]")
    pl = si.int_arg(fn, "prefix_lens", prefix_lens, 1, "[batch]")
    bt, word, slots = si.addressing(fn, req_to_token, slot_ids, page_table, sl, max_seqlen_k, block_size_k, page_size,
                           caches.num_pages)
    batch = si.prefill_batch(fn, cu_seqlens, sl, bt, T, max_seqlen_q, block_size_k, pl, slots)
    names = si.names(block_size_k, page_table is not None, prefill=True)
    if cached_topk_idx is not None:
        ids = si.topk_arg(fn, "cached_topk_idx", cached_topk_idx, Hkv, T)
        target = _target(fn, Op.ATTENTION, params, q.dtype, caches.index_dtype, caches.dtype, q.device, graph, batch)
        if T:
            _run(fn, (Op.ATTENTION,), target, caches, batch, word, names, graph, topk=ids, q=q, out=o)
        return (None, o, cached_topk_idx) if return_topk_idx else (None, o)
    ids_t = torch.empty((Hkv, T, topk), dtype=torch.int32, device=q.device)
    target = _target(fn, None, params, q.dtype, caches.index_dtype, caches.dtype, q.device, graph, batch)
    if T:
        _run(fn, BOTH, target, caches, batch, word, names, graph, topk=TopkBuffer(ids_t), index_q=idx_q, q=q, out=o)
    return (None, o, ids_t) if return_topk_idx else (None, o)


# -- the kernel-level functions ------------------------------------------------------------------

@without_grad
def flash_decode_with_topk_idx(q: torch.Tensor, sink: Optional[torch.Tensor], k_cache: torch.Tensor,
                               v_cache: Optional[torch.Tensor], req_to_token: Optional[torch.Tensor],
                               seq_lens: torch.Tensor, max_seqlen: int, slot_ids: Optional[torch.Tensor],
                               block_size: int, topk: int, init_blocks: int, local_blocks: int,
                               sm_scale: Optional[float] = None, use_tma: bool = True, score_type: str = "max",
                               disable_index_value: bool = False, use_dense_main_attn: bool = False,
                               page_size: int = 1, q_scale: Optional[float] = None, k_scale: Optional[float] = None,
                               v_scale: Optional[float] = None, *,
                               page_table: Optional[torch.Tensor] = None) -> tuple[None, torch.Tensor, None]:
    """The blocks each decode row selects: ``(None, topk_idx, None)``, ``topk_idx`` ``[num_idx_heads, rows,
    topk]`` int32, ascending, ``-1`` last. ``q`` is the index query, ``k_cache`` the index keys
    ``[max_slots, 1, idx_head_dim]``; each index head selects its own blocks."""
    fn = "flash_decode_with_topk_idx"
    si.refusals(fn, score_type=score_type, sink=sink, disable_index_value=disable_index_value, page_size=page_size,
            block_size_k=block_size, hooks=(("use_dense_main_attn", use_dense_main_attn),))
    graph = capturing(q)
    q, caches, params = _index_step(fn, q, k_cache, block_size, topk, init_blocks, local_blocks,
                                    (("sm_scale", sm_scale), ("q_scale", q_scale), ("k_scale", k_scale)),
                                    si.page_rows(page_size, block_size), graph)
    sl = si.int_arg(fn, "seq_lens", seq_lens, 1, "[batch]")
    T, H = q.shape[0], q.shape[1]
    if sl.shape[0] != T:
        raise InputError(f"{fn}: seq_lens has {sl.shape[0]} rows, q {T}: one query token per row")
    bt, word, slots = si.addressing(fn, req_to_token, slot_ids, page_table, sl, max_seqlen, block_size, page_size,
                           caches.num_pages)
    batch = si.decode_batch(sl, bt, block_size, slots)
    ids = torch.empty((H, T, topk), dtype=torch.int32, device=q.device)
    target = _target(fn, Op.INDEX_TOPK, params, q.dtype, caches.index_dtype, q.dtype, q.device, graph, batch)
    if T:
        _run(fn, (Op.INDEX_TOPK,), target, caches, batch, word, si.names(block_size, page_table is not None, False)
             ._replace(index_q="q", index="k_cache"), graph, topk=TopkBuffer(ids), index_q=q)
    return None, ids, None


@without_grad
def flash_prefill_with_topk_index(q: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor],
                                  sink: Optional[torch.Tensor], req_to_token: Optional[torch.Tensor],
                                  slot_ids: Optional[torch.Tensor], cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
                                  prefix_lens: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, block_size_q: int,
                                  block_size_k: int, topk: int, init_blocks: int = 1, local_blocks: int = 2,
                                  sm_scale: Optional[float] = None, use_tma: bool = False, score_type: str = "max",
                                  disable_index_value: bool = False, cu_seqblocks_q: Optional[torch.Tensor] = None,
                                  max_seqblock_q: Optional[int] = None, all_seqblock_q: Optional[int] = None,
                                  q_scale: Optional[float] = None, k_scale: Optional[float] = None,
                                  v_scale: Optional[float] = None, page_size: int = 1, *,
                                  page_table: Optional[torch.Tensor] = None) -> tuple[None, torch.Tensor]:
    """The blocks each extend token selects: ``(None, topk_idx)``, ``topk_idx`` ``[num_idx_heads, num_tokens,
    topk]`` int32, ascending, ``-1`` last; the batch as in :func:`minimax_sparse_prefill`."""
    fn = "flash_prefill_with_topk_index"
    si.refusals(fn, score_type=score_type, sink=sink, disable_index_value=disable_index_value,
            block_size_q=block_size_q, page_size=page_size, block_size_k=block_size_k)
    graph = capturing(q)
    q, caches, params = _index_step(fn, q, k_cache, block_size_k, topk, init_blocks, local_blocks,
                                    (("sm_scale", sm_scale), ("q_scale", q_scale), ("k_scale", k_scale)),
                                    si.page_rows(page_size, block_size_k), graph)
    T, H = q.shape[0], q.shape[1]
    sl = si.int_arg(fn, "seq_lens", seq_lens, 1, "[batch]")
    pl = si.int_arg(fn, "prefix_lens", prefix_lens, 1, "[batch]")
    bt, word, slots = si.addressing(fn, req_to_token, slot_ids, page_table, sl, max_seqlen_k, block_size_k, page_size,
                           caches.num_pages)
    batch = si.prefill_batch(fn, cu_seqlens, sl, bt, T, max_seqlen_q, block_size_k, pl, slots)
    ids = torch.empty((H, T, topk), dtype=torch.int32, device=q.device)
    target = _target(fn, Op.INDEX_TOPK, params, q.dtype, caches.index_dtype, q.dtype, q.device, graph, batch)
    if T:
        _run(fn, (Op.INDEX_TOPK,), target, caches, batch, word, si.names(block_size_k, page_table is not None, True)
             ._replace(index_q="q", index="k_cache"), graph, topk=TopkBuffer(ids), index_q=q)
    return None, ids


@without_grad
def flash_decode_with_gqa_share_sparse(q: torch.Tensor, sink: Optional[torch.Tensor], k_cache: torch.Tensor,
                                       v_cache: torch.Tensor, req_to_token: Optional[torch.Tensor],
                                       seq_lens: torch.Tensor, slot_ids: Optional[torch.Tensor], block_size: int,
                                       topk_idx: torch.Tensor, sm_scale: Optional[float] = None,
                                       use_tma: bool = True, page_size: int = 0, q_scale: Optional[float] = None,
                                       k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                                       hisparse_slots: Optional[torch.Tensor] = None, *,
                                       page_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sparse attention of decode rows over ``topk_idx`` (``[num_kv_heads, rows, topk]``): ``o``
    ``[rows, num_q_heads, head_dim]``. The valid ids of a row are read as a set."""
    fn = "flash_decode_with_gqa_share_sparse"
    si.refusals(fn, sink=sink, page_size=page_size, block_size_k=block_size,
                hooks=(("hisparse_slots", hisparse_slots),))
    graph = capturing(q)
    si.tensor_arg(fn, "topk_idx", topk_idx, 3, "[num_kv_heads, rows, topk]")
    q, caches, params, o = _attention_step(fn, q, k_cache, v_cache, k_scale, v_scale, sm_scale, q_scale, block_size,
                                           topk_idx.shape[2], None, (0, 0), graph, si.page_rows(page_size, block_size))
    T = q.shape[0]
    sl = si.int_arg(fn, "seq_lens", seq_lens, 1, "[batch]")
    if sl.shape[0] != T:
        raise InputError(f"{fn}: seq_lens has {sl.shape[0]} rows, q {T}: one query token per row")
    ids = si.topk_arg(fn, "topk_idx", topk_idx, caches.num_kv_heads, T)
    bt, word, slots = si.addressing(fn, req_to_token, slot_ids, page_table, sl, None, block_size, page_size,
                           caches.num_pages)
    batch = si.decode_batch(sl, bt, block_size, slots)
    target = _target(fn, Op.ATTENTION, params, q.dtype, q.dtype, caches.dtype, q.device, graph, batch)
    if T:
        _run(fn, (Op.ATTENTION,), target, caches, batch, word, si.names(block_size, page_table is not None, False),
             graph, topk=ids, q=q, out=o)
    return o


@without_grad
def flash_prefill_with_gqa_share_sparse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                        sink: Optional[torch.Tensor], req_to_token: Optional[torch.Tensor],
                                        slot_ids: Optional[torch.Tensor], topk_idx: torch.Tensor, block_size_q: int,
                                        block_size_k: int, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
                                        prefix_lens: torch.Tensor, max_seqlen_q: int, sm_scale: Optional[float] = None,
                                        use_tma: bool = True, cu_seqblocks_q: Optional[torch.Tensor] = None,
                                        max_seqblock_q: Optional[int] = None, q_scale: Optional[float] = None,
                                        k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                                        loc_mapping: Optional[torch.Tensor] = None, *,
                                        page_table: Optional[torch.Tensor] = None,
                                        page_size: Optional[int] = None) -> torch.Tensor:
    """Sparse attention of an extend batch over ``topk_idx`` (``[num_kv_heads, num_tokens, topk]``): ``o``
    ``[num_tokens, num_q_heads, head_dim]``. SGLang's function takes no ``page_size``: by default the pages
    of ``req_to_token`` are checked as in the others; ``page_size=1`` (keyword only, mm3's addition) reads
    it per token (token slots)."""
    fn = "flash_prefill_with_gqa_share_sparse"
    si.refusals(fn, sink=sink, block_size_q=block_size_q, block_size_k=block_size_k, page_size=page_size,
            hooks=(("loc_mapping", loc_mapping),))
    graph = capturing(q)
    si.tensor_arg(fn, "topk_idx", topk_idx, 3, "[num_kv_heads, num_tokens, topk]")
    q, caches, params, o = _attention_step(fn, q, k_cache, v_cache, k_scale, v_scale, sm_scale, q_scale,
                                           block_size_k, topk_idx.shape[2], None, (0, 0), graph,
                                           si.page_rows(page_size, block_size_k))
    T = q.shape[0]
    ids = si.topk_arg(fn, "topk_idx", topk_idx, caches.num_kv_heads, T)
    sl = si.int_arg(fn, "seq_lens", seq_lens, 1, "[batch]")
    pl = si.int_arg(fn, "prefix_lens", prefix_lens, 1, "[batch]")
    bt, word, slots = si.addressing(fn, req_to_token, slot_ids, page_table, sl, None, block_size_k, page_size,
                                  caches.num_pages)
    batch = si.prefill_batch(fn, cu_seqlens, sl, bt, T, max_seqlen_q, block_size_k, pl, slots)
    target = _target(fn, Op.ATTENTION, params, q.dtype, q.dtype, caches.dtype, q.device, graph, batch)
    if T:
        _run(fn, (Op.ATTENTION,), target, caches, batch, word, si.names(block_size_k, page_table is not None, True),
             graph, topk=ids, q=q, out=o)
    return o
