"""The indexers' score of one block (docs/spec.md §3.3): the max over its visible keys of each row's dot.

Shared by the decode and prefill indexers (:mod:`.indexer`) and the block scores (:mod:`.index_scores`),
so all three rank the same numbers. A block's keys are found through its page or, for token slots,
through the slot table, one row per position (:mod:`.addressing`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .addressing import block_keys, key_offsets, slot_block
from .nvfp4 import load_nvfp4_rows
from .tl_utils import load_reported_page

__all__ = ["NAN_SCORE"]

# docs/spec.md §3.3: a NaN block's score; tl.constexpr so the kernels may read it as a global
NAN_SCORE = tl.constexpr(-1e30)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _causal_mask(s, key_pos, pos):
    """Scores ``[ROWS, BN]`` set to -inf where the key comes after the row."""
    return tl.where(key_pos[None, :] <= pos[:, None], s, float("-inf"))


@triton.jit
def _block_max_scores(q, page_ptr, s_ik_b, s_ik_d, b, pos, row_scale,
                      ROWS: tl.constexpr, B: tl.constexpr, BN: tl.constexpr, DI: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, NAN_IN_MAX: tl.constexpr = False,
                      pos_min=0, MASK_ALL: tl.constexpr = True, scale_page=None, s_is_b=0, s_is_d=0,
                      INDEX_NVFP4: tl.constexpr = False, slot_blk=None, s_col=0, cols_left=0, num_slots=1,
                      s_ik_p=0, s_is_p=0, SLOTS: tl.constexpr = False):
    """Max over block ``b``'s visible keys (``j <= pos``) of ``<q_row, key_j>``, per row; NaN -> -1e30.

    Keys are read ``BN`` at a time to bound register use. ``row_scale``
    (fp32, ``[ROWS]``, positive) undoes a per-row scaling of ``q`` (see
    :func:`.tiles.load_query_rows`); the max commutes with it. With
    ``NAN_IN_MAX`` a NaN score is carried by the max itself (one row
    reduction per key tile instead of two). Without ``MASK_ALL`` a key tile
    that every row sees whole (its last key at or before ``pos_min``, the
    smallest position of the rows that count) skips the causal mask: in a
    prefill tile only the diagonal blocks need it, and the mask's compare and
    select per score were a quarter of the instructions of the loop. With
    ``INDEX_NVFP4`` the keys are packed e2m1 with their block scales at
    ``scale_page`` (``s_is_b``, ``s_is_d``: that page's strides), unpacked exactly. With ``SLOTS``
    ``page_ptr`` and ``scale_page`` are the caches' bases and each key's row is its position's slot
    (:func:`.addressing.block_keys` at ``slot_blk``; ``s_ik_p``, ``s_is_p``: the one-token pages' strides).
    """
    offs_d = tl.arange(0, DI)
    smax = tl.full([ROWS], float("-inf"), tl.float32)
    nans = tl.zeros([ROWS], tl.int32)
    for c in tl.static_range(0, B, BN):
        offs_j = c + tl.arange(0, BN)
        at = block_keys(offs_j, slot_blk, s_col, cols_left, num_slots, SLOTS)
        if INDEX_NVFP4:
            keys = load_nvfp4_rows(page_ptr + key_offsets(at, s_ik_p, s_ik_b, SLOTS),
                                   scale_page + key_offsets(at, s_is_p, s_is_b, SLOTS), s_ik_d, s_is_d, DI, DOT_DTYPE,
                                   SCALE_PER_ELEMENT=True)
        else:
            keys = tl.load(page_ptr + key_offsets(at, s_ik_p, s_ik_b, SLOTS)[:, None] + offs_d[None, :] * s_ik_d
                           ).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(keys), input_precision=DOT_PREC)  # [ROWS, BN] fp32
        if MASK_ALL:
            s = _causal_mask(s, b * B + offs_j, pos)
        elif b * B + c + BN - 1 > pos_min:
            s = _causal_mask(s, b * B + offs_j, pos)
        if NAN_IN_MAX:
            smax = _max_keep_nan(smax, tl.reduce(s, 1, _max_keep_nan))
        else:
            smax = tl.maximum(smax, tl.max(s, axis=1))
            nans += tl.max((s != s).to(tl.int32), axis=1)
    if NAN_IN_MAX:
        nans = (smax != smax).to(tl.int32)
    return tl.where(nans > 0, NAN_SCORE, smax * row_scale)


@triton.jit
def _block_page(bt_ptr, s_bt_r, s_bt_b, num_pages, faults_ptr, r, b, st_ptr, s_st_r, s_st_c, st_rows, st_width,
                sr_ptr, B: tl.constexpr, SLOTS: tl.constexpr):
    """``(page, slot_blk, cols_left)`` of block ``b`` of request ``r``: its page (read and reported,
    :func:`.tl_utils.load_reported_page`) for pages; page 0 and where its slots are
    (:func:`.addressing.slot_block`) for token slots, whose entries the judge of the contents reports
    (:mod:`.contents`)."""
    if SLOTS:
        slot_blk, cols_left = slot_block(st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr, r, b, B)
        return 0, slot_blk, cols_left
    else:
        return load_reported_page(bt_ptr + r * s_bt_r + b * s_bt_b, num_pages, faults_ptr, r, b), st_ptr, 0
