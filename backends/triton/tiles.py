"""Triton helpers shared by the indexer and attention kernels: which tokens a tile's rows are.

A tile's rows are ``(token, sub)`` pairs, ``ROWS = M * GROUP`` padded to a power of two:
``M`` consecutive query tokens of one request times ``GROUP`` heads (index heads
in the indexer, the query heads of one KV group in the attention). Positions
come from ``batch.token_positions`` (``-1`` marks a padding token).

Query rows are loaded by :func:`load_query_rows`, which can scale each row by a
power of two for a dot in fp16 (bf16 queries against an fp8 cache: e4m3 ->
fp16 is one native conversion per two values on sm_89+, e4m3 -> bf16 several).
The attention kernels share their online-softmax step (:func:`softmax_weights`)
and the decode kernels the store of an item's result (:func:`store_item`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["token_rows", "visible_blocks", "request_of", "load_rows", "load_query_rows", "score_scale", "store_rows",
           "softmax_weights", "store_item"]


@triton.jit
def token_rows(qsl_ptr, pos_ptr, r, t0, GROUP, tok_lo, tok_hi, W, ROWS: tl.constexpr, M: tl.constexpr,
               B: tl.constexpr):
    """Rows of tokens ``t0 .. t0+M-1`` of request ``r``.

    Returns ``(tok, sub, row_in, pos, row_ok, nb)``: flat token index, head
    within the group, row holds a token of the request, its position, row holds
    a real (non-padding) token, and its number of visible blocks (0 if padding).
    The contents are judged on the device while this runs (a fault raises at the
    next step), so whatever they hold stays inside the tensors: a row is a token
    only in ``[tok_lo, tok_hi)`` (the launch's tokens: the step's decodes, or its
    prefills) and sees at most ``W`` blocks (the block table's columns), so a
    corrupt query start or position addresses no row outside the launch's rows
    of ``q``, ``out`` and workspaces, and no column past the table.
    """
    start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - start
    rows = tl.arange(0, ROWS)
    mi = rows // GROUP
    sub = rows % GROUP
    tok = start + t0 + mi
    row_in = (mi < M) & (t0 + mi < qlen) & (tok >= tok_lo) & (tok < tok_hi)
    pos = tl.load(pos_ptr + tok, mask=row_in, other=-1)
    row_ok = row_in & (pos >= 0)
    return tok, sub, row_in, pos, row_ok, visible_blocks(pos, row_ok, W, B)


@triton.jit
def visible_blocks(pos, ok, W, B: tl.constexpr):
    """The blocks a token at ``pos`` sees, ``pos // B + 1``, at most ``W`` (the block table's columns: a
    position past them is a fault the contents judge reports, and must not make a kernel read past the
    table); 0 where ``ok`` is False (padding: a negative position is never divided, as Triton truncates
    where Python floors)."""
    return tl.where(ok, tl.minimum(pos // B + 1, W), 0)


@triton.jit
def request_of(ptr, mask, lo, n):
    """The request at ``ptr`` (``token_to_request``) clamped into ``[lo, lo + n)``: the requests a launch
    serves (the step's decodes, or a prefill launch's). The contents are judged on the device while a
    kernel runs, so a corrupt entry must still name a request of the launch (its rows of the block table,
    its counters and flags). ``mask`` as for ``tl.load`` (None: unmasked); masked-off lanes give ``lo``."""
    if mask is None:
        req = tl.load(ptr)
    else:
        req = tl.load(ptr, mask=mask, other=lo)
    return tl.minimum(tl.maximum(req, lo), lo + n - 1)


@triton.jit
def load_rows(ptr, tok, head, s_t, s_h, s_d, row_ok, D: tl.constexpr, DTYPE: tl.constexpr):
    """The ``[ROWS, D]`` tile ``ptr[tok, head, :]`` (zeros in rows that hold no token), as ``DTYPE``."""
    offs_d = tl.arange(0, D)
    tile = tl.load(ptr + tok[:, None] * s_t + head[:, None] * s_h + offs_d[None, :] * s_d,
                   mask=row_ok[:, None], other=0.0)
    return tile.to(DTYPE)


@triton.jit
def load_query_rows(ptr, tok, head, s_t, s_h, s_d, row_ok, D: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    SCALE_Q: tl.constexpr):
    """The ``[ROWS, D]`` query tile as ``DOT_DTYPE`` and the per-row fp32 factor that undoes its scaling.

    With ``SCALE_Q`` (bf16 rows dotted in fp16) each row is multiplied by the
    power of two that puts its largest magnitude in ``[2^14, 2^15)``: exact for
    every element above 2^-28 of its row's maximum (bf16 has fewer mantissa
    bits than fp16; smaller ones become fp16 subnormals, off by at most 2^-39
    of the row's maximum), and no bf16 value can overflow fp16's range. The
    caller multiplies the dot's result by ``undo`` (a max commutes with it; a
    softmax takes it in its score scale). Without it: :func:`load_rows` and ones.
    """
    if SCALE_Q:
        tl.static_assert(ptr.dtype.element_ty == tl.bfloat16, "SCALE_Q scales bf16 rows")
        q = load_rows(ptr, tok, head, s_t, s_h, s_d, row_ok, D, tl.bfloat16)
        # the largest magnitude's exponent from the bits (|x| orders like its bits): no fp32 copy
        # of the tile stays live across the row reduction (the persistent decode kernel spilled)
        mag = q.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
        expo = (tl.max(mag, axis=1) >> 7) - 127
        shift = tl.minimum(tl.maximum(14 - expo, -125), 125)
        scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
        undo = ((127 - shift) << 23).to(tl.float32, bitcast=True)
        return (q.to(tl.float32) * scale[:, None]).to(DOT_DTYPE), undo
    else:
        q = load_rows(ptr, tok, head, s_t, s_h, s_d, row_ok, D, DOT_DTYPE)
        return q, tl.full([q.shape[0]], 1.0, tl.float32)


@triton.jit
def score_scale(qk_scale, undo, SCALE_Q: tl.constexpr):
    """The factor from a dot of query rows to logits: ``qk_scale``, times each row's ``undo``
    (from :func:`load_query_rows`, as a ``[ROWS, 1]`` column) when the rows were scaled."""
    if SCALE_Q:
        f = qk_scale * undo[:, None]
    else:
        f = qk_scale
    return f


@triton.jit
def store_rows(ptr, tok, head, s_t, s_h, s_d, acc, denom, row_mask, D: tl.constexpr):
    """Store ``acc / denom`` (rows with ``denom == 0`` -> zeros) to ``ptr[tok, head, :]`` in ptr's dtype."""
    offs_d = tl.arange(0, D)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(ptr + tok[:, None] * s_t + head[:, None] * s_h + offs_d[None, :] * s_d,
             out.to(ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def softmax_weights(s, m_i, l_i, AXIS: tl.constexpr):
    """One online-softmax step over a tile of base-2 logits ``s`` (``-inf`` where a key is not visible)
    whose keys run along ``AXIS``: ``(p, alpha, m_new, l_new)``.

    ``m_i`` and ``l_i`` are the running maximum and sum of each query (the other
    axis); ``p`` are the tile's unnormalised weights and ``alpha`` the factor
    that rescales what was accumulated before (the caller adds ``p``'s dot).
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=AXIS))
    # queries with nothing visible so far keep m = -inf; shift by 0 there to avoid inf - inf
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - tl.expand_dims(m_safe, AXIS))
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=AXIS)


@triton.jit
def store_item(out_ptr, tok, head, s_t, s_h, s_d, ws_m_ptr, ws_l_ptr, ws_acc_ptr, base, acc, m_i, l_i, row_mask,
               D: tl.constexpr, G_PAD: tl.constexpr, SPLITS: tl.constexpr):
    """A decode work item's result, rows ``row_mask``: with one split its output rows (:func:`store_rows`),
    else its partial ``(max, sum, acc)`` at slot ``base`` of the flash-decoding workspace, which holds
    ``G_PAD`` rows per (token, KV head, split) and which the merge kernels read."""
    if SPLITS == 1:
        store_rows(out_ptr, tok, head, s_t, s_h, s_d, acc, l_i, row_mask, D)
    else:
        rows = tl.arange(0, G_PAD)
        tl.store(ws_m_ptr + base * G_PAD + rows, m_i, mask=row_mask)
        tl.store(ws_l_ptr + base * G_PAD + rows, l_i, mask=row_mask)
        tl.store(ws_acc_ptr + (base * G_PAD + rows)[:, None] * D + tl.arange(0, D)[None, :], acc,
                 mask=row_mask[:, None])
