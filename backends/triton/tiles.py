"""Triton helpers shared by the indexer and attention kernels: which tokens a tile's rows are.

A tile's rows are ``(token, sub)`` pairs, ``ROWS = M * GROUP`` padded to a power of two:
``M`` consecutive query tokens of one request times ``GROUP`` heads (index heads
in the indexer, the query heads of one KV group in the attention). Positions
come from ``batch.token_positions`` (``-1`` marks a padding token).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["token_rows", "load_rows", "store_rows"]


@triton.jit
def token_rows(qsl_ptr, pos_ptr, r, t0, GROUP, ROWS: tl.constexpr, M: tl.constexpr, B: tl.constexpr):
    """Rows of tokens ``t0 .. t0+M-1`` of request ``r``.

    Returns ``(tok, sub, row_in, pos, row_ok, nb)``: flat token index, head
    within the group, row holds a token of the request, its position, row holds
    a real (non-padding) token, and its number of visible blocks (0 if padding).
    """
    start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - start
    rows = tl.arange(0, ROWS)
    mi = rows // GROUP
    sub = rows % GROUP
    row_in = (mi < M) & (t0 + mi < qlen)
    tok = start + t0 + mi
    pos = tl.load(pos_ptr + tok, mask=row_in, other=-1)
    row_ok = row_in & (pos >= 0)
    # never divide a negative position: Triton truncates where Python floors
    nb = tl.where(row_ok, pos // B + 1, 0)
    return tok, sub, row_in, pos, row_ok, nb


@triton.jit
def load_rows(ptr, tok, head, s_t, s_h, s_d, row_ok, D: tl.constexpr, DTYPE: tl.constexpr):
    """The ``[ROWS, D]`` tile ``ptr[tok, head, :]`` (zeros in rows that hold no token), as ``DTYPE``."""
    offs_d = tl.arange(0, D)
    tile = tl.load(ptr + tok[:, None] * s_t + head[:, None] * s_h + offs_d[None, :] * s_d,
                   mask=row_ok[:, None], other=0.0)
    return tile.to(DTYPE)


@triton.jit
def store_rows(ptr, tok, head, s_t, s_h, s_d, acc, denom, row_mask, D: tl.constexpr):
    """Store ``acc / denom`` (rows with ``denom == 0`` -> zeros) to ``ptr[tok, head, :]`` in ptr's dtype."""
    offs_d = tl.arange(0, D)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(ptr + tok[:, None] * s_t + head[:, None] * s_h + offs_d[None, :] * s_d,
             out.to(ptr.dtype.element_ty), mask=row_mask[:, None])
