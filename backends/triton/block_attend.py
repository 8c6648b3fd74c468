"""Online-softmax steps of the attention kernels over one selected block's keys (docs/spec.md §4).

A block is ``B`` keys read ``BN`` at a time (a whole 128 x 128 K tile and its V tile would not fit in
registers next to the accumulator), through its page or, for token slots, through the slot table
(:mod:`.addressing`), in any K/V format: 16-bit or fp32, fp8 widened to the dot's dtype (per-slot
scales on the logits and weights), NVFP4 unpacked on chip (:mod:`.nvfp4`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .addressing import block_keys, key_offsets
from .nvfp4 import load_nvfp4_rows
from .tiles import softmax_weights
from .tl_utils import slot_scales

__all__ = ["online_softmax_step"]


@triton.jit
def _softmax_update(q, keys, vals, row_mask, key_pos, pos, m_i, l_i, acc, qk_scale, k_f, v_f,
                    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, SLOT_SCALED: tl.constexpr):
    """One online-softmax step (base 2, scale folded in) over a tile of keys at positions ``key_pos``
    (``k_f``, ``v_f``: the keys' per-slot scale factors with ``SLOT_SCALED``)."""
    s = tl.dot(q, tl.trans(keys), input_precision=DOT_PREC) * qk_scale
    if SLOT_SCALED:
        s = s * k_f[None, :]
    visible = row_mask[:, None] & (key_pos[None, :] <= pos[:, None])
    return online_softmax_step(tl.where(visible, s, float("-inf")), vals, m_i, l_i, acc, v_f, DOT_DTYPE, DOT_PREC,
                               SLOT_SCALED)


@triton.jit
def online_softmax_step(s, vals, m_i, l_i, acc, v_f, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                        SLOT_SCALED: tl.constexpr):
    """Fold one tile of base-2 logits ``s`` (``-inf`` where a key is not visible) and its values
    into the running maximum ``m_i``, sum ``l_i`` and unnormalised output ``acc`` (``v_f``: the
    values' per-slot scale factors with ``SLOT_SCALED``, applied to the weights, not to the sum)."""
    p, alpha, m_new, l_i = softmax_weights(s, m_i, l_i, 1)
    if SLOT_SCALED:
        pv = p * v_f[None, :]
    else:
        pv = p
    acc = acc * alpha[:, None] + tl.dot(pv.to(DOT_DTYPE), vals, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_page, v_page, s_kb, s_kd, s_vb, s_vd, row_mask, pos, b,
                  qk_scale, ks_row, vs_row, kb_page, vb_page, s_kbb, s_kbd, s_vbb, s_vbd,
                  B: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, SLOT_SCALED: tl.constexpr,
                  KV_NVFP4: tl.constexpr = False, slot_blk=None, s_col=0, cols_left=0, num_slots=1,
                  s_kp=0, s_vp=0, s_kbp=0, s_vbp=0, SLOTS: tl.constexpr = False):
    """Online-softmax steps over block ``b`` (its page's K/V head slices) for the masked rows
    (``ks_row``, ``vs_row``: the page's per-slot scales of this KV head, read with ``SLOT_SCALED``;
    ``kb_page``, ``vb_page``: its NVFP4 block scales of this KV head, read with ``KV_NVFP4``).

    The block is taken ``BN`` keys at a time: a whole 128 x 128 K tile plus its V
    tile would not fit in registers next to the accumulator. With ``SLOTS`` the pointers are the
    caches' bases (page 0) and each key's row is its position's slot (:mod:`.addressing`; ``s_kp``
    .. ``s_vbp``: the one-token pages' strides).
    """
    offs_d = tl.arange(0, D)
    for c in tl.static_range(0, B, BN):
        offs_j = c + tl.arange(0, BN)
        at = block_keys(offs_j, slot_blk, s_col, cols_left, num_slots, SLOTS)
        if KV_NVFP4:
            keys = load_nvfp4_rows(k_page + key_offsets(at, s_kp, s_kb, SLOTS),
                                   kb_page + key_offsets(at, s_kbp, s_kbb, SLOTS), s_kd, s_kbd, D, DOT_DTYPE)
            vals = load_nvfp4_rows(v_page + key_offsets(at, s_vp, s_vb, SLOTS),
                                   vb_page + key_offsets(at, s_vbp, s_vbb, SLOTS), s_vd, s_vbd, D, DOT_DTYPE)
        else:
            keys = tl.load(k_page + key_offsets(at, s_kp, s_kb, SLOTS)[:, None] + offs_d[None, :] * s_kd).to(DOT_DTYPE)
            vals = tl.load(v_page + key_offsets(at, s_vp, s_vb, SLOTS)[:, None] + offs_d[None, :] * s_vd).to(DOT_DTYPE)
        m_i, l_i, acc = _softmax_update(q, keys, vals, row_mask, b * B + offs_j, pos, m_i, l_i, acc,
                                        qk_scale, slot_scales(ks_row, at, SLOT_SCALED),
                                        slot_scales(vs_row, at, SLOT_SCALED), DOT_DTYPE, DOT_PREC, SLOT_SCALED)
    return m_i, l_i, acc


@triton.jit
def _attend_block_masked(q, m_i, l_i, acc, k_page, v_page, s_kb, s_kd, s_vb, s_vd, row_mask, pos, b, use,
                         qk_scale, ks_row, vs_row, kb_page, vb_page, s_kbb, s_kbd, s_vbb, s_vbd,
                         B: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, SLOT_SCALED: tl.constexpr,
                         KV_NVFP4: tl.constexpr = False, slot_blk=None, s_col=0, cols_left=0, num_slots=1,
                         s_kp=0, s_vp=0, s_kbp=0, s_vbp=0, SLOTS: tl.constexpr = False):
    """:func:`_attend_block` with the K/V loads predicated on ``use`` (scalar): no traffic when False."""
    offs_d = tl.arange(0, D)
    for c in tl.static_range(0, B, BN):
        offs_j = c + tl.arange(0, BN)
        ldj = (tl.zeros([BN], tl.int32) + use.to(tl.int32)) > 0
        at = block_keys(offs_j, slot_blk, s_col, cols_left, num_slots, SLOTS, ldj)
        if KV_NVFP4:   # masked rows: zero bytes and zero scales, so zeros as below
            keys = load_nvfp4_rows(k_page + key_offsets(at, s_kp, s_kb, SLOTS),
                                   kb_page + key_offsets(at, s_kbp, s_kbb, SLOTS), s_kd, s_kbd, D, DOT_DTYPE, ldj)
            vals = load_nvfp4_rows(v_page + key_offsets(at, s_vp, s_vb, SLOTS),
                                   vb_page + key_offsets(at, s_vbp, s_vbb, SLOTS), s_vd, s_vbd, D, DOT_DTYPE, ldj)
        else:
            # a full-shape mask (the interpreter cannot broadcast a scalar boolean mask)
            ld = (tl.zeros([BN, D], tl.int32) + use.to(tl.int32)) > 0
            keys = tl.load(k_page + key_offsets(at, s_kp, s_kb, SLOTS)[:, None] + offs_d[None, :] * s_kd, mask=ld,
                           other=0.0)
            vals = tl.load(v_page + key_offsets(at, s_vp, s_vb, SLOTS)[:, None] + offs_d[None, :] * s_vd, mask=ld,
                           other=0.0)
        m_i, l_i, acc = _softmax_update(q, keys.to(DOT_DTYPE), vals.to(DOT_DTYPE), row_mask, b * B + offs_j,
                                        pos, m_i, l_i, acc, qk_scale, slot_scales(ks_row, at, SLOT_SCALED, ldj),
                                        slot_scales(vs_row, at, SLOT_SCALED, ldj), DOT_DTYPE, DOT_PREC,
                                        SLOT_SCALED)
    return m_i, l_i, acc
