"""The launch configuration of both plugins under Triton's CPU interpreter (tests only).

Few programs, because each is simulated in Python, but more than one split
so the flash-decoding merge runs in CI too; 16-key inner tiles so the tiny
test blocks still take several; the decode top-k and merge always in the last
program of their group (the GPU plugins take them by rules or not at all), so
CI runs them on every decode shape.
Every other value is the cuda plugin's, so the interpreter runs the kernel
variants the H200 runs.
"""

from __future__ import annotations

from .algorithms import Algorithms, Numerics
from .kernel_configs import DecodeAttentionConfig, DecodeIndexConfig, PrefillIndexConfig, TokenTileAttentionConfig
from .launch import LaunchConfig
from .prefill_config import PrefillAttentionConfig

__all__ = ["INTERPRETER_CONFIG"]

INTERPRETER_CONFIG = LaunchConfig(
    target_programs=8,
    decode_index=DecodeIndexConfig(min_blocks=1, max_blocks=128, warps=4, topk_warps=4, programs_factor=2,
                                   block_n=16, num_stages=2),
    prefill_index=PrefillIndexConfig(rows=32, warps=8, block_n=64, chunk=32, num_stages=2, max_splits=4,
                                     unmasked_full=True, sorted_merge=True, static_key_stride=True),
    decode_attention=DecodeAttentionConfig(warps=4, max_splits=16, stages=3, num_stages=2, programs_factor=8,
                                           flat_programs_per_sm=2, block_n=16),
    prefill_attention=PrefillAttentionConfig(rows=32, warps=4, programs_per_sm=2, stages=4, run_tiles=8,
                                             merge_warps=4, max_tokens_per_pass=16384),
    prefill_tiles=TokenTileAttentionConfig(rows=32, warps=8, block_n=64, num_stages=2),
    algorithms=Algorithms(decode_attention_flat=True, pdl=None, fast_launch=False, merge_in_last_program=True,
                          topk_in_last_program=True),
    numerics=Numerics(fp8_as_f16=True, nan_in_max=True, kv_fp8_as_f16=True))
