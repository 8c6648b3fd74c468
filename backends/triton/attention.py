"""Triton block-sparse attention kernels (docs/spec.md §4).

All kernels address ``q``, ``out``, the paged K/V caches (NHD or HND, any
strides), the block table and the top-k buffer (head- or token-major, through
its ``(h, t, k)`` strides) without copies. Softmax is base-2 with the scale
folded in; accumulation is fp32; ``P`` is rounded to the dot dtype for the
second ``tl.dot`` as in flash attention.

``_decode_attention_kernel`` grid ``(decode tokens, KV heads, splits)``
    Flash-decoding: one program takes one token, one KV head with *all* ``G``
    query heads of its group as the rows of one tile, and a contiguous range of
    that token's top-k slots. It runs an online softmax over those blocks (the
    causal mask only bites in the token's own, partially filled block) and
    either writes the output (one split) or its partial ``(max, sum, acc)``.
    The rocm plugin's decode kernel (``Algorithms.decode_attention_flat=False``).

``_decode_attention_flat_kernel`` grid ``(programs,)``
    The same work items, persistent: each program walks a run of (token, KV
    head, split) items as one software-pipelined loop (the cuda plugin's).

``_merge_kernel`` grid ``(decode tokens, KV heads)``, ``_merge_row_kernel`` ``(..., query heads)``
    Exact log-sum-exp merge of the splits' partials (per row on small grids), in :mod:`.merge`.

``_prefill_attention_kernel`` grid ``(prefill requests, token tiles, KV heads)``
    One program takes ``M`` consecutive tokens of one prefill request times the
    ``G`` query heads of a KV head (``M * G`` rows) and walks the request's
    visible blocks once; a block is loaded only if at least one row selected it,
    and then serves every row that did (rows that did not are masked), so
    neighbouring tokens that share blocks share the loads and the tensor-core
    tiles. With ``LaunchConfig.prefill_attention`` set (the cuda plugin's config) the
    prefill tokens go to :mod:`.prefill_attention` instead, which groups the
    step's (token, block) pairs by block.

Scaled fp8 K/V caches (docs/spec.md §1) are loaded as fp8 (half the bytes) and
widened to the dot dtype; the K scale of the program's KV head is folded into
``qk_scale`` and the V scale multiplies the accumulator once before it is
stored (:func:`.tl_utils.kv_scale`). With bf16 queries and
``numerics.kv_fp8_as_f16`` the decode kernels' dot dtype is fp16 (``SCALE_Q``:
e4m3 -> fp16 is one native conversion; each query row is scaled by a power of
two into fp16's range and the inverse joins its score scale,
:func:`.tiles.score_scale`); the prefill kernels widen fp8 K/V to the queries'
dtype. NVFP4 K/V (``KV_NVFP4``) are unpacked tile by tile as they are loaded,
with their block scales, exactly into the dot dtype (:mod:`.nvfp4`).

Rows and slots that hold no valid block (``-1``, ids ``>= nb``, repeated ids)
contribute nothing; a token with no visible key (padding) outputs zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm3.plugin import BatchMetadata
from mm3.plugin import PagedKVCache, TopkBuffer
from mm3.plugin import SparseAttentionParams

from .arrivals import arrival_counters, claim_ready_flags
from .fast_launch import launch
from .launch import LaunchConfig, next_pow2
from .merge import _merge_kernel, _merge_row_kernel, merge_splits
from .addressing import block_at, block_columns, slot_args
from .block_attend import _attend_block, _attend_block_masked
from .nvfp4 import kv_block_scale_args
from .plans import decode_attention_plan
from .prefill_attention import prefill_attention_forward
from .scratch import scratch_parts
from .tiles import (load_query_rows, load_rows, request_of, score_scale, store_item, store_rows, token_rows,
                    visible_blocks)
from .tl_utils import (arrive_last, dot_config, grid_wait, kv_scale, kv_scale_args, launch_options,
                       pdl_prologue, step_kernel)

__all__ = ["attention_forward"]

LOG2E = 1.4426950408889634


@step_kernel("W", "num_decodes")
def _decode_attention_kernel(
    q_ptr, s_qt, s_qh, s_qd, k_ptr, s_kp, s_kb, s_kh, s_kd, v_ptr, s_vp, s_vb, s_vh, s_vd,
    bt_ptr, s_bt_r, s_bt_b, num_pages, tok_req_ptr, pos_ptr, sel_ptr, s_sel_h, s_sel_t, s_sel_k,
    out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G, W, qk_scale, ks_ptr, s_ks, vs_ptr, s_vs, num_decodes,
    kb_ptr, s_kbp, s_kbb, s_kbh, s_kbd, vb_ptr, s_vbp, s_vbb, s_vbh, s_vbd,
    st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
    B: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, SPLITS: tl.constexpr, KPS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr = 2, PDL: tl.constexpr = False,
    KV_SCALED: tl.constexpr = False, SCALE_Q: tl.constexpr = False, SLOT_SCALED: tl.constexpr = False,
    KV_NVFP4: tl.constexpr = False, SLOTS: tl.constexpr = False,
):
    """``SLOTS``: token slots (:mod:`.addressing`; ``st_ptr`` .. ``sr_ptr``: the slot table, its strides,
    rows and columns, each request's row of it), else dummies never read.

    The contents are judged on the device while this runs, so whatever they hold stays inside the
    tensors: a token's request is clamped to a decode of the step (``[0, num_decodes)``) and it sees at
    most ``W`` blocks (the block table's columns, :func:`.tiles.visible_blocks`)."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    num_h = tl.num_programs(1)
    qk_scale = qk_scale * kv_scale(ks_ptr, h, s_ks, KV_SCALED)
    r = request_of(tok_req_ptr + t, None, 0, num_decodes)
    pos = tl.load(pos_ptr + t)
    rows = tl.arange(0, G_PAD)
    row_ok = rows < G
    offs_d = tl.arange(0, D)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    toks = tl.full([G_PAD], 0, tl.int32) + t
    if pos >= 0:
        nb = visible_blocks(pos, True, W, B)
        q, undo = load_query_rows(q_ptr, toks, h * G + rows, s_qt, s_qh, s_qd, row_ok, D, DOT_DTYPE, SCALE_Q)
        qk = score_scale(qk_scale, undo, SCALE_Q)
        pos_rows = tl.full([G_PAD], 0, tl.int32) + pos
        slots = tl.arange(0, K_PAD)
        sel_row = sel_ptr + h * s_sel_h + t * s_sel_t
        sel = tl.load(sel_row + slots * s_sel_k, mask=slots < K, other=-1)
        # No data-dependent branch: an unusable slot (-1, id >= nb, a repeat) is a row mask
        # of all False, its page lookup is clamped to block 0 and its K/V loads are masked
        # off (no memory traffic), so the loop body is the same every iteration and the
        # next slot's page, K and V loads can be issued before this one's math.
        for i in tl.range(sp * KPS, sp * KPS + KPS, num_stages=STAGES):
            blk = tl.load(sel_row + i * s_sel_k, mask=i < K, other=-1)
            repeated = tl.max(((sel == blk) & (slots < i)).to(tl.int32), axis=0)
            use = (blk >= 0) & (blk < nb) & (repeated == 0)
            # the block is clamped above and the request at the top; mask=use only spares an unused slot's load
            page, slot_blk, cols_left = block_at(bt_ptr, s_bt_r, s_bt_b, num_pages, r, tl.where(use, blk, 0), st_ptr,
                                                 s_st_r, s_st_c, st_rows, st_width, sr_ptr, B, SLOTS, mask=use)
            m_i, l_i, acc = _attend_block_masked(
                q, m_i, l_i, acc, k_ptr + page * s_kp + h * s_kh, v_ptr + page * s_vp + h * s_vh,
                s_kb, s_kd, s_vb, s_vd, row_ok & use, pos_rows, blk, use, qk, ks_ptr + h * s_ks + page * B,
                vs_ptr + h * s_vs + page * B, kb_ptr + page * s_kbp + h * s_kbh, vb_ptr + page * s_vbp + h * s_vbh,
                s_kbb, s_kbd, s_vbb, s_vbd, B, BN, D, DOT_DTYPE, DOT_PREC, SLOT_SCALED, KV_NVFP4, slot_blk, s_st_c,
                cols_left, num_pages, s_kp, s_vp, s_kbp, s_vbp, SLOTS)
    acc = acc * kv_scale(vs_ptr, h, s_vs, KV_SCALED)
    if SPLITS == 1:
        store_rows(out_ptr, toks, h * G + rows, s_ot, s_oh, s_od, acc, l_i, row_ok, D)
    else:
        base = (t * num_h + h) * SPLITS + sp
        tl.store(ws_m_ptr + base * G_PAD + rows, m_i)
        tl.store(ws_l_ptr + base * G_PAD + rows, l_i)
        tl.store(ws_acc_ptr + (base * G_PAD + rows)[:, None] * D + offs_d[None, :], acc)


@step_kernel("W", "num_decodes")
def _decode_attention_flat_kernel(
    q_ptr, s_qt, s_qh, s_qd, k_ptr, s_kp, s_kb, s_kh, s_kd, v_ptr, s_vp, s_vb, s_vh, s_vd,
    bt_ptr, s_bt_r, s_bt_b, num_pages, tok_req_ptr, pos_ptr, sel_ptr, s_sel_h, s_sel_t, s_sel_k,
    out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G, W, num_h, num_items, IPP, qk_scale,
    ks_ptr, s_ks, vs_ptr, s_vs, cnt_ptr, ready_ptr, num_decodes,
    kb_ptr, s_kbp, s_kbb, s_kbh, s_kbd, vb_ptr, s_vbp, s_vbb, s_vbh, s_vbd,
    st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
    B: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, SPLITS: tl.constexpr, KPS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr = 3, PDL: tl.constexpr = False,
    KV_SCALED: tl.constexpr = False, SCALE_Q: tl.constexpr = False, MERGE_LAST: tl.constexpr = False,
    S_PAD: tl.constexpr = 1, SLOT_SCALED: tl.constexpr = False, STREAM: tl.constexpr = False,
    TRIGGER: tl.constexpr = False, KV_NVFP4: tl.constexpr = False, SLOTS: tl.constexpr = False,
):
    """:func:`_decode_attention_kernel`'s work, persistent: grid ``(programs,)``.

    A work item is one (token, KV head, split); program ``p`` takes items
    ``[p * IPP, (p + 1) * IPP)`` and walks their ``IPP * KPS`` block visits as
    *one* software-pipelined loop. The dependent loads of a visit (top-k slot ->
    page id -> K and V) are then issued stages ahead, across item boundaries,
    instead of each short program paying that latency chain cold. The online
    softmax state is reset at an item's first visit and stored (masked stores)
    at its last.

    With ``MERGE_LAST`` (several splits) the merge is no launch of its own: after
    its loop a program counts each of its items into the item's (token, KV head)
    counter at ``cnt_ptr`` (:mod:`.arrivals`), and the program that brings a
    pair's count to ``SPLITS`` merges that pair's partials into ``out``.

    ``STREAM``: launched while the score kernel still runs (``Algorithms.streamed_decode``). A
    program first waits until the ready flag ``ready_ptr[r]`` of each of its items' requests is
    up (the request's top-k is stored), then reads the top-k past L1 (an earlier program on this
    multiprocessor may have cached a line of it before it was written). With ``TRIGGER`` it ends
    by waiting for the score kernel to finish, so the stream's next kernel follows both.

    ``SLOTS``, ``W``, ``num_decodes``: as :func:`_decode_attention_kernel`'s.
    """
    p = tl.program_id(0)
    if STREAM:
        for item in tl.range(p * IPP, tl.minimum(p * IPP + IPP, num_items)):
            # a token's request, clamped to a request of this step: every flag waited on is raised
            r = request_of(tok_req_ptr + item // SPLITS // num_h, None, 0, num_decodes)
            up = tl.atomic_add(ready_ptr + r, 0, sem="acquire", scope="gpu")
            while up == 0:
                up = tl.atomic_add(ready_ptr + r, 0, sem="acquire", scope="gpu")
    else:
        pdl_prologue(PDL)
    rows = tl.arange(0, G_PAD)
    row_ok = rows < G
    slots = tl.arange(0, K_PAD)
    zero_rows = tl.full([G_PAD], 0, tl.int32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    it0 = p * (IPP * KPS)
    for it in tl.range(it0, tl.minimum(it0 + IPP * KPS, num_items * KPS), num_stages=STAGES):
        item = it // KPS
        j = it % KPS
        sp = item % SPLITS
        t = item // SPLITS // num_h
        h = item // SPLITS % num_h
        first = (zero_rows + j) == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first[:, None], 0.0, acc)
        r = request_of(tok_req_ptr + t, None, 0, num_decodes)
        pos = tl.load(pos_ptr + t)
        toks = zero_rows + t
        sel_row = sel_ptr + h * s_sel_h + t * s_sel_t
        sel = tl.load(sel_row + slots * s_sel_k, mask=slots < K, other=-1, cache_modifier=".cg" if STREAM else "")
        i = sp * KPS + j
        blk = tl.max(tl.where(slots == i, sel, -1), axis=0)
        repeated = tl.max(((sel == blk) & (slots < i)).to(tl.int32), axis=0)
        # pos < 0 is a padding token: it sees no block, so nothing is attended
        use = (blk >= 0) & (blk < visible_blocks(pos, pos >= 0, W, B)) & (repeated == 0)
        page, slot_blk, cols_left = block_at(bt_ptr, s_bt_r, s_bt_b, num_pages, r, tl.where(use, blk, 0), st_ptr,
                                             s_st_r, s_st_c, st_rows, st_width, sr_ptr, B, SLOTS, mask=use)
        q, undo = load_query_rows(q_ptr, toks, h * G + rows, s_qt, s_qh, s_qd, row_ok, D, DOT_DTYPE, SCALE_Q)
        # an unusable slot's K/V loads are masked off: zeros, never a stale page's NaNs (0 * NaN
        # would poison the accumulator even though its rows are masked out of the softmax)
        m_i, l_i, acc = _attend_block_masked(
            q, m_i, l_i, acc, k_ptr + page * s_kp + h * s_kh, v_ptr + page * s_vp + h * s_vh,
            s_kb, s_kd, s_vb, s_vd, row_ok & use, zero_rows + pos, blk, use,
            score_scale(qk_scale * kv_scale(ks_ptr, h, s_ks, KV_SCALED), undo, SCALE_Q),
            ks_ptr + h * s_ks + page * B, vs_ptr + h * s_vs + page * B, kb_ptr + page * s_kbp + h * s_kbh,
            vb_ptr + page * s_vbp + h * s_vbh, s_kbb, s_kbd, s_vbb, s_vbd, B, BN, D, DOT_DTYPE, DOT_PREC, SLOT_SCALED,
            KV_NVFP4, slot_blk, s_st_c, cols_left, num_pages, s_kp, s_vp, s_kbp, s_vbp, SLOTS)
        last = row_ok & ((zero_rows + j) == KPS - 1)
        store_item(out_ptr, toks, h * G + rows, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
                   (t * num_h + h) * SPLITS + sp, acc * kv_scale(vs_ptr, h, s_vs, KV_SCALED), m_i, l_i, last,
                   D, G_PAD, SPLITS)
    if MERGE_LAST:
        for item in tl.range(p * IPP, tl.minimum(p * IPP + IPP, num_items)):
            pair = item // SPLITS
            if arrive_last(cnt_ptr, pair, SPLITS):
                merge_splits(out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G, pair // num_h,
                             pair % num_h, num_h, D, G_PAD, SPLITS, S_PAD, ".cg")
    if STREAM:
        grid_wait(TRIGGER)


@step_kernel("first_request", "tok_lo", "tok_hi", "W")
def _prefill_attention_kernel(
    q_ptr, s_qt, s_qh, s_qd, k_ptr, s_kp, s_kb, s_kh, s_kd, v_ptr, s_vp, s_vb, s_vh, s_vd,
    bt_ptr, s_bt_r, s_bt_b, num_pages, qsl_ptr, pos_ptr, sel_ptr, s_sel_h, s_sel_t, s_sel_k,
    out_ptr, s_ot, s_oh, s_od, G, first_request, tok_lo, tok_hi, W, qk_scale, ks_ptr, s_ks, vs_ptr, s_vs,
    kb_ptr, s_kbp, s_kbb, s_kbh, s_kbd, vb_ptr, s_vbp, s_vbb, s_vbh, s_vbd,
    st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
    B: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_SCALED: tl.constexpr = False, SLOT_SCALED: tl.constexpr = False, KV_NVFP4: tl.constexpr = False,
    SLOTS: tl.constexpr = False,
):
    """``SLOTS``: as :func:`_decode_attention_kernel`'s. ``tok_lo``, ``tok_hi``, ``W``: the step's prefill
    tokens and the block table's columns (:func:`.tiles.token_rows`)."""
    r = first_request + tl.program_id(0)
    h = tl.program_id(2)
    qk_scale = qk_scale * kv_scale(ks_ptr, h, s_ks, KV_SCALED)
    tok, gi, row_in, pos, row_ok, nb_row = token_rows(qsl_ptr, pos_ptr, r, tl.program_id(1) * M, G, tok_lo, tok_hi,
                                                      W, ROWS, M, B)
    if tl.max(row_in.to(tl.int32), axis=0) > 0:
        nb_max = tl.max(nb_row, axis=0)
        qh = h * G + gi
        q = load_rows(q_ptr, tok, qh, s_qt, s_qh, s_qd, row_ok, D, DOT_DTYPE)
        slots = tl.arange(0, K_PAD)
        sel = tl.load(sel_ptr + h * s_sel_h + tok[:, None] * s_sel_t + slots[None, :] * s_sel_k,
                      mask=row_ok[:, None] & (slots < K)[None, :], other=-1)
        # ids outside [0, nb) select nothing (docs/spec.md §4: only j <= p is attended)
        sel = tl.where(sel < nb_row[:, None], sel, -1)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for b in tl.range(0, nb_max):
            member = tl.max((sel == b).to(tl.int32), axis=1) > 0
            if tl.max(member.to(tl.int32), axis=0) > 0:
                page, slot_blk, cols_left = block_at(bt_ptr, s_bt_r, s_bt_b, num_pages, r, b, st_ptr, s_st_r, s_st_c,
                                                     st_rows, st_width, sr_ptr, B, SLOTS)
                m_i, l_i, acc = _attend_block(
                    q, m_i, l_i, acc, k_ptr + page * s_kp + h * s_kh, v_ptr + page * s_vp + h * s_vh,
                    s_kb, s_kd, s_vb, s_vd, member, pos, b, qk_scale, ks_ptr + h * s_ks + page * B,
                    vs_ptr + h * s_vs + page * B, kb_ptr + page * s_kbp + h * s_kbh, vb_ptr + page * s_vbp + h * s_vbh,
                    s_kbb, s_kbd, s_vbb, s_vbd, B, BN, D, DOT_DTYPE, DOT_PREC, SLOT_SCALED, KV_NVFP4, slot_blk, s_st_c,
                    cols_left, num_pages, s_kp, s_vp, s_kbp, s_vbp, SLOTS)
        acc = acc * kv_scale(vs_ptr, h, s_vs, KV_SCALED)
        store_rows(out_ptr, tok, qh, s_ot, s_oh, s_od, acc, l_i, row_in, D)


def attention_forward(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                      params: SparseAttentionParams, out: torch.Tensor, cfg: LaunchConfig) -> None:
    """Block-sparse attention for the whole step; writes ``out[:batch.num_tokens]``.

    Inputs are assumed validated (see :mod:`.checks`). The decode launch
    depends on shapes only (CUDA-graph capturable).
    """
    Hkv, G, K, B, D = params.num_kv_heads, params.gqa_group, params.topk, params.block_size, params.head_dim
    k, v, bt = caches.k, caches.v, batch.block_table
    qk_scale = params.softmax_scale * LOG2E
    scales, kv_scaled, slot_scaled = kv_scale_args(caches, q)
    blocks, kv_nvfp4 = kv_block_scale_args(caches, q)
    slots, on_slots = slot_args(batch, bt)
    blocks = (*blocks, *slots)    # the kernels take the slot arguments right after the block scales
    sh, st, sk = topk.strides()
    # the page count bounds every page id the kernels read (tl_utils.load_page)
    tensors = (*(q, *q.stride()), *(k, *k.stride()), *(v, *v.stride()), *(bt, *bt.stride()), caches.num_pages)

    npf = batch.num_prefills
    td = batch.num_decode_tokens
    if td > 0:
        plan = decode_attention_plan(cfg, td, Hkv, G, K, B, D, q.dtype, k.dtype, kv_scaled, slot_scaled, on_slots)
        fast = cfg.algorithms.fast_launch
        splits, g_pad = plan.splits, plan.g_pad
        if splits > 1:   # [td, Hkv, splits, g_pad] maxima and sums, [..., D] accumulators: one buffer
            n = td * Hkv * splits * g_pad
            ws_m, ws_l, ws_acc = scratch_parts(q.device, "decode-partials", (n, n, n * D))
        else:  # never touched: the single-split kernel writes the output directly
            ws_m = ws_l = ws_acc = out
        so = out.stride()
        head = (*tensors, batch.token_to_request, batch.token_positions, topk.storage, sh, st, sk, out, *so,
                ws_m, ws_l, ws_acc, G, block_columns(batch))
        constexprs, merge = plan.constexprs, plan.merge
        if plan.flat:
            counters = arrival_counters(q.device, td * Hkv, "merge") if plan.merge_last else None
            if counters is None:   # no merge in the kernel: the merge launch below does it
                constexprs = plan.constexprs_merge_launched
            else:
                merge = False
            options = plan.options
            # the indexer launched just before raises ready flags: start now, wait per request
            ready = claim_ready_flags(q.device, topk.storage, batch.num_decodes)
            if ready is not None:
                constexprs = plan.stream_constexprs if counters is not None else plan.stream_constexprs_merge_launched
                options = plan.stream_options
            launch(_decode_attention_flat_kernel, plan.grid,
                   (*head, Hkv, *plan.flat_ints, qk_scale, *scales, ws_m if counters is None else counters,
                    ws_m if ready is None else ready, batch.num_decodes, *blocks),
                   constexprs, options, fast)
        else:
            launch(_decode_attention_kernel, plan.grid, (*head, qk_scale, *scales, batch.num_decodes, *blocks),
                   constexprs, plan.options, fast)
        if merge and plan.merge_per_row:
            launch(_merge_row_kernel, plan.merge_grid, (out, *so, ws_m, ws_l, ws_acc, G, Hkv),
                   plan.merge_constexprs, plan.merge_options, fast)
        elif merge:
            launch(_merge_kernel, plan.merge_grid, (out, *so, ws_m, ws_l, ws_acc, G),
                   plan.merge_constexprs, plan.merge_options, fast)

    if npf == 0:
        return
    # prefill: launch parameters from host lengths, derived per step (a step's prefills vary); the
    # prefill kernels widen fp8 K/V to the queries' dtype
    dot_dtype, dot_prec, _ = dot_config(q.dtype, k.dtype)
    opts = launch_options(cfg)
    if cfg.prefill_attention is not None:
        prefill_attention_forward(q, caches, topk, batch, params, out, cfg.prefill_attention, qk_scale=qk_scale,
                                  dot_dtype=dot_dtype, dot_prec=dot_prec, platform_options=opts,
                                  target_programs=cfg.target_programs, fast=cfg.algorithms.fast_launch)
    else:
        tiles = cfg.prefill_tiles
        rows = max(tiles.rows, next_pow2(G), 16)
        m = rows // G
        launch(_prefill_attention_kernel, (npf, triton.cdiv(batch.max_prefill_query_len, m), Hkv),
               (*tensors, batch.query_start_loc, batch.token_positions,
                topk.storage, sh, st, sk, out, *out.stride(), G, batch.num_decodes, td, batch.num_tokens,
                block_columns(batch), qk_scale, *scales, *blocks),
               dict(ROWS=rows, M=m, B=B, BN=min(B, tiles.block_n), D=D, K=K, K_PAD=next_pow2(K), DOT_DTYPE=dot_dtype,
                    DOT_PREC=dot_prec, KV_SCALED=kv_scaled, **({"SLOT_SCALED": True} if slot_scaled else {}),
                    **({"KV_NVFP4": True} if kv_nvfp4 else {}), **({"SLOTS": True} if on_slots else {})),
               dict(num_warps=tiles.warps, num_stages=tiles.num_stages, **opts), cfg.algorithms.fast_launch)
