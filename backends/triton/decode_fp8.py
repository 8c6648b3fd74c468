"""Decode attention on an fp8 K/V cache: one program walks whole (token, KV head, split) items.

Chosen by ``DecodeAttentionConfig.kv8_dots`` (of ``LaunchConfig.decode_attention_fp8``);
the work, the grid and the partials are those of the persistent kernel
(:func:`.attention._decode_attention_flat_kernel`), so the same split rule and
merge kernels apply. What differs is how a block of fp8 keys and values reaches
the tensor cores (Triton 3.6, sm_90: registers, spills and instruction counts
from ``aot_check`` and the SASS; benchmarks/NOTES.md §6):

- the query tile, its scaling (``SCALE_Q``), the item's top-k slots and their
  pages are loaded once per item, before a loop over the item's blocks whose
  only loads are K and V. With no page lookup inside the loop (a second level
  of indirection, between which the pipeliner splits its depth) ``STAGES=3``
  gives K and V two shared-memory buffers, so the next block's copy is in
  flight while a block is computed (the shared kernel has one buffer at
  ``STAGES`` 3 and 4: each copy starts after the previous block's math);
- V is widened e4m3 -> fp16 from its 16-byte rows and goes to the dot through
  shared memory as fp16 (:func:`_widened_rows`): the dot reduces over V's keys,
  which are a row (128 bytes) apart, and Triton's own path reads an fp8 dot
  operand there one byte at a time (for 128 x 128 tiles and 4 warps: 128 loads
  and ~160 packing instructions per thread and block);
- ``KEYS_A`` (``kv8_dots="keys_a"``) computes the transposed scores
  ``K @ q^T``: the tile's 64 or 128 keys are the rows of the dot, enough for
  Hopper's warpgroup MMA (``q^T`` and ``P^T`` are read from shared memory, the keys are widened in
  registers), and the output is ``V^T @ P^T``. ``"keys_b"`` keeps ``q @ K^T``
  (``mma.sync``, 16 rows) with the keys loaded as ``[D, BN]`` so that their
  widening needs no register transpose.

Example:
    >>> KV8_DOTS
    ('', 'keys_a', 'keys_b')
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_configs import KV8_DOTS
from .tiles import load_query_rows, softmax_weights, store_item
from .tl_utils import kv_scale, load_page, pdl_prologue

__all__ = ["KV8_DOTS"]


@triton.jit
def _item_pages(sel, slots, bt_row, s_bt_b, num_pages, pos, B: tl.constexpr):
    """The page of each top-k slot of a decode token at ``pos``, -1 where the slot attends nothing.

    A slot attends nothing when it is -1, names a block past the token's own or
    repeats an earlier slot's block (each block counts once), or when the token
    is padding (``pos < 0``).
    """
    earlier = tl.max(((sel[:, None] == sel[None, :]) & (slots[None, :] < slots[:, None])).to(tl.int32), axis=1)
    # the token's last visible block; none for padding (pos < 0: pos // B would truncate towards 0)
    last = tl.where(pos >= 0, pos // B, -1)
    use = (sel >= 0) & (sel <= last) & (earlier == 0)
    pages = load_page(bt_row + tl.where(use, sel, 0) * s_bt_b, num_pages, mask=use)
    return tl.where(use, pages, -1)


@triton.jit
def _widened_rows(x, R: tl.constexpr, C: tl.constexpr):
    """``x`` (``[R, C]``, already widened) unchanged, as a value Triton cannot re-narrow.

    Triton moves a dot operand's layout conversion above an elementwise
    widening, so that the narrow values cross shared memory; a split and join
    are not ops it moves it through, so the widened tile is what is stored.
    """
    a, b = tl.split(x.reshape(R, C // 2, 2))
    return tl.join(a, b).reshape(R, C)


@triton.jit
def _decode_attention_kv8_kernel(
    q_ptr, s_qt, s_qh, s_qd, k_ptr, s_kp, s_kb, s_kh, s_kd, v_ptr, s_vp, s_vb, s_vh, s_vd,
    bt_ptr, s_bt_r, s_bt_b, num_pages, tok_req_ptr, pos_ptr, sel_ptr, s_sel_h, s_sel_t, s_sel_k,
    out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G, num_h, num_items, IPP, qk_scale,
    ks_ptr, s_ks, vs_ptr, s_vs,
    B: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, SPLITS: tl.constexpr, KPS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr = 3, PDL: tl.constexpr = False,
    KV_SCALED: tl.constexpr = False, SCALE_Q: tl.constexpr = False, KEYS_A: tl.constexpr = True,
):
    """Program ``p`` takes items ``[p * IPP, (p + 1) * IPP)``; item = (token, KV head, split)."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    rows = tl.arange(0, G_PAD)
    row_ok = rows < G
    offs_d = tl.arange(0, D)
    slots = tl.arange(0, K_PAD)
    zero_rows = tl.full([G_PAD], 0, tl.int32)
    for item in tl.range(p * IPP, tl.minimum(p * IPP + IPP, num_items)):
        sp = item % SPLITS
        t = item // SPLITS // num_h
        h = item // SPLITS % num_h
        r = tl.load(tok_req_ptr + t)
        pos = tl.load(pos_ptr + t)
        toks = zero_rows + t
        sel = tl.load(sel_ptr + h * s_sel_h + t * s_sel_t + slots * s_sel_k, mask=slots < K, other=-1)
        pages = _item_pages(sel, slots, bt_ptr + r * s_bt_r, s_bt_b, num_pages, pos, B)
        q, undo = load_query_rows(q_ptr, toks, h * G + rows, s_qt, s_qh, s_qd, row_ok, D, DOT_DTYPE, SCALE_Q)
        # each query row's logit factor (undo is 1 without SCALE_Q)
        f = qk_scale * kv_scale(ks_ptr, h, s_ks, KV_SCALED) * undo
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        if KEYS_A:
            q_t = tl.trans(q)
            acc = tl.zeros([D, G_PAD], tl.float32)
        else:
            acc = tl.zeros([G_PAD, D], tl.float32)
        k_head = k_ptr + h * s_kh
        v_head = v_ptr + h * s_vh
        for j in tl.range(0, KPS, num_stages=STAGES):
            i = sp * KPS + j
            blk = tl.max(tl.where(slots == i, sel, -1), axis=0)
            page = tl.max(tl.where(slots == i, pages, -1), axis=0)
            use = page >= 0
            page = tl.maximum(page, 0)
            for c in tl.static_range(0, B, BN):
                offs_j = c + tl.arange(0, BN)
                seen = use & (blk * B + offs_j <= pos)
                # full-shape masks (the interpreter cannot broadcast a scalar one); an unused slot's
                # loads are masked off: zeros, never a stale page's NaNs
                ld = (tl.zeros([BN, D], tl.int32) + use.to(tl.int32)) > 0
                if KEYS_A:
                    keys = tl.load(k_head + page * s_kp + offs_j[:, None] * s_kb + offs_d[None, :] * s_kd,
                                   mask=ld, other=0.0).to(DOT_DTYPE)
                    s = tl.dot(keys, q_t, input_precision=DOT_PREC) * f[None, :]
                    visible = seen[:, None] & row_ok[None, :]
                else:
                    ld_t = (tl.zeros([D, BN], tl.int32) + use.to(tl.int32)) > 0
                    keys_t = tl.load(k_head + page * s_kp + offs_d[:, None] * s_kd + offs_j[None, :] * s_kb,
                                     mask=ld_t, other=0.0).to(DOT_DTYPE)
                    s = tl.dot(q, keys_t, input_precision=DOT_PREC) * f[:, None]
                    visible = row_ok[:, None] & seen[None, :]
                vals = tl.load(v_head + page * s_vp + offs_j[:, None] * s_vb + offs_d[None, :] * s_vd,
                               mask=ld, other=0.0)
                vals = _widened_rows(vals.to(DOT_DTYPE), BN, D)
                s = tl.where(visible, s, float("-inf"))
                if KEYS_A:
                    pr, alpha, m_i, l_i = softmax_weights(s, m_i, l_i, 0)
                    acc = acc * alpha[None, :] + tl.dot(tl.trans(vals), pr.to(DOT_DTYPE), input_precision=DOT_PREC)
                else:
                    pr, alpha, m_i, l_i = softmax_weights(s, m_i, l_i, 1)
                    acc = acc * alpha[:, None] + tl.dot(pr.to(DOT_DTYPE), vals, input_precision=DOT_PREC)
        if KEYS_A:
            out = tl.trans(acc)
        else:
            out = acc
        store_item(out_ptr, toks, h * G + rows, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
                   (t * num_h + h) * SPLITS + sp, out * kv_scale(vs_ptr, h, s_vs, KV_SCALED), m_i, l_i, row_ok,
                   D, G_PAD, SPLITS)
