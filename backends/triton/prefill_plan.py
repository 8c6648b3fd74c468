"""The plan of the block-grouped prefill attention: the step's (token, block) pairs grouped by block.

:func:`plan_pairs` turns a selection ``[H, T, K]`` into the tiles that
:mod:`.prefill_attention`'s kernels walk (docs/spec.md §4 for what counts as a
selected block): per KV head, request and block (a *segment*) the tokens that
chose it, numbered in *plan order* (segment after segment), so that each tile's
partial results are one contiguous block of the workspace. Three small kernels
and a fill, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mm3.plugin import BatchMetadata

from .fast_launch import launch
from .launch import next_pow2
from .tiles import request_of
from .tl_utils import load_page, step_kernel

__all__ = ["PLAN_ROWS", "SCAN_KERNEL_MAX", "PairPlan", "plan_pairs"]


@dataclass(frozen=True)
class PairPlan:
    """The (token, block) pairs of a run of prefill tokens, grouped into tiles (see :func:`plan_pairs`).

    ``clean`` ``[H, Tc, K]``: each row's valid block ids once, ``-1`` elsewhere;
    ``place`` ``[H, Tc, K]``: each valid pair's place in plan order (segment after segment, a
    tile's pairs consecutive; the row of its partial in the workspace), ``-1`` elsewhere;
    ``tile_seg`` ``[max_tiles]``: each tile's segment id;
    ``tile_page`` ``[max_tiles]``: the page of each tile's block (token slots: each tile's request);
    ``tile_tok`` ``[max_tiles * M]``: per tile, the token (index into the step) of each of its ``M``
    pairs, filled from the front (slots past ``tile_pairs`` are not written);
    ``tile_pairs`` ``[max_tiles]``: how many of a tile's ``M`` slots hold a pair;
    ``tile_place`` ``[max_tiles]``: the place of each tile's first pair (its pairs follow it);
    ``num_tiles`` ``[1]`` (int32, on the device): only the first ``num_tiles`` tiles are meaningful.
    """

    clean: torch.Tensor
    place: torch.Tensor
    tile_seg: torch.Tensor
    tile_page: torch.Tensor
    tile_tok: torch.Tensor
    tile_pairs: torch.Tensor
    tile_place: torch.Tensor
    num_tiles: torch.Tensor


#: rows (token, KV head) of the selection per plan program: their pairs' atomics are issued
#: together (one row per one-warp program waited on one atomic round trip per program)
PLAN_ROWS = 8

# launch options of the plan kernels, one object each (the fast launcher knows them by identity)
_ONE_WARP = dict(num_warps=1)
_EIGHT_WARPS = dict(num_warps=8)


@triton.jit
def _plan_rows(tc0, Tc, K: tl.constexpr, K_PAD: tl.constexpr, R: tl.constexpr):
    """A plan program's rows ``tc0 .. tc0 + R - 1`` (chunk-local token indices) as ``[R, K_PAD]`` slots:
    ``(tc, slots, in_row)``; ``in_row`` is false for padding slots and rows past the chunk."""
    tc = tc0 + tl.arange(0, R)
    slots = tl.arange(0, K_PAD)
    return tc, slots, (tc[:, None] < Tc) & (slots[None, :] < K)


@step_kernel("tok0", "Tc", "first_request", "num_req", "nb_max")
def _pair_count_kernel(sel_ptr, s_sh, s_st, s_sk, pos_ptr, req_ptr, clean_ptr, within_ptr, count_ptr,
                       tok0, Tc, first_request, num_req, nb_max, B: tl.constexpr, K: tl.constexpr,
                       K_PAD: tl.constexpr, R: tl.constexpr):
    """Rows ``(h, t)`` of ``R`` tokens: each row's valid block ids once (ids outside ``[0, nb)`` and
    repeats dropped) into ``clean``, and each valid pair's index within its segment (a counter per
    segment)."""
    h = tl.program_id(1)
    tc, slots, in_row = _plan_rows(tl.program_id(0) * R, Tc, K, K_PAD, R)
    t = tok0 + tc
    ids = tl.load(sel_ptr + h * s_sh + t[:, None] * s_st + slots[None, :] * s_sk, mask=in_row, other=-1)
    pos = tl.load(pos_ptr + t, mask=tc < Tc, other=-1)
    nb = tl.where(pos >= 0, pos // B + 1, 0)
    earlier = (ids[:, :, None] == ids[:, None, :]) & (slots[None, None, :] < slots[None, :, None])
    repeat = tl.max(earlier.to(tl.int32), axis=2)
    # (ids < nb_max: a bound from host ints; a step whose lengths break it, which mm3 reports, counts
    # nothing outside the segments)
    ok = (ids >= 0) & (ids < nb[:, None]) & (ids < nb_max) & (repeat == 0) & in_row
    row = (h * Tc + tc[:, None]) * K + slots[None, :]
    tl.store(clean_ptr + row, tl.where(ok, ids, -1), mask=in_row)
    req = request_of(req_ptr + t, tc < Tc, first_request, num_req)
    seg = (h * num_req + req[:, None] - first_request) * nb_max + ids
    # relaxed: a unique index per pair is all that is needed (the next launch orders the rest); the
    # default acq_rel put a GPU-scope fence behind every atomic
    tl.store(within_ptr + row, tl.atomic_add(count_ptr + seg, 1, mask=ok, sem="relaxed"), mask=ok)


@step_kernel("tok0", "Tc", "first_request", "num_req", "nb_max")
def _pair_place_kernel(bt_ptr, s_bt_r, s_bt_b, num_pages, req_ptr, clean_ptr, within_ptr, count_ptr, tile_base_ptr,
                       pair_base_ptr, place_ptr, tile_seg_ptr, tile_page_ptr, tile_tok_ptr, tile_pairs_ptr,
                       tile_place_ptr, tok0, Tc, first_request, num_req, nb_max, K: tl.constexpr,
                       K_PAD: tl.constexpr, M: tl.constexpr, R: tl.constexpr, SLOTS: tl.constexpr = False):
    """Rows ``(h, t)`` of ``R`` tokens: each valid pair's place (segment's first place + its index
    within) and its token into its tile (segment's first tile + within // M); the pair that opens a
    tile also writes the tile's segment, the page of its block, its pair count and its first place.
    ``SLOTS`` (token slots: a block is no page): the tile's request instead of a page, whose block's
    slots the tile kernels gather (:mod:`.addressing`)."""
    h = tl.program_id(1)
    tc, slots, in_row = _plan_rows(tl.program_id(0) * R, Tc, K, K_PAD, R)
    row = (h * Tc + tc[:, None]) * K + slots[None, :]
    ids = tl.load(clean_ptr + row, mask=in_row, other=-1)
    ok = ids >= 0
    r = request_of(req_ptr + tok0 + tc, tc < Tc, first_request, num_req)[:, None] - first_request
    seg = (h * num_req + r) * nb_max + ids
    within = tl.load(within_ptr + row, mask=ok, other=0)
    place = tl.load(pair_base_ptr + seg, mask=ok, other=0) + within
    tile = tl.load(tile_base_ptr + seg, mask=ok, other=0) + within // M
    tl.store(place_ptr + row, tl.where(ok, place, -1), mask=in_row)
    tl.store(tile_tok_ptr + tile * M + within % M, tok0 + tc[:, None] + slots[None, :] * 0, mask=ok)
    opens = ok & (within % M == 0)
    tl.store(tile_seg_ptr + tile, seg, mask=opens)
    tl.store(tile_place_ptr + tile, place, mask=opens)
    tl.store(tile_pairs_ptr + tile, tl.minimum(tl.load(count_ptr + seg, mask=opens, other=0) - within, M), mask=opens)
    if SLOTS:
        tl.store(tile_page_ptr + tile, first_request + r, mask=opens)
    else:
        # clamped here, so the tile/run kernels' pages (read from the plan) are pages of the cache
        page = load_page(bt_ptr + (first_request + r) * s_bt_r + ids * s_bt_b, num_pages, mask=opens)
        tl.store(tile_page_ptr + tile, page, mask=opens)


@step_kernel("S")
def _segment_scan_kernel(count_ptr, tile_base_ptr, pair_base_ptr, num_tiles_ptr, S, M: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One program: each segment's first tile and first place (exclusive prefix sums of its tile and
    pair counts) and the tile total, ``BLOCK`` segments per step with the running sums carried."""
    offs = tl.arange(0, BLOCK)
    carry_p = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    carry_t = carry_p
    for s0 in range(0, S, BLOCK):
        m = s0 + offs < S
        c = tl.load(count_ptr + s0 + offs, mask=m, other=0)
        t = (c + (M - 1)) // M
        tl.store(pair_base_ptr + s0 + offs, carry_p + tl.cumsum(c, axis=0) - c, mask=m)
        tl.store(tile_base_ptr + s0 + offs, carry_t + tl.cumsum(t, axis=0) - t, mask=m)
        carry_p += tl.sum(c, axis=0)
        carry_t += tl.sum(t, axis=0)
    tl.store(num_tiles_ptr, carry_t)


#: segments up to which the prefix sums are one single-program kernel (at most 16 steps of
#: ``SCAN_BLOCK``); beyond, PyTorch's scans (device-wide, but about ten launches of host time)
SCAN_KERNEL_MAX = 65536
SCAN_BLOCK = 4096


def _segment_scans(count: torch.Tensor, tile_base: torch.Tensor, pair_base: torch.Tensor, num_tiles: torch.Tensor,
                   M: int, scan_kernel_max: int, fast: bool = False) -> None:
    S = count.numel()
    if S <= scan_kernel_max:
        launch(_segment_scan_kernel, (1,), (count, tile_base, pair_base, num_tiles, S),
               dict(M=M, BLOCK=min(SCAN_BLOCK, next_pow2(S))), _EIGHT_WARPS, fast)
        return
    tiles = (count + (M - 1)) // M
    torch.cumsum(tiles, dim=0, out=tile_base).sub_(tiles)
    torch.cumsum(count, dim=0, out=pair_base).sub_(count)
    num_tiles.copy_(tiles.sum(dtype=torch.int32).view(1))


def plan_pairs(sel_hm: torch.Tensor, batch: BatchMetadata, tok0: int, num_tokens: int, *, nb_max: int,
               tokens_per_tile: int, max_tiles: int, num_pages: int,
               scan_kernel_max: int = SCAN_KERNEL_MAX, fast: bool = False) -> PairPlan:
    """Group the pairs of prefill tokens ``tok0 .. tok0 + num_tokens - 1`` by (KV head, request, block).

    ``sel_hm``: the step's selection ``[H, T, K]`` (any strides); ``nb_max``:
    more than any valid block id (an id at or past it selects nothing); ``max_tiles``: an upper bound of the tile
    count (sizes the launch grid without a host sync); ``num_pages``: the
    cache's page count, into which every page id is clamped (``tile_page``
    only ever names a page of the cache). No sort: a segment's pairs take their
    places by an atomic counter, in any order (a row's result does not depend
    on which rows share its tile). Everything the tile kernel needs is laid
    out per tile, so a tile waits on one round trip before its query rows and K/V.
    Places follow the tiles (a prefix sum of the segments' pair counts), so a
    tile's partials are one block of the workspace, stored from one address.

    Four launches (a zero fill, the count, the prefix sums, the places) into
    one allocation: at M3 TP8 the step's GPU work is a few hundred
    microseconds, and eleven more small launches made it wait on the host.
    ``scan_kernel_max``: segments up to which the prefix sums are one kernel; ``fast``:
    launch through :mod:`.fast_launch` (``Algorithms.fast_launch``).
    """
    H, _, K = sel_hm.shape
    M, Tc, nd, R = tokens_per_tile, num_tokens, batch.num_decodes, batch.num_prefills
    S, rows_k = H * R * nb_max, H * Tc * K
    sizes = [S, S, S, 1, rows_k, rows_k, rows_k, max_tiles, max_tiles, max_tiles * M, max_tiles, max_tiles]
    # every array starts on a 16-byte boundary (4 int32): the kernels' alignment class then does not
    # change with the step's sizes, so a new step's launches stay in the fast launcher's call class
    padded = [-(-n // 4) * 4 for n in sizes]
    parts = torch.empty(sum(padded), device=sel_hm.device, dtype=torch.int32).split(padded)
    count, tile_base, pair_base, num_tiles, clean, within, place, tile_seg, tile_page, tile_tok, tile_pairs, \
        tile_place = (part[:n] for part, n in zip(parts, sizes))
    clean, within, place = (x.view(H, Tc, K) for x in (clean, within, place))
    count.zero_()
    rows = (triton.cdiv(Tc, PLAN_ROWS), H)
    # one warp per program: with four, a row's reductions crossed warps, and the barriers were 64%
    # of the count kernel's stalls (Nsight Compute, H200, TP1)
    launch(_pair_count_kernel, rows,
           (sel_hm, *sel_hm.stride(), batch.token_positions, batch.token_to_request, clean, within,
            count, tok0, Tc, nd, R, nb_max), dict(B=batch.block_size, K=K, K_PAD=next_pow2(K), R=PLAN_ROWS),
           _ONE_WARP, fast)
    _segment_scans(count, tile_base, pair_base, num_tiles, M, scan_kernel_max, fast)
    bt = batch.block_table
    launch(_pair_place_kernel, rows,
           (bt, *bt.stride(), num_pages, batch.token_to_request, clean, within, count, tile_base,
            pair_base, place, tile_seg, tile_page, tile_tok, tile_pairs, tile_place, tok0, Tc, nd, R, nb_max),
           dict(K=K, K_PAD=next_pow2(K), M=M, R=PLAN_ROWS, **({"SLOTS": True} if batch.slots is not None else {})),
           _ONE_WARP, fast)
    return PairPlan(clean, place, tile_seg, tile_page, tile_tok, tile_pairs, tile_place, num_tiles)
