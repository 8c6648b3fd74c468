"""The decode launches of a shape class, derived once: grids, splits, constexprs and launch options.

A decode step's launch parameters depend on shapes, dtypes and the plugin's
:class:`LaunchConfig` only (never on lengths or positions: that is what lets
the decode path be captured in a CUDA graph), so they are the same every step
of a shape class. :func:`decode_attention_plan` and :func:`decode_index_plan`
derive them on the first step of a class and return the same plan after;
a launcher adds the step's tensors and strides.

Plans are keyed by the config object's identity (each plugin sizes its config
once per device, ``TritonPlatform.launch_config``) and held with it, so a key
cannot outlive its config (tests/test_launch_invariants.py shows a plan
derived once per shape class).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

import torch

from .contents import TILE as JUDGE_TILE, judge_block
from .launch import LaunchConfig, next_pow2
from .tl_utils import decode_launch_options, dot_config, pdl_available, pdl_enabled

__all__ = ["DecodeAttentionPlan", "DecodeIndexPlan", "decode_attention_plan", "decode_index_plan", "MAX_PLANS"]

#: plans kept before the memory starts over (a handful of decode shape classes per model)
MAX_PLANS = 1024

#: packed top-k keys (int64) the score kernel's last program sorts at once: 4 rows of a 64K context
#: (512 blocks), 16 per thread of its 4 warps
TOPK_LAST_KEYS = 2048

_PLANS: dict[Any, tuple[LaunchConfig, Any]] = {}
_LOCK = threading.Lock()


def _cached(cfg: LaunchConfig, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    full = (id(cfg), *key)
    hit = _PLANS.get(full)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    plan = make()
    with _LOCK:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[full] = (cfg, plan)
    return plan


class DecodeAttentionPlan(NamedTuple):
    """The decode attention's launches for one shape class (the launcher picks the kernels by these flags)."""

    #: the persistent kernel (``Algorithms.decode_attention_flat``), else the grid kernel
    flat: bool
    grid: tuple[int, ...]
    flat_ints: tuple[int, ...]     # (items, items per program) of the flat kernel, else ()
    splits: int
    g_pad: int
    constexprs: dict[str, Any]
    options: dict[str, Any]
    #: a merge launch follows (several splits); per (token, query head) when ``merge_per_row``,
    #: else per (token, KV head)
    merge: bool
    merge_per_row: bool
    merge_grid: tuple[int, ...]
    merge_constexprs: dict[str, Any]
    merge_options: dict[str, Any]
    #: the persistent kernel merges the splits in its last program (``Algorithms.merge_in_last_program``)
    merge_last: bool
    #: ``constexprs`` for a launch whose merge is the separate kernel (no arrival counters to hand)
    constexprs_merge_launched: dict[str, Any]
    #: the two above, for a launch that overlaps a streamed indexer (``Algorithms.streamed_decode``),
    #: and its launch options (launched as a programmatic dependent, where the GPU has it)
    stream_constexprs: dict[str, Any]
    stream_constexprs_merge_launched: dict[str, Any]
    stream_options: dict[str, Any]


def decode_attention_plan(cfg: LaunchConfig, td: int, Hkv: int, G: int, K: int, B: int, D: int,
                          q_dtype: torch.dtype, kv_dtype: torch.dtype, kv_scaled: bool,
                          slot_scaled: bool = False, slots: bool = False) -> DecodeAttentionPlan:
    """The launches of ``td`` decode tokens' attention (see :func:`.attention.attention_forward`);
    shapes only, so an eager step and its CUDA-graph replay launch the same kernels.
    ``kv_scaled`` / ``slot_scaled``: fp8 K/V scaled per KV head / per KV head and token slot;
    ``slots``: keys found through token slots (.addressing)."""
    def make() -> DecodeAttentionPlan:
        dot_dtype, dot_prec, scale_q = dot_config(q_dtype, kv_dtype, cfg.numerics.kv_fp8_as_f16)
        pdl = pdl_enabled(cfg, td, Hkv)
        dopts = decode_launch_options(cfg, pdl)
        splits = cfg.decode_attention_splits(td, Hkv, K)
        kps = -(-K // splits)
        splits = -(-K // kps)
        g_pad = max(16, next_pow2(G))
        dac = cfg.decode_attention
        const = dict(G_PAD=g_pad, SPLITS=splits, KPS=kps, STAGES=dac.stages, PDL=pdl, B=B,
                     BN=min(B, dac.block_n), D=D, K=K, K_PAD=next_pow2(K), DOT_DTYPE=dot_dtype,
                     DOT_PREC=dot_prec, KV_SCALED=kv_scaled, SCALE_Q=scale_q)
        if slot_scaled:
            const["SLOT_SCALED"] = True
        if kv_dtype == torch.uint8:   # NVFP4 K/V (.nvfp4); every other format compiles as without it
            const["KV_NVFP4"] = True
        if slots:     # a plan's dicts are kept: the fast launcher knows them by identity
            const["SLOTS"] = True
        opts = dict(num_warps=dac.warps, num_stages=dac.num_stages, **dopts)
        flat = cfg.algorithms.decode_attention_flat
        if flat:
            items = td * Hkv * splits
            ipp = cfg.decode_attention_flat_items_per_program(items)
            grid, flat_ints = (-(-items // ipp),), (items, ipp)
            const["S_PAD"] = next_pow2(splits)
            const["MERGE_LAST"] = False
        else:
            grid, flat_ints = (td, Hkv, splits), ()
        merge_last = splits > 1 and flat and cfg.use_merge_in_last_program(splits)
        launched = const
        if merge_last:
            const = dict(const, MERGE_LAST=True)
        # with the merge planned in the last program, its fallback (a capture short of counters)
        # is the per-KV-head kernel: the same code, so the same bits as an eager step's
        per_row = splits > 1 and cfg.use_merge_per_row(td, Hkv) and not merge_last
        mgrid, mconst, mopts = (), {}, {}
        if splits > 1:
            mconst = dict(D=D, G_PAD=g_pad, SPLITS=splits, S_PAD=next_pow2(splits), PDL=pdl)
            if per_row:
                mgrid, mopts = (td, Hkv, G), dict(num_warps=4, **dopts)
            else:
                mgrid, mopts = (td, Hkv), dict(num_warps=dac.warps, **dopts)
        streamed = dict(STREAM=True, TRIGGER=pdl_available())
        sopts = dict(opts, launch_pdl=True) if streamed["TRIGGER"] else opts
        return DecodeAttentionPlan(flat, grid, flat_ints, splits, g_pad, const, opts, splits > 1, per_row, mgrid,
                                   mconst, mopts, merge_last, launched, dict(const, **streamed),
                                   dict(launched, **streamed), sopts)

    return _cached(cfg, ("attention", td, Hkv, G, K, B, D, q_dtype, kv_dtype, kv_scaled, slot_scaled, slots), make)


class DecodeIndexPlan(NamedTuple):
    """The decode indexer's two launches (scores, then top-k) for one shape class."""

    score_grid: tuple[int, ...]
    score_constexprs: dict[str, Any]
    score_options: dict[str, Any]
    topk_grid: tuple[int, ...]
    topk_constexprs: dict[str, Any]
    topk_options: dict[str, Any]
    rows: int                        # query rows per request: decode_query_len x index heads
    #: the score kernel's last program per request selects its top-k (``Algorithms.topk_in_last_program``;
    #: always when streamed)
    topk_last: bool
    #: ``score_constexprs`` for a launch followed by the top-k kernel (no arrival counters to hand)
    score_constexprs_topk_launched: dict[str, Any]
    #: the attention overlaps this indexer (``Algorithms.streamed_decode``): score programs launched
    #: request by request, a ready flag raised per request
    streamed: bool
    #: the score launch's constexprs when it judges the batch's contents too (:mod:`.contents`), by
    #: (top-k in the last program, the batch has its own context lengths)
    score_constexprs_judged: dict[tuple[bool, bool], dict[str, Any]]


def decode_index_plan(cfg: LaunchConfig, nd: int, Q: int, H: int, Hkv: int, num_decode_tokens: int, width: int,
                      K: int, B: int, Di: int, init: int, local: int, q_dtype: torch.dtype,
                      index_dtype: torch.dtype, sort_width: Callable[[int], int], streamed: bool = False,
                      capturing: bool = False, slots: bool = False) -> DecodeIndexPlan:
    """The launches of ``nd`` decode requests' indexer (see :func:`.indexer.index_topk`);
    ``streamed``: for an attention that overlaps it; ``capturing``: for a CUDA graph being captured;
    ``slots``: index keys found through token slots (.addressing)."""
    def make() -> DecodeIndexPlan:
        dot_dtype, dot_prec, scale_q = dot_config(q_dtype, index_dtype, cfg.numerics.fp8_as_f16)
        common = dict(B=B, DI=Di, DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec,
                      SCALE_Q=scale_q, NAN_IN_MAX=cfg.numerics.nan_in_max)
        if index_dtype == torch.uint8:   # NVFP4 index keys (.nvfp4)
            common["INDEX_NVFP4"] = True
        if slots:
            common["SLOTS"] = True
        rows = Q * H
        dic = cfg.decode_index
        bps = cfg.decode_index_blocks_per_split(nd, width, streamed)
        splits = -(-width // bps)
        pdl = pdl_enabled(cfg, num_decode_tokens, Hkv)
        dopts = decode_launch_options(cfg, pdl)
        k_pad = sort_width(K)
        nb_pad = max(next_pow2(width), k_pad)
        score = dict(ROWS=max(16, next_pow2(rows)), Q=Q, BPS=bps, BN=min(B, dic.block_n), PDL=pdl, **common)
        topk_last = streamed or cfg.use_topk_in_last_program(num_decode_tokens, Hkv, capturing)
        # rows selected together by the last program: at most TOPK_LAST_KEYS packed keys held at once
        r_tk = max(1, min(next_pow2(rows), TOPK_LAST_KEYS // nb_pad))
        score.update(TOPK_LAST=False, K=K, K_PAD=k_pad, NB_PAD=nb_pad, INIT=init, LOCAL=local, R_TK=r_tk,
                     TK_ROWS=rows)
        fused = dict(score, TOPK_LAST=True) if topk_last else score
        if streamed:
            fused.update(STREAM=True, TRIGGER=pdl_available())
        judge = dict(JUDGE=True, J_B=judge_block(B, slots), J_TILE=JUDGE_TILE)
        return DecodeIndexPlan(
            (splits, nd) if streamed else (nd, splits), fused,
            dict(num_warps=dic.warps, num_stages=dic.num_stages, **dopts),
            (nd, rows),
            dict(B=B, K=K, K_PAD=k_pad, NB_PAD=nb_pad, INIT=init, LOCAL=local, PDL=pdl),
            dict(num_warps=dic.topk_warps, **dopts),
            rows, topk_last, score, streamed,
            {(last, ctx): dict(fused if last else score, **judge, J_CTX=ctx) for last in (True, False)
             for ctx in (True, False)})

    return _cached(cfg, ("index", nd, Q, H, Hkv, num_decode_tokens, width, K, B, Di, init, local, q_dtype,
                         index_dtype, streamed, capturing, slots), make)
