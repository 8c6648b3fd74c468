"""Launch-configuration variants of the ``cuda`` plugin, timed side by side with the default.

A variant is the ``cuda`` plugin's hooks rebuilt (``make_hookimpls``) with some
:class:`LaunchConfig` fields overridden (``override``: a dict per config group),
so one run measures the current kernels and candidate changes on the same inputs, each checked against the
reference first. ``mm3 bench --variants att3,sort`` (or ``ALL``).

This module imports a backend on purpose: it is benchmark code, never loaded by
the core.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mm3_backends.cuda.tuning import NVIDIA_LAUNCH
from mm3_backends.triton.prefill_config import PrefillAttentionConfig

__all__ = ["VARIANTS", "VariantBackend", "make_variants"]

#: the session-1 values of the fields added in session 2, so v0-v2 keep meaning what they timed
_SESSION1 = dict(decode_attention=dict(warps=8, stages=2, block_n=64), prefill_attention=None,
                 numerics=dict(fp8_as_f16=False, nan_in_max=False))
_SESSION1_ALGO = dict(decode_attention_flat=False, pdl=False, merge_in_last_program=False, topk_in_last_program=False)
#: the chunked prefill indexer without its session-6 instruction cuts (earlier variants keep it)
_PI_PLAIN = dict(unmasked_full=False, sorted_merge=False, static_key_stride=False, rows=64, warps=4)
#: the indexer and token-tile sizes of version 1 (NOTES.md)
_V1_SIZES = dict(decode_index=dict(block_n=64, programs_factor=1, min_blocks=4),
                 prefill_index=dict(_PI_PLAIN, block_n=64), prefill_tiles=dict(rows=64))

#: name -> (``override`` arguments of the LaunchConfig, step kinds it changes)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    # the kernels as they were before the tuning of issue 4 (the "before" of every ratio)
    "v0": (dict(_SESSION1, decode_attention=dict(_SESSION1["decode_attention"], programs_factor=1),
                algorithms=dict(_SESSION1_ALGO, decode_attention_branchless=False, topk_sort=False,
                                merge_per_row=False),
                decode_index=dict(_V1_SIZES["decode_index"]), prefill_index=dict(rows=64, block_n=64, chunk=0),
                prefill_tiles=dict(rows=64)), ("decode", "prefill")),
    # the defaults after the first sweep (NOTES.md, version 1)
    "v1": (dict(_SESSION1, **_V1_SIZES, algorithms=dict(_SESSION1_ALGO, merge_per_row=False)),
           ("decode", "prefill")),
    # the defaults session 1 ended with (version 2)
    "v2": (dict(_SESSION1, algorithms=_SESSION1_ALGO, prefill_index=dict(_PI_PLAIN, block_n=128)),
           ("decode", "prefill")),
    # candidates
    "mrow": (dict(algorithms=dict(merge_per_row=True)), ("decode",)),
    "nomrow": (dict(algorithms=dict(merge_per_row=False)), ("decode",)),
    "idxf4": (dict(decode_index=dict(programs_factor=4)), ("decode",)),
    "att4w": (dict(decode_attention=dict(warps=4)), ("decode",)),
    "keysA": (dict(algorithms=dict(index_keys_as_a=True)), ("decode",)),
    "union": (dict(algorithms=dict(prefill_attention_union=True)), ("prefill",)),
    "arow64": (dict(prefill_tiles=dict(rows=64)), ("prefill",)),
    "arow16u": (dict(prefill_tiles=dict(rows=16), algorithms=dict(prefill_attention_union=True)), ("prefill",)),
    # session 2, sweep 4: around the persistent decode attention (defaults since sweep 3)
    "fs2": (dict(decode_attention=dict(stages=2)), ("decode",)),
    "fs4": (dict(decode_attention=dict(stages=4)), ("decode",)),
    "fbn64": (dict(decode_attention=dict(block_n=64)), ("decode",)),
    "fbn32": (dict(decode_attention=dict(block_n=32)), ("decode",)),
    "fps3": (dict(decode_attention=dict(flat_programs_per_sm=3)), ("decode",)),
    "pdl": (dict(algorithms=dict(pdl=True)), ("decode",)),
    "nopdl": (dict(algorithms=dict(pdl=False)), ("decode",)),
    # session 2, last run: the fp8 decode indexer (84% of copy)
    "iw8": (dict(decode_index=dict(warps=8)), ("decode",)),
    "ibn64": (dict(decode_index=dict(block_n=64)), ("decode",)),
    "if1": (dict(decode_index=dict(programs_factor=1)), ("decode",)),
    # prefill
    "pabn32": (dict(prefill_tiles=dict(block_n=32)), ("prefill",)),
    "pch64": (dict(prefill_index=dict(chunk=64)), ("prefill",)),
    # issue 13: the token-tile prefill attention (the rocm plugin's path) beside the block-grouped
    # kernel; the latter with 128-key steps (0.97-0.98x on the H200, NOTES.md)
    "tiles": (dict(prefill_attention=None), ("prefill",)),
    "pbn128": (dict(prefill_attention=PrefillAttentionConfig(rows=128, warps=8, programs_per_sm=1, stages=2,
                                                              run_tiles=0, block_n=128)), ("prefill",)),
    "prow256": (dict(prefill_index=dict(rows=256, block_n=32)), ("prefill",)),
    # issue 13, session 4: the default before runs of tiles (one 8-warp program per SM, one
    # 128-row tile per loop step, K/V per tile); runs of 16 tiles
    "grp3": (dict(prefill_attention=PrefillAttentionConfig(rows=128, warps=8, programs_per_sm=1, stages=2,
                                                            run_tiles=0)), ("prefill",)),
    "run16": (dict(prefill_attention=PrefillAttentionConfig(run_tiles=16)), ("prefill",)),
    # session 5: the prefill indexer without context splits (pis1); the session-4 indexer
    # (128-row tiles of 8 warps, no splits)
    "pis1": (dict(prefill_index=dict(_PI_PLAIN, max_splits=1)), ("prefill",)),
    "pi128": (dict(prefill_index=dict(_PI_PLAIN, rows=128, warps=8, max_splits=1)), ("prefill",)),
    # issue 16: every kernel launched through Triton's own launcher (the GPU time must not change)
    "slowlaunch": (dict(algorithms=dict(fast_launch=False)), ("decode", "prefill")),
    # issue 17 (NOTES.md §6): fp8 K/V. The old path (K/V widened to bf16); the fp16 dots with
    # 8-warp tiles one per SM (the first default, 0.68x) and with 4-warp 64-key tiles (0.94x).
    # None touches bf16 K/V, so the bf16 rows show the run's noise.
    "kvbf16": (dict(numerics=dict(kv_fp8_as_f16=False), decode_attention_fp8=None), ("decode",)),
    # the prefill kernels on fp8 K/V with the fp16 dots (0.92x of the bf16 widening at 32K)
    "kvf16p": (dict(numerics=dict(kv_fp8_as_f16_prefill=True)), ("prefill",)),
    "kv8w8": (dict(decode_attention_fp8=replace(NVIDIA_LAUNCH.decode_attention, warps=8, flat_programs_per_sm=1)),
              ("decode",)),
    "kv8bn64": (dict(decode_attention_fp8=replace(NVIDIA_LAUNCH.decode_attention, block_n=64, stages=2)),
                ("decode",)),
    # issue 13, session 6 (NOTES.md §5): the chunked prefill indexer's instruction cuts. The default
    # has all three on 128-row tiles of 8 warps; pi13s5 is the session-5 default (64 rows, none),
    # pimask / pisort / pistride add one each to it, pi64f is the default's cuts on 64-row tiles
    "pi13s5": (dict(prefill_index=_PI_PLAIN), ("prefill",)),
    "pimask": (dict(prefill_index=dict(_PI_PLAIN, unmasked_full=True)), ("prefill",)),
    "pisort": (dict(prefill_index=dict(_PI_PLAIN, sorted_merge=True)), ("prefill",)),
    "pistride": (dict(prefill_index=dict(_PI_PLAIN, static_key_stride=True)), ("prefill",)),
    "pi64f": (dict(prefill_index=dict(rows=64, warps=4)), ("prefill",)),
    # session 2026-12-03 (4): TP8 b64 decode attention (28 us, 56% of copy) with 1 and 4 persistent
    # programs per SM (2 and 8 splits at TP8; fps3 above gives 6): 0.91x and 0.84x, fps3 0.83x
    "fps1": (dict(decode_attention=dict(flat_programs_per_sm=1)), ("decode",)),
    "fps4": (dict(decode_attention=dict(flat_programs_per_sm=4)), ("decode",)),
    # the run kernel (spill-free since session 3) on 128-row tiles of 8 warps (Triton 3.6 sm_90:
    # 236-254 registers, no spill, 165 KB of shared memory: one program per SM); runs of 4 tiles.
    # (A 2-stage tile loop spilled 24-48 B: not timed.)
    "run128": (dict(prefill_attention=PrefillAttentionConfig(rows=128, warps=8, programs_per_sm=1)), ("prefill",)),
    "run4": (dict(prefill_attention=PrefillAttentionConfig(run_tiles=4)), ("prefill",)),
    # session 2026-12-03 (5): the decode top-k and merge in the last program of their group
    # (backends/triton/arrivals.py), beside the default (launch.py's rules: the top-k on eager small
    # grids, merges of <= 4 splits): both launched, both always fused, or one of them always (NOTES §9)
    "sep": (dict(algorithms=dict(merge_in_last_program=False, topk_in_last_program=False)), ("decode",)),
    "lastall": (dict(algorithms=dict(merge_in_last_program=True, topk_in_last_program=True)), ("decode",)),
    "lasttopk": (dict(algorithms=dict(topk_in_last_program=True)), ("decode",)),
    "lastmerge": (dict(algorithms=dict(merge_in_last_program=True)), ("decode",)),
}


class VariantBackend:
    """Quacks like :class:`mm3.runtime.backend.Backend` for the harness: name, alloc, index_topk, attention_forward."""

    def __init__(self, name: str, overrides: dict[str, Any], kinds: tuple[str, ...]) -> None:
        from mm3_backends.cuda.plugin import PLATFORM
        from mm3_backends.triton.launch import override
        from mm3_backends.triton.plugin_factory import make_hookimpls

        self.name = f"cuda[{name}]"
        self.kinds = kinds
        self.overrides = overrides
        self._hooks = make_hookimpls(replace(PLATFORM, launch=override(PLATFORM.launch, **overrides)))
        self.index_topk = self._hooks.index_topk
        self.attention_forward = self._hooks.attention_forward

    def alloc_topk_buffer(self, num_tokens: int, num_heads: int, topk: int, device: Any):  # noqa: ANN201
        return self._hooks.alloc_topk_buffer(num_tokens=num_tokens, num_heads=num_heads, topk=topk,
                                             device=torch.device(device))


def make_variants(spec: str) -> list[VariantBackend]:
    """``"a,b"`` or ``"ALL"`` -> variant backends (unknown names raise ``KeyError`` listing the known)."""
    names = list(VARIANTS) if spec.strip().upper() == "ALL" else [n.strip() for n in spec.split(",") if n.strip()]
    out = []
    for n in names:
        if n not in VARIANTS:
            raise KeyError(f"unknown variant {n!r}; known: {', '.join(VARIANTS)}")
        ov, kinds = VARIANTS[n]
        out.append(VariantBackend(n, ov, kinds))
    return out
