"""Block-grouped prefill attention (docs/spec.md §4): each selected block is read once for all tokens that chose it.

Attending token by token reads a 64 KB K/V block for every (token, KV head,
selected block) and serves only that token's ``G`` query heads with it:
about 16 FLOP per byte, bound by on-chip bandwidth far below the tensor
cores. Neighbouring tokens of a prefill share few blocks when their
selections are unrelated, but across a whole chunk every block is chosen by
hundreds of tokens. So the step's (token, block) pairs are regrouped by
block, and the work is done in three steps:

1. :func:`.prefill_plan.plan_pairs` (a fill and three small kernels, no host sync):
   clean each row of the selection (ids outside ``[0, nb)`` and repeats
   select nothing, as in docs/spec.md §4), group the remaining (KV head, token,
   slot) pairs by *segment* (KV head, request, block), number them segment
   after segment (each pair's *place*) and cut each segment into tiles of
   ``M`` pairs.
2. ``_block_run_kernel``, persistent programs walking *runs* (up to
   ``run_tiles`` tiles of one segment): per run the block's K/V are loaded
   once; per tile the ``M`` tokens' query rows (``M x G`` rows, a full
   tensor-core tile) against them; it stores each row's partial result
   (output normalized by its own softmax sum, and the base-2 log-sum-exp) in
   a workspace laid out in plan order, so a tile's partials are one
   contiguous block.
3. ``_merge_slots_kernel``, one program per (token, KV head): merges the
   token's ``K`` partials (found through the plan's place of each pair) by
   their log-sum-exp into the output.

Every pair is computed once, in tiles whose rows are all useful except a
segment's last tile. The price is the workspace round trip: ``K x G x D``
partial elements per (token, KV head), written once and read once.

A row's arithmetic does not depend on which other rows share its tile, so
the output does not depend on the order of pairs within a segment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm3.plugin import BatchMetadata
from mm3.plugin import PagedKVCache, TopkBuffer
from mm3.plugin import SparseAttentionParams

from .fast_launch import launch
from .launch import next_pow2
from .addressing import block_keys, key_offsets, slot_args, slot_block
from .nvfp4 import kv_block_scale_args, load_nvfp4_rows
from .prefill_config import PrefillAttentionConfig
from .prefill_plan import plan_pairs
from .tiles import load_rows, store_rows
from .tl_utils import kv_scale, kv_scale_args, slot_scales, step_kernel

__all__ = ["prefill_attention_forward"]


def _merge_sizes(G: int, D: int) -> dict:
    """The merge's row tile: the ``G`` query heads of a KV head, padded to a power of two (no dot
    there, so no 16-row minimum: at G = 8 it left half the lanes masked off)."""
    return dict(D=D, G_PAD=next_pow2(G))


@triton.jit
def _tile_rows(tok_ptr, pos_ptr, pairs, G, ROWS: tl.constexpr, M: tl.constexpr):
    """The rows of a tile of ``pairs`` pairs (tokens at ``tok_ptr``): ``(row_ok, tok, pos)``. Its rows
    ``pair * G + head`` are also its partials' rows in the workspace; the ones past ``pairs * G``
    (a segment's last tile, padding to ``ROWS``) hold no pair."""
    rows = tl.arange(0, ROWS)
    row_ok = rows < tl.minimum(pairs, M) * G
    tok = tl.load(tok_ptr + rows // G, mask=row_ok, other=0)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
    return row_ok, tok, pos


@triton.jit
def _store_partials(ws_o_ptr, ws_lse_ptr, place, G, o, lse, row_ok, D: tl.constexpr):
    """A tile's partials (``o`` in the workspace's dtype and ``lse``) into the contiguous rows from its
    first pair's place on: one base address plus constant offsets, no address per row."""
    rows = tl.arange(0, o.shape[0])
    offs_d = tl.arange(0, D)
    first = place.to(tl.int64) * G
    tl.store(ws_o_ptr + first * D + (rows[:, None] * D + offs_d[None, :]), o.to(ws_o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(ws_lse_ptr + first + rows, lse, mask=row_ok)


@triton.jit
def _run_keys(k_page, v_page, s_kb, s_kd, s_vb, s_vd, kb_page, vb_page, s_kbb, s_kbd, s_vbb, s_vbd,
              B: tl.constexpr, D: tl.constexpr, DOT_DTYPE: tl.constexpr, KV_NVFP4: tl.constexpr = False,
              at=None, s_kp=0, s_vp=0, s_kbp=0, s_vbp=0, SLOTS: tl.constexpr = False):
    """A block's K^T (the dot's B operand as loaded, so the compiler keeps it in shared memory
    across a run) and V (``KV_NVFP4``: unpacked with the block scales at ``kb_page``, ``vb_page``).
    ``at``: the block's keys (:func:`.addressing.block_keys`: its slots with ``SLOTS``, where the
    pointers are the caches' bases and ``s_kp`` .. ``s_vbp`` the one-token pages' strides)."""
    offs_d = tl.arange(0, D)
    if KV_NVFP4:
        keys_t = tl.trans(load_nvfp4_rows(k_page + key_offsets(at, s_kp, s_kb, SLOTS),
                                          kb_page + key_offsets(at, s_kbp, s_kbb, SLOTS), s_kd, s_kbd, D, DOT_DTYPE,
                                          SCALE_PER_ELEMENT=True))
        vals = load_nvfp4_rows(v_page + key_offsets(at, s_vp, s_vb, SLOTS),
                               vb_page + key_offsets(at, s_vbp, s_vbb, SLOTS), s_vd, s_vbd, D, DOT_DTYPE,
                               SCALE_PER_ELEMENT=True)
    else:
        keys_t = tl.load(k_page + offs_d[:, None] * s_kd + key_offsets(at, s_kp, s_kb, SLOTS)[None, :]).to(DOT_DTYPE)
        vals = tl.load(v_page + key_offsets(at, s_vp, s_vb, SLOTS)[:, None] + offs_d[None, :] * s_vd).to(DOT_DTYPE)
    return keys_t, vals


@triton.jit
def _run_step(q, keys_t, vals, visible, qk_scale, k_f, v_f, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
              SLOT_SCALED: tl.constexpr):
    """The softmax (base 2, scale folded in) of a row's only key tile, given as K^T: ``(m, l, acc)``
    (``k_f``, ``v_f``: the keys' per-slot scale factors with ``SLOT_SCALED``: the K ones on the
    logits, the V ones on the weights of the second dot, not on their sum). An online-softmax step
    from the empty state (:func:`.tiles.softmax_weights`), the same numbers without its rescaling
    of a zero accumulator (a ``ROWS x D`` multiply whose operand stayed live in registers).
    """
    s = tl.dot(q, keys_t, input_precision=DOT_PREC) * qk_scale
    if SLOT_SCALED:
        s = s * k_f[None, :]
    s = tl.where(visible, s, float("-inf"))
    m = tl.max(s, axis=1)
    # rows with no visible key keep m = -inf; shift by 0 there to avoid inf - inf
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    if SLOT_SCALED:
        pv = p * v_f[None, :]
    else:
        pv = p
    return m, tl.sum(p, axis=1), tl.dot(pv.to(DOT_DTYPE), vals, input_precision=DOT_PREC)


@step_kernel("nb_max", "num_req")
def _block_run_kernel(
    q_ptr, s_qt, s_qh, s_qd, k_ptr, s_kp, s_kb: tl.constexpr, s_kh, s_kd: tl.constexpr,
    v_ptr, s_vp, s_vb: tl.constexpr, s_vh, s_vd: tl.constexpr,
    pos_ptr, run_seg_ptr, run_page_ptr, run_tok_ptr, run_pairs_ptr, run_place_ptr, num_runs_ptr, ws_o_ptr,
    ws_lse_ptr, nb_max, num_req, G, qk_scale, ks_ptr, s_ks, vs_ptr, s_vs,
    kb_ptr, s_kbp, s_kbb: tl.constexpr, s_kbh, s_kbd: tl.constexpr,
    vb_ptr, s_vbp, s_vbb: tl.constexpr, s_vbh, s_vbd: tl.constexpr,
    st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr, num_pages,
    B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr, RUN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr = 4, KV_SCALED: tl.constexpr = False,
    SLOT_SCALED: tl.constexpr = False, KV_NVFP4: tl.constexpr = False, SLOTS: tl.constexpr = False,
):
    """Runs ``program_id, program_id + programs, ...``; a run is up to ``RUN`` tiles of one segment.

    The run's block K/V are loaded once and stay on chip as one ``B``-key tile (one block per row:
    a single softmax step); its tiles (``M`` pairs, ``ROWS`` query rows each) are one
    software-pipelined loop of ``STAGES`` stages: later tiles' pairs and query rows load while this
    one's math runs. (Two 64-key halves at 128-key blocks spilled and measured 0.90-0.93x.)

    The strides inside a page are compile-time constants (one layout per cache): the K/V tiles'
    addresses are then a base plus immediates, where runtime strides kept ~45 per-thread offsets
    live across the run loop, which Triton 3.6 spilled (sm_90).

    ``SLOTS``: token slots: a run's plan entry is its request, not a page, and the block's keys are
    gathered through the slot table (:mod:`.addressing`; ``st_ptr`` .. ``sr_ptr`` its arguments,
    ``num_pages`` the cache's one-token pages).
    """
    gi = tl.arange(0, ROWS) % G
    for i in tl.range(tl.program_id(0), tl.load(num_runs_ptr), tl.num_programs(0), num_stages=1):
        seg = tl.load(run_seg_ptr + i)
        n = tl.load(run_pairs_ptr + i)
        place = tl.load(run_place_ptr + i)
        b = seg % nb_max
        h = seg // nb_max // num_req
        if SLOTS:
            slot_blk, cols_left = slot_block(st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
                                             tl.load(run_page_ptr + i), b, B)
            at = block_keys(tl.arange(0, B), slot_blk, s_st_c, cols_left, num_pages, SLOTS)
            page = 0
        else:
            page = tl.load(run_page_ptr + i).to(tl.int64)
            at = tl.arange(0, B)
        k_page = k_ptr + page * s_kp + h * s_kh
        v_page = v_ptr + page * s_vp + h * s_vh
        keys_t, vals = _run_keys(k_page, v_page, s_kb, s_kd, s_vb, s_vd, kb_ptr + page * s_kbp + h * s_kbh,
                                 vb_ptr + page * s_vbp + h * s_vbh, s_kbb, s_kbd, s_vbb, s_vbd, B, D, DOT_DTYPE,
                                 KV_NVFP4, at, s_kp, s_vp, s_kbp, s_vbp, SLOTS)
        # fp8 K/V: the K scale joins the logits' factor, the V scale multiplies the result once
        run_qk_scale = qk_scale * kv_scale(ks_ptr, h, s_ks, KV_SCALED)
        v_scale = kv_scale(vs_ptr, h, s_vs, KV_SCALED)
        key_pos = b * B + tl.arange(0, B)
        k_f = slot_scales(ks_ptr + h * s_ks + page * B, at, SLOT_SCALED)
        v_f = slot_scales(vs_ptr + h * s_vs + page * B, at, SLOT_SCALED)
        for r in tl.range(0, tl.cdiv(n, M), num_stages=STAGES):
            row_ok, tok, pos = _tile_rows(run_tok_ptr + i * (M * RUN) + r * M, pos_ptr, n - r * M, G, ROWS, M)
            q = load_rows(q_ptr, tok, h * G + gi, s_qt, s_qh, s_qd, row_ok, D, DOT_DTYPE)
            # (pos = -1 in rows without a pair: nothing visible)
            m_i, l_i, acc = _run_step(q, keys_t, vals, key_pos[None, :] <= pos[:, None], run_qk_scale, k_f, v_f,
                                      DOT_DTYPE, DOT_PREC, SLOT_SCALED)
            # a valid pair's block holds key b * B <= pos, so l > 0 in every stored row
            l_safe = tl.where(l_i > 0, l_i, 1.0)
            _store_partials(ws_o_ptr, ws_lse_ptr, place + r * M, G, acc * (v_scale / l_safe)[:, None],
                            m_i + tl.log2(l_safe), row_ok, D)


@step_kernel("tok0", "Tc")
def _merge_slots_kernel(
    out_ptr, s_ot, s_oh, s_od, place_ptr, ws_o_ptr, ws_lse_ptr, tok0, Tc, G,
    D: tl.constexpr, K: tl.constexpr, G_PAD: tl.constexpr,
):
    """Token ``tok0 + tc``, KV head ``h``: its valid pairs' partials (at their places) merged by
    log-sum-exp (zeros if none)."""
    tc = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, G_PAD)
    row_ok = rows < G
    offs_d = tl.arange(0, D)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    zero_rows = tl.full([G_PAD], 0, tl.int32)
    for k in tl.static_range(K):
        place = tl.load(place_ptr + (h * Tc + tc) * K + k)
        use = row_ok & (zero_rows + place >= 0)
        part = place.to(tl.int64) * G + rows
        lse = tl.load(ws_lse_ptr + part, mask=use, other=float("-inf"))
        o = tl.load(ws_o_ptr + part[:, None] * D + offs_d[None, :], mask=use[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o.to(tl.float32)
        m_i = m_new
    store_rows(out_ptr, zero_rows + tok0 + tc, h * G + rows, s_ot, s_oh, s_od, acc, l_i, row_ok, D)


def _blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def prefill_attention_forward(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                              params: SparseAttentionParams, out: torch.Tensor, cfg: PrefillAttentionConfig,
                              *, qk_scale: float, dot_dtype: object, dot_prec: str, platform_options: dict,
                              target_programs: int, fast: bool = False) -> None:
    """Attention of every prefill token of the step (rows after the decode tokens) into ``out``.

    ``dot_dtype``, ``dot_prec``: :func:`.tl_utils.dot_config`'s choice for the step's queries and
    K/V; ``target_programs``: two per multiprocessor (sizes the persistent grid); ``fast``: launch
    through :mod:`.fast_launch` (``Algorithms.fast_launch``).
    """
    Hkv, G, K, B, D = params.num_kv_heads, params.gqa_group, params.topk, params.block_size, params.head_dim
    td, T = batch.num_decode_tokens, batch.num_tokens
    rows = max(cfg.rows, next_pow2(G))
    m = rows // G
    # from host ints only (a captured step reads no lengths): more than any block id a prefill token
    # sees, and at least the blocks of all prefills together
    nb_max = max(1, _blocks(batch.prefill_seq_len_bound(), B))
    nb_sum = batch.num_prefills * nb_max
    if Hkv * batch.num_prefills * nb_max >= 2**31 - 1:
        raise ValueError(f"prefill attention: {Hkv} KV heads x {batch.num_prefills} requests x {nb_max} blocks "
                         f"overflow the int32 segment ids; split the step into fewer prefill requests")
    k, v = caches.k, caches.v
    scales, kv_scaled, slot_scaled = kv_scale_args(caches, q)
    blocks, kv_nvfp4 = kv_block_scale_args(caches, q)
    slots, on_slots = slot_args(batch, k)
    sel = topk.head_major()
    run_options = dict(num_warps=cfg.warps, **platform_options)
    merge_options = dict(num_warps=cfg.merge_warps, **platform_options)
    for a in range(td, T, cfg.max_tokens_per_pass):
        c = min(cfg.max_tokens_per_pass, T - a)
        pairs = Hkv * c * K
        per = m * cfg.run_tiles
        max_tiles = min(pairs, pairs // per + Hkv * nb_sum)
        plan = plan_pairs(sel, batch, a, c, nb_max=nb_max, tokens_per_tile=per, max_tiles=max_tiles,
                          num_pages=caches.num_pages, fast=fast)
        # partial outputs in out's dtype (q's in production): fp32 ones doubled the attention time
        ws_o = torch.empty((pairs, G, D), dtype=out.dtype, device=q.device)
        ws_lse = torch.empty((pairs, G), dtype=torch.float32, device=q.device)
        programs = max(1, min(max_tiles, target_programs // 2 * cfg.programs_per_sm))
        launch(_block_run_kernel, (programs,),
               (q, *q.stride(), k, *k.stride(), v, *v.stride(), batch.token_positions,
                plan.tile_seg, plan.tile_page, plan.tile_tok, plan.tile_pairs, plan.tile_place, plan.num_tiles,
                ws_o, ws_lse, nb_max, batch.num_prefills, G, qk_scale, *scales, *blocks, *slots, caches.num_pages),
               dict(ROWS=rows, M=m, RUN=cfg.run_tiles, STAGES=cfg.stages, KV_SCALED=kv_scaled, B=B, D=D,
                    DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, **({"SLOT_SCALED": True} if slot_scaled else {}),
                    **({"KV_NVFP4": True} if kv_nvfp4 else {}), **({"SLOTS": True} if on_slots else {})),
               run_options, fast)
        launch(_merge_slots_kernel, (c, Hkv), (out, *out.stride(), plan.place, ws_o, ws_lse, a, c, G),
               dict(K=K, **_merge_sizes(G, D)), merge_options, fast)
