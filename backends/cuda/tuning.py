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
    # 128-row tiles of 8 warps, two programs per SM; 64-key inner tiles; top-K merged every 32
    # blocks; a tile's blocks split over up to 8 programs when the tiles do not fill the SMs (TP8
    # 32K: 490 -> 228 us); three instruction cuts (the causal mask only where a row sees part of a
    # tile, a sorted merge of each chunk, the key-row stride compiled in: Triton 3.6 sm_90 254 ->
    # 124 registers, no spills). H200, TP1 8K chunk at 32K: 884 us before the cuts, 732 with them
    # on 64-row tiles (variant pi64f), 581 on 128-row tiles (benchmarks/NOTES.md §5)
    prefill_index=PrefillIndexConfig(rows=128, warps=8, block_n=64, chunk=32, num_stages=2, max_splits=8,
                                     unmasked_full=True, sorted_merge=True, static_key_stride=True),
    # 4 warps: two persistent programs per SM (H200: 80 vs 95 us at TP1 b64 64K); a whole
    # 128-key block per inner tile (1.03-1.08x over 64)
    decode_attention=DecodeAttentionConfig(warps=4, max_splits=16, stages=3, num_stages=2, programs_factor=8,
                                           flat_programs_per_sm=2, block_n=128),
    # fp8 K/V: the kernels of 16-bit K/V, with fp16 dots (an fp8 kernel of its own measured 65.4
    # against 70.0 us at TP1 b64 64K but faulted at batch 1 and TP8; removed, NOTES.md §6)
    decode_attention_fp8=None,
    # block-grouped prefill attention (H200, TP1, 8K chunk: 1.03-1.36x over the token tiles)
    prefill_attention=PrefillAttentionConfig(),
    prefill_tiles=TokenTileAttentionConfig(rows=128, warps=8, block_n=64, num_stages=2),
    algorithms=Algorithms(decode_attention_flat=True, decode_attention_branchless=True, merge_per_row=None,
                          topk_sort=True, index_keys_as_a=False, prefill_attention_union=False, pdl=None,
                          # compiled decode kernels launched directly (H200, TP8 b1 4K eager
                          # layer: 288 -> 179 us of host time; bit-exact, tests/gpu)
                          fast_launch=True,
                          # the decode merge / top-k in the last program of their group by launch.py's
                          # rules: the merge of <= 4 splits (H200, TP8 b64 graph step 278.0 -> 274.4 us),
                          # the top-k on eager small grids (one launch less where the host is the
                          # bound); benchmarks/NOTES.md §9-10
                          merge_in_last_program=None, topk_in_last_program=None),
    # kv_fp8_as_f16: bf16 queries on fp8 K/V dotted in fp16 in the decode kernels (H200, TP1 b64
    # 64K attention 80.8 -> 70.0 us); the prefill kernels widen to bf16 (the fp16 path measured
    # 0.92x there: 8K chunk at 32K, 3.601 -> 3.920 ms)
    numerics=Numerics(fp8_as_f16=True, nan_in_max=True, kv_fp8_as_f16=True, kv_fp8_as_f16_prefill=False))
