"""A batch's contents judged in one launch (the ``check_contents`` hook; mm3's rules: docs/errors.md §2.6).

``_contents_kernel`` grid ``(requests,)``
    Program ``r`` judges request ``r``: its query start and length against the
    step's counts (rules 1-9 of :mod:`mm3.contract.contents`), its context
    length when the batch has its own (rule 11), the position and request of
    each of its tokens (rule 10), and each block-table entry its ``seq_len``
    uses (a page id in ``[0, num_pages)``); for token slots instead its slot row
    (rule 12) and the slot of each position below its ``seq_len`` (a row of the
    cache, :func:`mm3.contract.contents.slots_word`). It lowers the flag word to the
    smallest fault word it met (a plain load and store: of programs that find
    faults at once any one may win), the word
    :func:`mm3.contract.contents.lengths_word` and ``pages_word`` compute with
    about sixty torch operations: one launch instead, no synchronisation.

The grid and every argument come from shapes and the batch's host ints, so the
launch captures in a CUDA graph.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from mm3.plugin import BatchMetadata

from .addressing import slot_args
from .fast_launch import launch
from .launch import LaunchConfig
from .tl_utils import launch_options, step_kernel

__all__ = ["check_contents", "judge_request", "judge_args", "judge_block", "unjudged_args", "JudgeArgs", "TILE"]

#: tokens and block-table columns a program reads at a time
TILE = 64
# a kernel reads only constexpr globals
_LENGTHS: tl.constexpr = tl.constexpr(1 << 62)        # mm3.contract.contents.LENGTHS
_NO_FAULT: tl.constexpr = tl.constexpr(2 ** 63 - 1)   # mm3.contract.contents.NO_FAULT


@triton.jit
def _code(value: tl.constexpr):
    """``value`` as an int64 scalar (a literal past int32 would not fit Triton's default)."""
    return tl.full((), value, tl.int64)


@triton.jit
def _rule(word, bad, rule: tl.constexpr, index):
    return tl.minimum(word, tl.where(bad, _code(_LENGTHS + (rule << 40)) + index.to(tl.int64), _code(_NO_FAULT)))


@step_kernel("R", "T", "nd", "dql", "ndt", "mpq", "M", "num_pages")
def _contents_kernel(qsl_ptr, sl_ptr, ctx_ptr, bt_ptr, s_bt_r, s_bt_b, t2r_ptr, pos_ptr, word_ptr,
                     R, T, nd, dql, ndt, mpq, M, num_pages, st_ptr, s_st_r, s_st_c, st_rows, sr_ptr,
                     B: tl.constexpr, HAS_CTX: tl.constexpr, TILE: tl.constexpr, SLOTS: tl.constexpr = False):
    """Lower ``word`` to the smallest fault word of request ``program_id(0)``."""
    judge_request(tl.program_id(0), qsl_ptr, sl_ptr, ctx_ptr, bt_ptr, s_bt_r, s_bt_b, t2r_ptr, pos_ptr, word_ptr,
                  R, T, nd, dql, ndt, mpq, M, num_pages, st_ptr, s_st_r, s_st_c, st_rows, sr_ptr,
                  B, HAS_CTX, TILE, SLOTS)


@triton.jit
def judge_request(r, qsl_ptr, sl_ptr, ctx_ptr, bt_ptr, s_bt_r, s_bt_b, t2r_ptr, pos_ptr, word_ptr,
                  R, T, nd, dql, ndt, mpq, M, num_pages, st_ptr, s_st_r, s_st_c, st_rows, sr_ptr,
                  B: tl.constexpr, HAS_CTX: tl.constexpr, TILE: tl.constexpr, SLOTS: tl.constexpr):
    """Lower ``word`` to the smallest fault word of request ``r`` (the arguments of :func:`judge_args`;
    a kernel that judges the batch as it works calls this once per request). ``SLOTS``: token slots
    (``st_ptr`` .. ``sr_ptr``: the slot table, its strides and rows, each request's row; ``M`` its
    columns, ``B`` 1), else dummies never read."""
    r = r.to(tl.int64)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    end = tl.load(qsl_ptr + r + 1).to(tl.int64)
    sl = tl.load(sl_ptr + r).to(tl.int64)
    ql = end - start
    dec = r < nd
    pad = dec & (sl == 0)
    w = _code(_NO_FAULT)
    w = _rule(w, (r == 0) & (tl.load(qsl_ptr).to(tl.int64) != 0), 1, r)
    w = _rule(w, ql < 0, 2, r)
    w = _rule(w, (r == R - 1) & (end != T), 3, r)
    w = _rule(w, dec & (ql != 0) & (ql != dql), 4, r)
    w = _rule(w, (r == 0) & (tl.load(qsl_ptr + tl.minimum(nd, R)).to(tl.int64) != ndt), 5, r)
    w = _rule(w, (pad == 0) & (sl < ql), 6, r)
    w = _rule(w, (dec == 0) & (ql < 1), 7, r)
    w = _rule(w, (dec == 0) & (ql > mpq), 8, r)
    w = _rule(w, (sl < 0) | ((sl + B - 1) // B > M), 9, r)
    if HAS_CTX:
        w = _rule(w, tl.load(ctx_ptr + r).to(tl.int64) != tl.maximum(sl - ql, 0), 11, r)
    # rule 10: each token's position and request as the lengths give them (padding: -1)
    hi = tl.minimum(end, T)
    for t0 in tl.range(tl.maximum(start, 0), hi, TILE):
        t = t0 + tl.arange(0, TILE)
        inside = t < hi
        p = tl.load(pos_ptr + t, mask=inside, other=0).to(tl.int64)
        q = tl.load(t2r_ptr + t, mask=inside, other=0).to(tl.int64)
        want = tl.maximum(sl - (end - t), -1)
        bad = inside & ((p != want) | (q != r))
        w = tl.minimum(w, tl.min(tl.where(bad, _code(_LENGTHS + (10 << 40)) + t, _code(_NO_FAULT)), axis=0))
    if SLOTS:
        # its slot row (padding, with no position to read, needs none), then the slot of every used position
        row = tl.load(sr_ptr + r).to(tl.int64)
        row_ok = (row >= 0) & (row < st_rows)
        w = _rule(w, (row_ok == 0) & (sl > 0), 12, r)
        used = tl.where(row_ok, tl.minimum(sl, M), 0)
        slot_row = st_ptr + tl.where(row_ok, row, 0) * s_st_r
        for c0 in tl.range(0, used, TILE):
            c = c0 + tl.arange(0, TILE)
            inside = c < used
            slot = tl.load(slot_row + c * s_st_c, mask=inside, other=0).to(tl.int64)
            bad = inside & ((slot < 0) | (slot >= num_pages))
            w = tl.minimum(w, tl.min(tl.where(bad, (r << 32) + c, _code(_NO_FAULT)), axis=0))
    else:
        # the block-table entries the request's seq_len uses
        used = tl.minimum((sl + B - 1) // B, M)
        for c0 in tl.range(0, used, TILE):
            c = c0 + tl.arange(0, TILE)
            inside = c < used
            page = tl.load(bt_ptr + r * s_bt_r + c * s_bt_b, mask=inside, other=0).to(tl.int64)
            bad = inside & ((page < 0) | (page >= num_pages))
            w = tl.minimum(w, tl.min(tl.where(bad, (r << 32) + c, _code(_NO_FAULT)), axis=0))
    # the word is host memory mapped into the device: a read of it crosses the bus (about a microsecond,
    # and the programs' reads queue), so only a program that found a fault touches it. Atomics are not
    # portable there: a plain load and store (tl_utils.load_reported_page's), so of programs that find
    # faults at once any one may win
    if w != _NO_FAULT:
        if w < tl.load(word_ptr, volatile=True):
            tl.store(word_ptr, w)


class JudgeArgs(NamedTuple):
    """What :func:`judge_request` reads besides the request, for a kernel that judges a batch as it works:
    ``args`` (runtime arguments, after the request), ``has_ctx`` (its ``HAS_CTX``: the batch has context
    lengths of its own) and ``slots`` (its ``SLOTS``: token slots; its ``B`` is :func:`judge_block`'s)."""

    args: tuple[Any, ...]
    has_ctx: bool
    slots: bool


def judge_block(block_size: int, slots: bool) -> int:
    """:func:`judge_request`'s ``B``: the block size, or 1 for token slots (a column per position,
    docs/spec.md §2.1)."""
    return 1 if slots else block_size


def judge_args(batch: BatchMetadata, num_pages: int, word: torch.Tensor) -> JudgeArgs:
    """:func:`judge_request`'s arguments for ``batch`` (every request of it has one), lowering ``word``."""
    bt = batch.block_table
    R, M = bt.shape
    slots, on_slots = slot_args(batch, bt)
    if on_slots:
        M = slots.width
    ctx = batch.__dict__.get("context_lens")    # only the batch's own: derived ones are right by construction
    return JudgeArgs((batch.query_start_loc, batch.seq_lens, batch.seq_lens if ctx is None else ctx, bt, *bt.stride(),
                      batch.token_to_request, batch.token_positions, word, R, batch.num_tokens, batch.num_decodes,
                      batch.decode_query_len, batch.num_decode_tokens, batch.max_prefill_query_len, M, num_pages,
                      slots.table, slots.s_row, slots.s_col, slots.num_rows, slots.rows), ctx is not None, on_slots)


def unjudged_args(i32: torch.Tensor, word: torch.Tensor) -> tuple[Any, ...]:
    """Arguments in :func:`judge_args`' places for a launch that does not judge (never read; ``i32`` an int32
    tensor of the step): no host work per launch beyond the tuple."""
    return (i32, i32, i32, i32, 0, 0, i32, i32, word, 0, 0, 0, 0, 0, 0, 0, 0, i32, 0, 0, 0, i32)


def check_contents(batch: BatchMetadata, num_pages: int, word: torch.Tensor, cfg: LaunchConfig) -> None:
    """Lower ``word`` to the smallest fault word of ``batch``'s contents (mm3's ``check_contents`` hook)."""
    R = batch.block_table.shape[0]
    if not R:
        if batch.num_tokens:   # tokens but no request: query_start_loc cannot end at T (rule 3 of request 0)
            torch.minimum(word, torch.full_like(word, _LENGTHS.value + (3 << 40)), out=word)
        return
    j = judge_args(batch, num_pages, word)
    launch(_contents_kernel, (R,), j.args,
           dict(B=judge_block(batch.block_size, j.slots), HAS_CTX=j.has_ctx, TILE=TILE,
                **({"SLOTS": True} if j.slots else {})),
           dict(num_warps=1, **launch_options(cfg)), cfg.algorithms.fast_launch)
