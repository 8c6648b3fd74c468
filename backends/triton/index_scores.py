"""Triton block scores (docs/spec.md §3.6): the scores the fused indexers rank, written out.

``_index_scores_kernel`` grid ``(requests, token tiles, column chunks)``
    One program takes a tile of ``M`` consecutive tokens of one request for all
    index heads (rows ``(token, head)``, as the prefill indexer's tiles) and
    ``CH`` consecutive columns of the score tensor. It scores each block of its
    columns that a row of the tile sees with the indexers' own block maximum
    (:func:`.block_max._block_max_scores`: same dots, same NaN rule), sets the
    forced blocks (:func:`.indexer._forced`) and stores the ``[ROWS, CH]`` tile
    through the output's strides, ``-inf`` in every column a row does not see.
    Every element of the output is written once: columns past a request's
    blocks are ``-inf`` stores with no loads.

A step's decodes and prefills are two launches (a decode request has few
tokens: its tiles do not span the prefills' longest query). Grids come from
shapes and the batch's host ints only, so the launches capture in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mm3.plugin import BatchMetadata, PagedKVCache, SparseAttentionParams

from .fast_launch import launch
from .addressing import block_columns, slot_args
from .block_max import _block_max_scores, _block_page
from .indexer import _forced
from .launch import LaunchConfig, next_pow2
from .nvfp4 import index_block_scale_args
from .scratch import scratch
from .tiles import load_query_rows, token_rows
from .tl_utils import dot_config, launch_options, step_kernel

__all__ = ["index_scores", "COLUMNS"]

#: score columns (blocks) per program: vLLM's row alignment of the score tensor
COLUMNS = 16


@step_kernel("first_request", "N", "tok_lo", "tok_hi", "W")
def _index_scores_kernel(
    iq_ptr, s_iq_t, s_iq_h, s_iq_d, ik_ptr, s_ik_p, s_ik_b, s_ik_d, bt_ptr, s_bt_r, s_bt_b, num_pages, faults_ptr,
    qsl_ptr, pos_ptr, out_ptr, s_out_h, s_out_t, s_out_b, H, first_request, N, tok_lo, tok_hi, W, index_scale,
    is_ptr, s_is_p, s_is_b, s_is_d, st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
    B: tl.constexpr, BN: tl.constexpr, DI: tl.constexpr, ROWS: tl.constexpr, M: tl.constexpr,
    CH: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    SCALE_Q: tl.constexpr = False, NAN_IN_MAX: tl.constexpr = False, INDEX_NVFP4: tl.constexpr = False,
    SLOTS: tl.constexpr = False,
):
    """Scores of tokens ``program_id(1) * M ..`` of request ``first_request + program_id(0)``, columns
    ``program_id(2) * CH ..``: S after docs/spec.md §3.4 where a row sees the block, else ``-inf``.
    ``SLOTS``: token slots (:mod:`.addressing`; ``st_ptr`` .. ``sr_ptr`` as the indexer's). ``tok_lo``,
    ``tok_hi``, ``W``: the launch's tokens and the block table's columns (:func:`.tiles.token_rows`)."""
    r = first_request + tl.program_id(0)
    tok, hh, row_in, pos, row_ok, nb_row = token_rows(qsl_ptr, pos_ptr, r, tl.program_id(1) * M, H, tok_lo, tok_hi,
                                                      W, ROWS, M, B)
    if tl.max(row_in.to(tl.int32), axis=0) > 0:
        c0 = tl.program_id(2) * CH
        cols = c0 + tl.arange(0, CH)[None, :]
        chunk = tl.full([ROWS, CH], float("-inf"), tl.float32)
        hi = tl.minimum(tl.max(nb_row, axis=0), c0 + CH)
        if c0 < hi:
            q, row_scale = load_query_rows(iq_ptr, tok, hh, s_iq_t, s_iq_h, s_iq_d, row_ok, DI, DOT_DTYPE, SCALE_Q)
            for b in tl.range(c0, hi):
                page, slot_blk, cols_left = _block_page(bt_ptr, s_bt_r, s_bt_b, num_pages, faults_ptr, r, b, st_ptr,
                                                        s_st_r, s_st_c, st_rows, st_width, sr_ptr, B, SLOTS)
                sb = _block_max_scores(q, ik_ptr + page * s_ik_p, s_ik_b, s_ik_d, b, pos, row_scale * index_scale,
                                       ROWS, B, BN, DI, DOT_DTYPE, DOT_PREC, NAN_IN_MAX, 0, True,
                                       is_ptr + page * s_is_p, s_is_b, s_is_d, INDEX_NVFP4, slot_blk, s_st_c,
                                       cols_left, num_pages, s_ik_p, s_is_p, SLOTS)
                chunk = tl.where(cols == b, sb[:, None], chunk)
            chunk = _forced(chunk, cols, nb_row[:, None], INIT, LOCAL)
            chunk = tl.where(cols < nb_row[:, None], chunk, float("-inf"))
        tl.store(out_ptr + hh[:, None] * s_out_h + tok[:, None] * s_out_t + cols * s_out_b, chunk,
                 mask=row_in[:, None] & (cols < N))


def index_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata, params: SparseAttentionParams,
                 out: torch.Tensor, cfg: LaunchConfig, page_faults: Optional[torch.Tensor] = None) -> None:
    """Write the step's block scores into ``out`` (float32 ``[H, T, N]``, any strides), every element.

    ``page_faults``: the word the kernels lower for a bad block-table entry
    (:func:`.tl_utils.load_reported_page`); ``None``: a scratch word nobody reads.
    Inputs are assumed admitted by mm3's boundary.
    """
    H, B, Di = params.num_index_heads, params.block_size, params.index_head_dim
    ik, bt = caches.index, batch.block_table
    N = out.shape[2]
    faults = page_faults if page_faults is not None else scratch(ik.device, "page-faults", (1,), torch.int64)
    dot_dtype, dot_prec, scale_q = dot_config(index_q.dtype, ik.dtype, cfg.numerics.fp8_as_f16)
    iscale, index_nvfp4 = index_block_scale_args(caches, ik)
    slots, on_slots = slot_args(batch, bt)
    pic = cfg.prefill_index
    rows = max(pic.rows, next_pow2(H), 16)
    m = rows // H
    nd, npf = batch.num_decodes, batch.num_prefills
    fast = cfg.algorithms.fast_launch
    # (first request, requests, their longest query, key tile, tokens) of the decodes, then of the prefills:
    # each with the key tile of the indexer kernel that ranks the same scores
    td, width = batch.num_decode_tokens, block_columns(batch)
    for first, count, longest, bn, lo, hi in ((0, nd, batch.decode_query_len, cfg.decode_index.block_n, 0, td),
                                              (nd, npf, batch.max_prefill_query_len, pic.block_n, td,
                                               batch.num_tokens)):
        if count == 0 or longest == 0:
            continue
        launch(_index_scores_kernel, (count, triton.cdiv(longest, m), triton.cdiv(N, COLUMNS)),
               (index_q, *index_q.stride(), ik, *ik.stride(), bt, *bt.stride(), caches.num_pages, faults,
                batch.query_start_loc, batch.token_positions, out, *out.stride(), H, first, N, lo, hi, width,
                float(params.index_scale), *iscale, *slots),
               dict(B=B, BN=min(B, bn), DI=Di, ROWS=rows, M=m, CH=COLUMNS, INIT=params.init_blocks,
                    LOCAL=params.local_blocks, DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, SCALE_Q=scale_q,
                    NAN_IN_MAX=cfg.numerics.nan_in_max, **({"INDEX_NVFP4": True} if index_nvfp4 else {}),
                    **({"SLOTS": True} if on_slots else {})),
               dict(num_warps=pic.warps, num_stages=pic.num_stages, **launch_options(cfg)), fast)
