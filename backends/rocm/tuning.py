"""The ``rocm`` plugin's launch configuration: 64-wide wavefronts, sized for an MI300.

Half the warps of the cuda plugin's config give the same threads per
program; one pipeline stage (AMD's stream pipeliner) keeps LDS use low; an
MI300's 304 CUs want about 608 programs (resized from the device at first
use). The kernel choices are the first ones the kernels had: the NVIDIA-tuned
ones (persistent decode attention, fp16 dots for fp8 caches, PDL,
block-grouped prefill attention, the prefill indexer's instruction cuts,
direct launches, the last-program top-k and merge) have not run on AMD
hardware.

Example:
    >>> dict(AMD_LAUNCH.launch_options)
    {'waves_per_eu': 2}
"""

from __future__ import annotations

from mm3_backends.triton.algorithms import Algorithms, Numerics
from mm3_backends.triton.kernel_configs import (DecodeAttentionConfig, DecodeIndexConfig, PrefillIndexConfig,
                                                TokenTileAttentionConfig)
from mm3_backends.triton.launch import LaunchConfig

__all__ = ["AMD_LAUNCH"]

AMD_LAUNCH = LaunchConfig(
    target_programs=608,
    decode_index=DecodeIndexConfig(min_blocks=4, max_blocks=128, warps=2, topk_warps=2, programs_factor=1,
                                   block_n=64, num_stages=1, stream_waves=4),
    prefill_index=PrefillIndexConfig(rows=64, warps=4, block_n=64, chunk=32, num_stages=1, max_splits=1,
                                     unmasked_full=False, sorted_merge=False, static_key_stride=False),
    decode_attention=DecodeAttentionConfig(warps=4, max_splits=16, stages=2, num_stages=1, programs_factor=8,
                                           flat_programs_per_sm=2, block_n=64),
    prefill_attention=None,
    prefill_tiles=TokenTileAttentionConfig(rows=64, warps=4, block_n=64, num_stages=1),
    algorithms=Algorithms(decode_attention_flat=False, pdl=False, fast_launch=False, merge_in_last_program=False,
                          topk_in_last_program=False, streamed_decode=False),
    numerics=Numerics(fp8_as_f16=False, nan_in_max=False, kv_fp8_as_f16=False),
    launch_options=(("waves_per_eu", 2),))
