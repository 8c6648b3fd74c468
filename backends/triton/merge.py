"""The flash-decoding merge: a decode (token, KV head)'s split partials into its output rows (docs/spec.md §4).

Each split of a decode pair leaves a partial ``(max, sum, acc)`` per query
row (:mod:`.attention`); the merge is their exact log-sum-exp combination.
Three callers, one summation order where bits must agree: the per-KV-head
kernel and the persistent attention's last program both run
:func:`merge_splits`; the per-row kernel (small grids) loads every split of
one row at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import store_rows
from .tl_utils import pdl_prologue

__all__ = ["merge_splits"]


@triton.jit
def _merge_kernel(
    out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G,
    D: tl.constexpr, G_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    merge_splits(out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G, tl.program_id(0), tl.program_id(1),
                 tl.num_programs(1), D, G_PAD, SPLITS, S_PAD, "")


@triton.jit
def merge_splits(out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G, t, h, num_h,
                 D: tl.constexpr, G_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                 CACHE: tl.constexpr):
    """Exact log-sum-exp merge of token ``t``'s KV head ``h``'s ``SPLITS`` partials into its output rows
    (``CACHE``: the partials' load cache modifier, ``".cg"`` when other programs of this launch wrote them).

    The splits are unrolled: no partial's loads wait for the previous partial's sums, so
    they can be in flight together (at batch 1, 16 splits of one program read from L2)."""
    rows = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    splits = tl.arange(0, S_PAD)
    base = (t * num_h + h) * SPLITS
    m_all = tl.load(ws_m_ptr + (base + splits)[:, None] * G_PAD + rows[None, :],
                    mask=(splits < SPLITS)[:, None], other=float("-inf"), cache_modifier=CACHE)
    m_max = tl.max(m_all, axis=0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s in tl.static_range(SPLITS):
        m_s = tl.load(ws_m_ptr + (base + s) * G_PAD + rows, cache_modifier=CACHE)
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_ref))
        l_tot += w * tl.load(ws_l_ptr + (base + s) * G_PAD + rows, cache_modifier=CACHE)
        acc += w[:, None] * tl.load(ws_acc_ptr + ((base + s) * G_PAD + rows)[:, None] * D + offs_d[None, :],
                                    cache_modifier=CACHE)
    store_rows(out_ptr, tl.full([G_PAD], 0, tl.int32) + t, h * G + rows, s_ot, s_oh, s_od, acc, l_tot,
               rows < G, D)


@triton.jit
def _merge_row_kernel(
    out_ptr, s_ot, s_oh, s_od, ws_m_ptr, ws_l_ptr, ws_acc_ptr, G, num_h,
    D: tl.constexpr, G_PAD: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """:func:`_merge_kernel` for one query head per program: every split's partial is loaded at
    once (``[S_PAD, D]``), so the merge is one memory round trip instead of ``SPLITS`` dependent ones."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.program_id(2)
    if g < G:
        offs_d = tl.arange(0, D)
        splits = tl.arange(0, S_PAD)
        live = splits < SPLITS
        base = (t * num_h + h) * SPLITS
        m = tl.load(ws_m_ptr + (base + splits) * G_PAD + g, mask=live, other=float("-inf"))
        l = tl.load(ws_l_ptr + (base + splits) * G_PAD + g, mask=live, other=0.0)
        acc = tl.load(ws_acc_ptr + ((base + splits) * G_PAD + g)[:, None] * D + offs_d[None, :],
                      mask=live[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_ref))
        l_tot = tl.sum(w * l, axis=0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_tot > 0, l_tot, 1.0)
        tl.store(out_ptr + t * s_ot + (h * G + g) * s_oh + offs_d * s_od, o.to(out_ptr.dtype.element_ty))
