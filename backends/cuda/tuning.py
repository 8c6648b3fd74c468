"""The ``cuda`` plugin's launch configuration: 32-wide warps, tuned on the H200 (BENCHMARKS.md, NOTES.md).

``target_programs`` is resized from the device's multiprocessor count at
first use (two programs per SM). The measurements behind each choice are in
docs/gpu-backends.md.

Example:
    >>> NVIDIA_LAUNCH.algorithms.decode_attention_flat
    True
"""

from __future__ import annotations

from mm3_backends.triton.algorithms import Algorithms, Numerics
from mm3_backends.triton.kernel_configs import (DecodeAttentionConfig, DecodeIndexConfig, PrefillIndexConfig,
                                                TokenTileAttentionConfig)
from mm3_backends.triton.launch import LaunchConfig
from mm3_backends.triton.prefill_config import PrefillAttentionConfig

__all__ = ["NVIDIA_LAUNCH"]

NVIDIA_LAUNCH = LaunchConfig(
    target_programs=264, warp_size=32,
    decode_index=DecodeIndexConfig(min_blocks=1, max_blocks=128, warps=4, topk_warps=4, programs_factor=2,
                                   block_n=128, num_stages=2),
    # 128-row tiles hold many rows, so 64-key inner tiles; top-K merged every 32 blocks
    prefill_index=PrefillIndexConfig(rows=128, warps=8, block_n=64, chunk=32, num_stages=2, max_splits=8),
    # 4 warps: two persistent programs per SM (H200: 80 vs 95 us at TP1 b64 64K); a whole
    # 128-key block per inner tile (1.03-1.08x over 64)
    decode_attention=DecodeAttentionConfig(warps=4, max_splits=16, stages=3, num_stages=2, programs_factor=8,
                                           flat_programs_per_sm=2, block_n=128),
    # fp8 K/V (bf16 queries, fp16 dots): the 4-warp tiles above compile to 255 registers and 176 B of
    # spills on sm_90 (aot_check); 8 warps take 190 and no spill, so one program fills an SM's
    # registers: one per SM. Chosen before measurement (issue 17; benchmarks/NOTES.md, variants kv*)
    decode_attention_fp8=DecodeAttentionConfig(warps=8, max_splits=16, stages=3, num_stages=2, programs_factor=8,
                                               flat_programs_per_sm=1, block_n=128),
    # block-grouped prefill attention (H200, TP1, 8K chunk: 1.03-1.36x over the token tiles)
    prefill_attention=PrefillAttentionConfig(),
    prefill_tiles=TokenTileAttentionConfig(rows=128, warps=8, block_n=64, num_stages=2),
    algorithms=Algorithms(decode_attention_flat=True, decode_attention_branchless=True, merge_per_row=None,
                          topk_sort=True, index_keys_as_a=False, prefill_attention_union=False, pdl=None,
                          fast_launch=False),
    # kv_fp8_as_f16: as the fp8 indexer's fp16 dots (220 -> 149 us), not yet measured for the attention
    numerics=Numerics(fp8_as_f16=True, nan_in_max=True, kv_fp8_as_f16=True))
