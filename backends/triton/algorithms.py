"""Which variant of each kernel runs, and the kernels' numerics: choices, not tile sizes.

Grouped by :class:`.launch.LaunchConfig` beside the per-kernel tile configs
(:mod:`.kernel_configs`); each platform plugin states all of them, since a
variant proven on one vendor's GPUs may not have run on the other's.

Example:
    >>> Numerics(fp8_as_f16=True, nan_in_max=True, kv_fp8_as_f16=True).kv_fp8_as_f16
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Algorithms", "Numerics"]


@dataclass(frozen=True)
class Algorithms:
    """Kernel variant switches (``None``: decided per step by a shape rule of ``LaunchConfig``)."""

    #: persistent decode attention: each program walks a run of (token, KV head, split) items as one
    #: pipelined loop; False = one program per (token, KV head, split)
    decode_attention_flat: bool
    #: programmatic dependent launch of the decode kernels (NVIDIA Hopper+): each launch overlaps
    #: the previous kernel's run; None = small grids only (``LaunchConfig.use_pdl``)
    pdl: Optional[bool]
    #: launch each kernel's compiled binary directly after the first launch of its call class,
    #: without Triton's per-call argument binding (:mod:`.fast_launch`; every launch of the plugin)
    fast_launch: bool
    #: (persistent decode attention) the last program of a (token, KV head) to finish merges its
    #: splits (:mod:`.arrivals`) instead of a merge launch; None = by the step
    #: (``LaunchConfig.use_merge_in_last_program``)
    merge_in_last_program: Optional[bool]
    #: the decode indexer's last score program of a request selects its top-k (:mod:`.arrivals`)
    #: instead of a top-k launch; None = by the step (``LaunchConfig.use_topk_in_last_program``)
    topk_in_last_program: Optional[bool]
    #: the decode attention overlaps the indexer: the score kernel walks its work request by request,
    #: its last program of a request selects the top-k and raises the request's ready flag, and the
    #: persistent attention, launched while the scores still stream (programmatic dependent launch),
    #: starts each item once its request's flag is up (:mod:`.arrivals`); None = by the step
    #: (``LaunchConfig.use_streamed_decode``)
    streamed_decode: Optional[bool]


@dataclass(frozen=True)
class Numerics:
    """How the indexers compute their scores and the attention kernels their dots."""

    #: bf16 index queries against an fp8 cache: dot in fp16 (queries scaled per row by a power of
    #: two) instead of bf16, because e4m3 -> fp16 is one native conversion
    fp8_as_f16: bool
    #: carry NaN scores through the block max (one row reduction instead of two)
    nan_in_max: bool
    #: bf16 queries against an fp8 K/V cache: both decode attention dots in fp16 (K and V widened
    #: e4m3 -> fp16 exactly, query rows scaled per row by a power of two whose inverse joins the
    #: score scale, P in fp16) instead of widening K/V to bf16. The prefill kernels always widen
    #: K/V to the queries' dtype
    kv_fp8_as_f16: bool
