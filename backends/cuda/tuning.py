"""The ``cuda`` plugin's launch configuration: 32-wide warps, tuned on the H200 (docs/performance.md).

``target_programs`` is resized from the device's multiprocessor count at
first use (two programs per SM). The measurements behind each choice are in
docs/gpu-backends.md.

Example (what ``LaunchConfig``'s shape rules decide at these values on a 132-SM GPU):
    >>> cfg = NVIDIA_LAUNCH.for_device_sms(132)
    >>> cfg.decode_index_blocks_per_split(num_requests=64, table_width=512)
    64
    >>> cfg.decode_attention_splits(num_tokens=64, num_kv_heads=4, topk=16), cfg.decode_attention_splits(1, 4, 16)
    (1, 16)
    >>> cfg.prefill_index_splits(num_tiles=64, table_width=320), cfg.prefill_index_splits(128, 320)
    (4, 2)
    >>> cfg.prefill_index_splits(num_tiles=128, table_width=64), cfg.prefill_index_splits(256, 320)
    (1, 1)
    >>> cfg.use_merge_in_last_program(16), cfg.use_merge_in_last_program(4)   # TP1 b1, TP8 b64
    (False, True)
    >>> [cfg.use_topk_in_last_program(1, 4, capturing=c) for c in (True, False)]
    [False, True]
    >>> cfg.use_topk_in_last_program(64, 4, capturing=False)
    False
    >>> cfg.use_streamed_decode(num_requests=64, rows_per_request=1), cfg.use_streamed_decode(64, 4)   # TP8, TP1 b64
    (True, False)
"""

from __future__ import annotations

from mm3_backends.triton.algorithms import Algorithms, Numerics
from mm3_backends.triton.kernel_configs import (DecodeAttentionConfig, DecodeIndexConfig, PrefillIndexConfig,
                                                TokenTileAttentionConfig)
from mm3_backends.triton.launch import LaunchConfig
from mm3_backends.triton.prefill_config import PrefillAttentionConfig

__all__ = ["NVIDIA_LAUNCH"]

NVIDIA_LAUNCH = LaunchConfig(
    target_programs=264,
    # streamed decode in two waves of score programs (H200, TP8 b64 64K, fp8 index: 172.2 -> 167.8 us
    # against four, bf16 index 270.8 -> 271.2; eight: 179.4 / 272.1)
    decode_index=DecodeIndexConfig(min_blocks=1, max_blocks=128, warps=4, topk_warps=4, programs_factor=2,
                                   block_n=128, num_stages=2, stream_waves=2),
    # 128-row tiles of 8 warps, two programs per SM; 64-key inner tiles; top-K merged every 32
    # blocks; a tile's blocks split over up to 8 programs when the tiles do not fill the SMs (TP8
    # 32K: 490 -> 228 us); three instruction cuts (the causal mask only where a row sees part of a
    # tile, a sorted merge of each chunk, the key-row stride compiled in: Triton 3.6 sm_90 254 ->
    # 124 registers, no spills). H200, TP1 8K chunk at 32K: 884 us before the cuts, 732 with them
    # on 64-row tiles, 581 on 128-row tiles
    prefill_index=PrefillIndexConfig(rows=128, warps=8, block_n=64, chunk=32, num_stages=2, max_splits=8,
                                     unmasked_full=True, sorted_merge=True, static_key_stride=True),
    # 4 warps: two persistent programs per SM (H200: 80 vs 95 us at TP1 b64 64K); a whole
    # 128-key block per inner tile (1.03-1.08x over 64)
    decode_attention=DecodeAttentionConfig(warps=4, max_splits=16, stages=3, num_stages=2, programs_factor=8,
                                           flat_programs_per_sm=2, block_n=128),
    # block-grouped prefill attention (H200, TP1, 8K chunk: 1.03-1.36x over the token tiles): two
    # persistent 4-warp programs of 64-row tiles per SM (1.07-1.10x over one 8-warp program of
    # 128-row tiles at TP1), runs of 8 tiles per K/V load, a 4-stage tile loop
    prefill_attention=PrefillAttentionConfig(rows=64, warps=4, programs_per_sm=2, stages=4, run_tiles=8,
                                             merge_warps=4, max_tokens_per_pass=16384),
    prefill_tiles=TokenTileAttentionConfig(rows=128, warps=8, block_n=64, num_stages=2),
    algorithms=Algorithms(decode_attention_flat=True, pdl=None,
                          # compiled decode kernels launched directly (H200, TP8 b1 4K eager
                          # layer: 288 -> 179 us of host time; bit-exact, tests/gpu)
                          fast_launch=True,
                          # the decode merge / top-k in the last program of their group by launch.py's
                          # rules: the merge of <= 4 splits (H200, TP8 b64 graph step 278.0 -> 274.4 us),
                          # the top-k on eager small grids (one launch less where the host is the
                          # bound)
                          merge_in_last_program=None, topk_in_last_program=None,
                          # the attention overlapping the indexer on full grids (launch.py's rule)
                          streamed_decode=None),
    # kv_fp8_as_f16: bf16 queries on fp8 K/V dotted in fp16 in the decode kernels (H200, TP1 b64
    # 64K attention 80.8 -> 70.0 us); the prefill kernels widen to bf16 (the fp16 path measured
    # 0.92x there: 8K chunk at 32K, 3.601 -> 3.920 ms)
    numerics=Numerics(fp8_as_f16=True, nan_in_max=True, kv_fp8_as_f16=True))
