"""Triton indexer kernels (docs/spec.md §3): block scores, forced blocks and top-k selection.

Four kernels, all stride-generic (index queries, the paged index cache, the
block table and the top-k buffer are addressed through their element strides,
so head-major and token-major buffers work without copies):

``_decode_score_kernel``  grid ``(decode requests, context splits)``
    One program owns a run of ``BPS`` consecutive blocks of one decode request
    and scores them for *every* row of that request at once: rows are
    ``(speculative row, index head)`` pairs, so each index key (shared by all
    index heads) is read from memory exactly once per step. It writes the
    per-block maximum (docs/spec.md §3.3) to a small fp32 workspace
    ``[requests, rows, table_width]``. A streamed decode step launches the
    transposed grid, request by request (``Algorithms.streamed_decode``).

``_decode_topk_kernel``   grid ``(decode requests, rows)``
    Loads one row of block scores, applies the forced init/local blocks and
    selects ``min(K, nb)`` blocks (ties: lowest block id) by one bitonic
    ``tl.topk`` over packed (score, -id) keys; writes a prefix of ids then ``-1``. With
    ``Algorithms.topk_in_last_program`` it is not launched: the last score
    program of each request does the same selection (:mod:`.arrivals`).

``_prefill_index_kernel`` grid ``(prefill requests, token tiles, splits)``
    One program takes a tile of consecutive query tokens of one prefill request
    for all index heads, walks the visible blocks once (``tl.dot`` on
    ``[tokens*heads, Di] x [Di, B]`` tiles, causal mask inside each block) and
    keeps a running top-K per row in registers, as packed keys merged once per
    chunk of blocks, so no ``[H, T, blocks]`` score matrix is ever written,
    whatever the context length. When the tiles alone do not fill the device,
    each tile's blocks are split over programs and ``_prefill_index_merge_kernel``
    merges their top-K.

Decode grids depend only on shapes (CUDA-graph capturable); the prefill grid
uses the host-side maximum prefill length.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mm3.plugin import BatchMetadata
from mm3.plugin import PagedKVCache, TopkBuffer
from mm3.plugin import SparseAttentionParams

from .fast_launch import launch
from .launch import LaunchConfig, next_pow2
from .addressing import block_columns, slot_args
from .block_max import _block_max_scores, _block_page
from .contents import check_contents, judge_args, judge_request, unjudged_args
from .nvfp4 import index_block_scale_args
from .plans import decode_index_plan
from .tiles import load_query_rows, token_rows, visible_blocks
from .arrivals import arrival_counters, capture_matters, offer_ready_flags
from .scratch import scratch
from .tl_utils import (arrive_last, dot_config, grid_wait, launch_options, pdl_prologue,
                       release_dependents, step_kernel, streamed_enabled)

__all__ = ["index_topk"]

# docs/spec.md §3.4 constants; tl.constexpr so the kernels may read them as globals
FORCED_INIT = tl.constexpr(1e30)
FORCED_LOCAL = tl.constexpr(1e29)


@step_kernel("T", "W", "j_R", "j_T", "j_nd", "j_dql", "j_ndt", "j_mpq", "j_M")
def _decode_score_kernel(
    iq_ptr, s_iq_t, s_iq_h, s_iq_d, ik_ptr, s_ik_p, s_ik_b, s_ik_d, bt_ptr, s_bt_r, s_bt_b, num_pages, faults_ptr,
    qsl_ptr, pos_ptr, ws_ptr, s_ws_r, s_ws_row, H, T, W, out_ptr, s_out_h, s_out_t, s_out_k, cnt_ptr, ready_ptr,
    is_ptr, s_is_p, s_is_b, s_is_d, st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
    j_qsl, j_sl, j_ctx, j_bt, j_s_bt_r, j_s_bt_b, j_t2r, j_pos, j_word, j_R, j_T, j_nd, j_dql, j_ndt, j_mpq, j_M,
    j_pages, j_st, j_s_st_r, j_s_st_c, j_st_rows, j_sr,
    B: tl.constexpr, BN: tl.constexpr, DI: tl.constexpr, ROWS: tl.constexpr, Q: tl.constexpr,
    BPS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    SCALE_Q: tl.constexpr = False, NAN_IN_MAX: tl.constexpr = False, PDL: tl.constexpr = False,
    TOPK_LAST: tl.constexpr = False, K: tl.constexpr = 1, K_PAD: tl.constexpr = 1, NB_PAD: tl.constexpr = 1,
    INIT: tl.constexpr = 0, LOCAL: tl.constexpr = 0, R_TK: tl.constexpr = 1, TK_ROWS: tl.constexpr = 1,
    STREAM: tl.constexpr = False, TRIGGER: tl.constexpr = False, INDEX_NVFP4: tl.constexpr = False,
    SLOTS: tl.constexpr = False, JUDGE: tl.constexpr = False, J_B: tl.constexpr = 1, J_CTX: tl.constexpr = False,
    J_TILE: tl.constexpr = 64,
):
    """Scores of ``BPS`` blocks of one request for all its rows: request ``program_id(0)``, split
    ``program_id(1)``. With ``TOPK_LAST`` the request's last score program to finish (:mod:`.arrivals`,
    counter ``cnt_ptr[r]``) then selects the top-k of its ``TK_ROWS`` rows, ``R_TK`` rows at a time
    (no top-k launch).

    ``STREAM`` (with ``TOPK_LAST``): the attention overlaps this kernel. The grid is
    ``(splits, requests)``, launched request by request, so with several waves of programs the
    requests finish one wave after another. Split 0 of each request first lowers the request's
    ready flag ``ready_ptr[r]``, then every program lets the next kernel launch (``TRIGGER``); the
    request's last program raises the flag after its top-k is stored. The next kernel launches
    only once every program has started, so after every lowering, and a flag is raised only after
    its request's split 0 arrived: a waiting attention program never sees an earlier step's flag.

    ``SLOTS``: token slots (:mod:`.addressing`; ``st_ptr`` .. ``sr_ptr``: the slot table, its strides,
    rows and columns, and each request's row of it), else dummies never read.

    ``JUDGE``: split 0 of each request also judges its contents (``j_*``: :func:`.contents.judge_args`,
    ``J_B`` its block, ``J_CTX`` its context flag), so a step of decodes needs no launch of its own for
    them; else ``j_*`` are never read.

    ``T``: the step's decode tokens, ``W``: the block table's columns. The contents are judged while
    this runs, so a row is a token only below ``T`` and sees at most ``W`` blocks
    (:func:`.tiles.token_rows`), whatever the query starts and positions hold."""
    if STREAM:
        r = tl.program_id(1)
        sp = tl.program_id(0)
        splits = tl.num_programs(0)
        grid_wait(PDL)
        if sp == 0:
            tl.atomic_xchg(ready_ptr + r, 0, sem="relaxed", scope="gpu")
        release_dependents(TRIGGER or PDL)
    else:
        pdl_prologue(PDL)
        r = tl.program_id(0)
        sp = tl.program_id(1)
        splits = tl.num_programs(1)
    if JUDGE:
        if sp == 0:
            judge_request(r, j_qsl, j_sl, j_ctx, j_bt, j_s_bt_r, j_s_bt_b, j_t2r, j_pos, j_word, j_R, j_T, j_nd,
                          j_dql, j_ndt, j_mpq, j_M, j_pages, j_st, j_s_st_r, j_s_st_c, j_st_rows, j_sr,
                          J_B, J_CTX, J_TILE, SLOTS)
    b0 = sp * BPS
    # rows = (speculative row, index head): every index key is read once for all of them
    tok, hh, row_in, pos, row_ok, nb = token_rows(qsl_ptr, pos_ptr, r, 0, H, 0, T, W, ROWS, Q, B)
    nb_req = tl.max(nb, axis=0)
    if b0 < nb_req:
        q, row_scale = load_query_rows(iq_ptr, tok, hh, s_iq_t, s_iq_h, s_iq_d, row_ok, DI, DOT_DTYPE, SCALE_Q)
        rows = tl.arange(0, ROWS)
        for b in tl.range(b0, tl.minimum(b0 + BPS, nb_req)):
            page, slot_blk, cols_left = _block_page(bt_ptr, s_bt_r, s_bt_b, num_pages, faults_ptr, r, b, st_ptr,
                                                    s_st_r, s_st_c, st_rows, st_width, sr_ptr, B, SLOTS)
            smax = _block_max_scores(q, ik_ptr + page * s_ik_p, s_ik_b, s_ik_d, b, pos, row_scale,
                                     ROWS, B, BN, DI, DOT_DTYPE, DOT_PREC, NAN_IN_MAX, 0, True,
                                     is_ptr + page * s_is_p, s_is_b, s_is_d, INDEX_NVFP4, slot_blk, s_st_c, cols_left,
                                     num_pages, s_ik_p, s_is_p, SLOTS)
            tl.store(ws_ptr + r * s_ws_r + rows * s_ws_row + b, smax, mask=row_ok)
    if TOPK_LAST:
        if arrive_last(cnt_ptr, r, splits):
            for row0 in tl.static_range(0, TK_ROWS, R_TK):
                _select_rows(ws_ptr + r * s_ws_r, s_ws_row, qsl_ptr, pos_ptr, out_ptr, s_out_h, s_out_t, s_out_k,
                             H, T, W, r, row0, TK_ROWS, B, K, K_PAD, NB_PAD, INIT, LOCAL, R_TK, ".cg")
            if STREAM:   # every thread's top-k stores, then the flag (release: they come first)
                tl.debug_barrier()
                tl.atomic_xchg(ready_ptr + r, 1, sem="release", scope="gpu")


@triton.jit
def _forced(S, blocks, nb, INIT: tl.constexpr, LOCAL: tl.constexpr):
    """Block scores ``S`` with the forced init and local blocks of a row that sees ``nb`` blocks applied
    (docs/spec.md §3.4: the first ``INIT`` and the last ``LOCAL`` visible blocks always win)."""
    S = tl.where(blocks < INIT, FORCED_INIT, S)
    return tl.where(blocks >= nb - LOCAL, FORCED_LOCAL, S)


@triton.jit
def _pack_keys(S, ids, avail, ID_SPAN: tl.constexpr):
    """int64 sort keys ordered like (score, -id): a descending sort gives the highest score first and,
    among equal scores, the lowest block id. Unavailable entries get the smallest key of all."""
    bits = S.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)      # monotone in the float value
    key = (ordered.to(tl.int64) << 32) | (ID_SPAN - 1 - ids).to(tl.int64)
    return tl.where(avail, key, -9223372036854775807 - 1)


@triton.jit
def _unpack_ids(key, ID_SPAN: tl.constexpr):
    """Block ids of keys from :func:`_pack_keys` (-1 for unavailable entries)."""
    ids = ID_SPAN - 1 - (key & 0xFFFFFFFF).to(tl.int32)
    return tl.where(key == -9223372036854775807 - 1, -1, ids)


@triton.jit
def _ascending_ids(top, K: tl.constexpr, K_PAD: tl.constexpr, ID_SPAN: tl.constexpr):
    """The ids of the best ``K`` of ``top`` (``[R, K_PAD]`` keys of :func:`_pack_keys`, best first) in
    ascending order, ``-1`` after them: the plugin's declared ``topk_order``, so no entry point sorts the
    rows again (SGLang's functions return them ascending). A ``K_PAD``-wide sort per row, next to the
    top-k that ranked a row's every block."""
    ids = _unpack_ids(top, ID_SPAN)
    slots = tl.arange(0, K_PAD)[None, :]
    # none (-1) and the slots past K sort last as int32's largest, then read -1 again
    key = tl.where((slots < K) & (ids >= 0), ids, 2147483647)
    key = tl.sort(key, 1)
    return tl.where(key == 2147483647, -1, key)


@triton.jit
def _select_rows(scores_ptr, s_row, qsl_ptr, pos_ptr, out_ptr, s_out_h, s_out_t, s_out_k, H, T, W, r, row0, num_rows,
                 B: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, NB_PAD: tl.constexpr, INIT: tl.constexpr,
                 LOCAL: tl.constexpr, R: tl.constexpr, CACHE: tl.constexpr):
    """Top-k of rows ``row0 .. row0+R-1`` (``(speculative row, index head)`` pairs) of decode request
    ``r``, from their block scores at ``scores_ptr + row * s_row``: the forced init/local blocks
    applied (docs/spec.md §3.4), then one bitonic ``tl.topk`` per row over packed (score, -id) keys.
    Writes its ids ascending, then ``-1`` (all ``-1`` for a padding token); skips rows past the
    request's tokens (and tokens outside ``[0, T)``, the step's decode tokens: a corrupt query start, as
    :func:`.tiles.token_rows` bounds it). ``CACHE``: the scores' load cache modifier (``".cg"`` when other programs
    of this launch wrote them)."""
    row = row0 + tl.arange(0, R)
    qi = row // H
    start = tl.load(qsl_ptr + r)
    tok = start + qi
    live = (row < num_rows) & (qi < tl.load(qsl_ptr + r + 1) - start) & (tok >= 0) & (tok < T)
    pos = tl.load(pos_ptr + tok, mask=live, other=-1)
    nb = visible_blocks(pos, pos >= 0, W, B)[:, None]
    blocks = tl.arange(0, NB_PAD)[None, :]
    avail = blocks < nb
    S = tl.load(scores_ptr + row[:, None] * s_row + blocks, mask=live[:, None] & avail, other=float("-inf"),
                cache_modifier=CACHE)
    top = tl.topk(_pack_keys(_forced(S, blocks, nb, INIT, LOCAL), blocks, avail, NB_PAD), K_PAD)
    slots = tl.arange(0, K_PAD)[None, :]
    tl.store(out_ptr + (row % H)[:, None] * s_out_h + tok[:, None] * s_out_t + slots * s_out_k,
             _ascending_ids(top, K, K_PAD, NB_PAD), mask=live[:, None] & (slots < K))


@step_kernel("T", "W")
def _decode_topk_kernel(
    ws_ptr, s_ws_r, s_ws_row, qsl_ptr, pos_ptr, out_ptr, s_out_h, s_out_t, s_out_k, H, T, W,
    B: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    INIT: tl.constexpr, LOCAL: tl.constexpr, PDL: tl.constexpr = False,
):
    """Top-k of row ``program_id(1)`` of decode request ``program_id(0)`` (:func:`_select_rows`; ``T``,
    ``W`` as :func:`_decode_score_kernel`'s)."""
    pdl_prologue(PDL)
    r = tl.program_id(0)
    row = tl.program_id(1)
    _select_rows(ws_ptr + r * s_ws_r, s_ws_row, qsl_ptr, pos_ptr, out_ptr, s_out_h, s_out_t, s_out_k, H, T, W, r, row,
                 row + 1, B, K, K_PAD, NB_PAD, INIT, LOCAL, 1, "")


@step_kernel("first_request", "T", "W", "s_ws_s", "first_token")
def _prefill_index_kernel(
    iq_ptr, s_iq_t, s_iq_h, s_iq_d, ik_ptr, s_ik_p, s_ik_b, s_ik_d, bt_ptr, s_bt_r, s_bt_b, num_pages, faults_ptr,
    qsl_ptr, pos_ptr, out_ptr, s_out_h, s_out_t, s_out_k, H, first_request, T, W,
    ws_ptr, s_ws_s, s_ws_t, first_token, is_ptr, s_is_p, s_is_b, s_is_d,
    st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
    B: tl.constexpr, BN: tl.constexpr, DI: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, CH: tl.constexpr,
    SCALE_Q: tl.constexpr = False, NAN_IN_MAX: tl.constexpr = False, SPLITS: tl.constexpr = 1,
    MASK_ALL: tl.constexpr = True, SORTED_MERGE: tl.constexpr = False, KEY_ROW: tl.constexpr = 0,
    INDEX_NVFP4: tl.constexpr = False, SLOTS: tl.constexpr = False,
):
    """Top-k of a tile of ``M`` tokens of prefill request ``first_request + program_id(0)`` for all index
    heads (rows ``(token, head)``); the running top-K is kept as packed keys and updated once per
    ``CH`` blocks (one bitonic top-k of the chunk, one of the merge), not by row reductions per block.

    ``MASK_ALL=False``: the causal mask only on key tiles some row sees in part
    (:func:`_block_max_scores`). ``SORTED_MERGE``: the chunk holds fp32 block
    scores, packed once per chunk (half the selects per block of int64 keys),
    and the running top-K is kept ascending, so the merge with the chunk's
    descending top-K is one elementwise max (the larger half of a bitonic
    sequence) and a bitonic merge, not a second top-k of twice the width. Both
    select the same packed keys, so the result is the same bit for bit.
    ``KEY_ROW`` > 0: the index cache's row stride (``s_ik_b``) compiled in, so
    each thread's key rows are one address plus immediates instead of sixteen
    64-bit addresses held in registers and rebuilt every block.

    With ``SPLITS > 1`` (grid axis 2) a program takes one of ``SPLITS`` equal ranges of its
    tile's visible blocks and writes its top-``K_PAD`` packed keys to ``ws[split, token -
    first_token, head, :]`` (an empty range writes "unavailable" keys) for
    :func:`_prefill_index_merge_kernel`; packed keys make the merged result exactly the
    single-pass one, ties included. ``SLOTS``: as :func:`_decode_score_kernel`'s. ``T``: the step's tokens
    (a row is a token only in ``[first_token, T)``, the step's prefills), ``W``: the block table's columns
    (:func:`.tiles.token_rows`)."""
    r = first_request + tl.program_id(0)
    tok, hh, row_in, pos, row_ok, nb_row = token_rows(qsl_ptr, pos_ptr, r, tl.program_id(1) * M, H, first_token,
                                                      T, W, ROWS, M, B)
    if KEY_ROW > 0:
        s_ik_b = KEY_ROW
    if tl.max(row_in.to(tl.int32), axis=0) > 0:
        nb_max = tl.max(nb_row, axis=0)
        span = tl.cdiv(nb_max, SPLITS)
        lo = tl.program_id(2) * span
        hi = tl.minimum(lo + span, nb_max)
        q, row_scale = load_query_rows(iq_ptr, tok, hh, s_iq_t, s_iq_h, s_iq_d, row_ok, DI, DOT_DTYPE, SCALE_Q)
        pos_min = tl.min(tl.where(row_ok, pos, 2147483647), axis=0)  # rows without a token never count
        cols = tl.arange(0, CH)[None, :]
        best = tl.full([ROWS, K_PAD], -9223372036854775807 - 1, tl.int64)
        for c0 in tl.range(lo, hi, CH):
            if SORTED_MERGE:
                chunk = tl.full([ROWS, CH], float("-inf"), tl.float32)
            else:
                chunk = tl.full([ROWS, CH], -9223372036854775807 - 1, tl.int64)
            for j in tl.range(0, tl.minimum(CH, hi - c0)):
                b = c0 + j
                page, slot_blk, cols_left = _block_page(bt_ptr, s_bt_r, s_bt_b, num_pages, faults_ptr, r, b, st_ptr,
                                                        s_st_r, s_st_c, st_rows, st_width, sr_ptr, B, SLOTS)
                sb = _block_max_scores(q, ik_ptr + page * s_ik_p, s_ik_b, s_ik_d, b, pos, row_scale,
                                       ROWS, B, BN, DI, DOT_DTYPE, DOT_PREC, NAN_IN_MAX, pos_min, MASK_ALL,
                                       is_ptr + page * s_is_p, s_is_b, s_is_d, INDEX_NVFP4, slot_blk, s_st_c,
                                       cols_left, num_pages, s_ik_p, s_is_p, SLOTS)
                if SORTED_MERGE:
                    chunk = tl.where(cols == j, sb[:, None], chunk)
                else:
                    sb = _forced(sb, b, nb_row, INIT, LOCAL)
                    key = _pack_keys(sb, tl.zeros([ROWS], tl.int32) + b, b < nb_row, 1 << 30)
                    chunk = tl.where(cols == j, key[:, None], chunk)
            if SORTED_MERGE:
                ids = c0 + cols
                sc = _forced(chunk, ids, nb_row[:, None], INIT, LOCAL)
                # a column past the split's range is another split's block (or none): unavailable
                top = tl.topk(_pack_keys(sc, ids, (ids < nb_row[:, None]) & (ids < hi), 1 << 30), K_PAD)
                best = tl.bitonic_merge(tl.maximum(best, top), descending=False)
            else:
                both = tl.reshape(tl.join(best, tl.topk(chunk, K_PAD)), [ROWS, 2 * K_PAD])
                best = tl.topk(both, K_PAD)
        if SORTED_MERGE:
            best = tl.flip(best, 1)  # best first: _ascending_ids takes the first K
        slots = tl.arange(0, K_PAD)[None, :]
        if SPLITS == 1:
            tl.store(out_ptr + hh[:, None] * s_out_h + tok[:, None] * s_out_t + slots * s_out_k,
                     _ascending_ids(best, K, K_PAD, 1 << 30), mask=row_in[:, None] & (slots < K))
        else:
            row = (tok - first_token) * H + hh
            tl.store(ws_ptr + tl.program_id(2) * s_ws_s + row[:, None] * s_ws_t + slots, best,
                     mask=row_in[:, None])


@step_kernel("s_ws_s", "num_rows", "first_token")
def _prefill_index_merge_kernel(ws_ptr, s_ws_s, s_ws_t, out_ptr, s_out_h, s_out_t, s_out_k, H, num_rows,
                                first_token, R: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                                SPLITS: tl.constexpr):
    """Top-``K`` of the splits' packed keys for ``R`` (token, index head) rows of the prefill tokens."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    ok = rows < num_rows
    cand = tl.arange(0, SPLITS * K_PAD)
    keys = tl.load(ws_ptr + (cand // K_PAD)[None, :] * s_ws_s + rows[:, None] * s_ws_t + (cand % K_PAD)[None, :],
                   mask=ok[:, None], other=-9223372036854775807 - 1)
    best = tl.topk(keys, K_PAD)
    slots = tl.arange(0, K_PAD)[None, :]
    tok = first_token + rows // H
    tl.store(out_ptr + (rows % H)[:, None] * s_out_h + tok[:, None] * s_out_t + slots * s_out_k,
             _ascending_ids(best, K, K_PAD, 1 << 30), mask=ok[:, None] & (slots < K))


def sort_width(k: int) -> int:
    """Lanes of a ``tl.topk`` that keeps ``k`` entries: a power of two, at least 16.

    Triton 3.6 fails to compile ``tl.topk`` of one lane (top-1: "'dtype' object has
    no attribute 'numel'", found by the GPU fuzz run); Triton 3.9 and the interpreter
    accept it. 16 lanes is the width proven at MiniMax-M3 shapes on the H200; the
    extra lanes hold the "unavailable" key and are never stored (stores are masked
    by ``slots < K``).
    """
    return max(16, next_pow2(k))


def index_topk(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
               params: SparseAttentionParams, out: TopkBuffer, cfg: LaunchConfig,
               page_faults: Optional[torch.Tensor] = None, judge: bool = False) -> None:
    """Run the indexer for the whole step; writes rows ``[0, batch.num_tokens)`` of ``out``.

    ``page_faults``: the word the kernels lower for a bad block-table entry
    (:func:`.tl_utils.load_reported_page`); ``None``: a scratch word nobody reads.
    ``judge`` (with ``page_faults``): lower it for the batch's contents too (:mod:`.contents`): in the
    score launch of a step of decodes (split 0 of each request), else in a launch of their own first.

    Inputs are assumed validated (see :mod:`.checks`). Decode launches depend
    on shapes only; the prefill launch uses ``batch.max_prefill_query_len``.
    """
    H, K, B = params.num_index_heads, params.topk, params.block_size
    Di = params.index_head_dim
    ik = caches.index
    bt = batch.block_table
    sh, st, sk = out.strides()
    faults = page_faults if page_faults is not None else scratch(ik.device, "page-faults", (1,), torch.int64)
    iscale, index_nvfp4 = index_block_scale_args(caches, ik)
    slots, on_slots = slot_args(batch, bt)

    nd, T, width = batch.num_decodes, batch.num_tokens, block_columns(batch)
    decodes = nd > 0 and batch.num_decode_tokens > 0
    # the score launch judges a batch of decodes alone: it has a program for each of its requests
    judge = judge and page_faults is not None
    judged = judge and decodes and nd == batch.block_table.shape[0]
    if judge and not judged:
        check_contents(batch, caches.num_pages, page_faults, cfg)
    if decodes:
        dev, td = ik.device, batch.num_decode_tokens
        counters = ready = None
        streamed = streamed_enabled(cfg, nd, batch.decode_query_len * H)
        if streamed:   # a capture short of counters or flags falls back to the plain launches
            counters, ready = arrival_counters(dev, nd, "topk"), arrival_counters(dev, nd, "ready")
            streamed = counters is not None and ready is not None
        plan = decode_index_plan(cfg, nd, batch.decode_query_len, H, params.num_kv_heads, td, width, K, B, Di,
                                 params.init_blocks, params.local_blocks, index_q.dtype, ik.dtype, sort_width,
                                 streamed, capture_matters(cfg.algorithms.topk_in_last_program, dev), on_slots)
        fast = cfg.algorithms.fast_launch
        ws = scratch(dev, "decode-scores", (nd, plan.rows, width))
        qsl, pos = batch.query_start_loc, batch.token_positions
        if not streamed and plan.topk_last:
            counters = arrival_counters(dev, nd, "topk")
        if judged:
            j = judge_args(batch, caches.num_pages, faults)
            judge_in, score_constexprs = j.args, plan.score_constexprs_judged[counters is not None, j.has_ctx]
        else:
            judge_in = unjudged_args(qsl, faults)
            score_constexprs = plan.score_constexprs if counters is not None else plan.score_constexprs_topk_launched
        launch(_decode_score_kernel, plan.score_grid,
               (index_q, *index_q.stride(), ik, *ik.stride(), bt, *bt.stride(), caches.num_pages, faults, qsl, pos, ws,
                ws.stride(0), ws.stride(1), H, td, width, out.storage, sh, st, sk, ws if counters is None else counters,
                ws if ready is None else ready, *iscale, *slots, *judge_in),
               score_constexprs, plan.score_options, fast)
        offer_ready_flags(dev, out.storage, nd, ready if streamed else None)
        if counters is None:   # no top-k in the score kernel: a launch of its own
            launch(_decode_topk_kernel, plan.topk_grid,
                   (ws, ws.stride(0), ws.stride(1), qsl, pos, out.storage, sh, st, sk, H, td, width),
                   plan.topk_constexprs, plan.topk_options, fast)

    npf = batch.num_prefills
    if npf > 0:
        dot_dtype, dot_prec, scale_q = dot_config(index_q.dtype, ik.dtype, cfg.numerics.fp8_as_f16)
        opts = launch_options(cfg)
        common = dict(B=B, DI=Di, DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec,
                      SCALE_Q=scale_q, NAN_IN_MAX=cfg.numerics.nan_in_max)
        pic = cfg.prefill_index
        rows = max(pic.rows, next_pow2(H), 16)
        m = rows // H
        k_pad = sort_width(K)
        tiles = triton.cdiv(batch.max_prefill_query_len, m)
        splits = cfg.prefill_index_splits(npf * tiles, width)
        t0, n_rows = batch.num_decode_tokens, batch.num_prefill_tokens * H
        ws = out.storage if splits == 1 else \
            torch.empty((splits, n_rows, k_pad), dtype=torch.int64, device=ik.device)
        fast = cfg.algorithms.fast_launch
        launch(_prefill_index_kernel, (npf, tiles, splits),
               (index_q, *index_q.stride(), ik, *ik.stride(), bt, *bt.stride(), caches.num_pages, faults,
                batch.query_start_loc, batch.token_positions, out.storage, sh, st, sk, H, nd, T, width,
                ws, ws.stride(0), ws.stride(1) if splits > 1 else 0, t0, *iscale, *slots),
               dict(ROWS=rows, M=m, K=K, K_PAD=k_pad, INIT=params.init_blocks, LOCAL=params.local_blocks,
                    BN=min(B, pic.block_n), **common, CH=max(pic.chunk, k_pad), SPLITS=splits,
                    MASK_ALL=not pic.unmasked_full, SORTED_MERGE=pic.sorted_merge,
                    KEY_ROW=ik.stride(1) if pic.static_key_stride else 0,
                    **({"INDEX_NVFP4": True} if index_nvfp4 else {}), **({"SLOTS": True} if on_slots else {})),
               dict(num_warps=pic.warps, num_stages=pic.num_stages, **opts), fast)
        if splits > 1:
            r_merge = 16
            launch(_prefill_index_merge_kernel, (triton.cdiv(n_rows, r_merge),),
                   (ws, ws.stride(0), ws.stride(1), out.storage, sh, st, sk, H, n_rows, t0),
                   dict(R=r_merge, K=K, K_PAD=k_pad, SPLITS=splits), dict(num_warps=4, **opts), fast)
