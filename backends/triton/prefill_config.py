"""Launch configuration of the block-grouped prefill attention (:mod:`.prefill_attention`).

Plain Python (no Triton import), like :mod:`.launch`, so a plugin can build
its configuration without importing the kernels.

Example:
    >>> cfg = PrefillAttentionConfig(rows=64, warps=4)
    >>> cfg.rows // 16          # tokens per tile at GQA group 16
    4
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefillAttentionConfig"]


@dataclass(frozen=True)
class PrefillAttentionConfig:
    """Tile shape of the block-grouped prefill attention (defaults: NVIDIA Hopper).

    A tile is one selected block of one KV head against the query rows of up
    to ``rows // G`` tokens that selected it (``G`` query heads each; rows
    are raised to the next power of two >= G when G is larger).
    """

    #: query rows of one tile (tokens x the G query heads of a KV head); a power of two >= G
    rows: int = 128
    #: keys per inner step of a tile (a divisor of the block size, >= 16): bounds registers
    #: (H200: 1.02-1.03x over 128)
    block_n: int = 64
    warps: int = 8
    #: persistent programs per multiprocessor, each walking its tiles as one software-pipelined
    #: loop of ``stages`` stages: the next tile's loads overlap this one's math (H200: 1.10-1.15x
    #: over one program per tile at TP1)
    programs_per_sm: int = 1
    stages: int = 2
    #: 0 = one tile per loop step; n = runs of up to n tiles of one segment: the block's K/V loaded
    #: once per run, the run's tiles one pipelined loop of ``stages`` stages
    run_tiles: int = 0
    #: warps of the merge (one program per token and KV head)
    merge_warps: int = 4
    #: prefill tokens planned and merged per pass: bounds the partial-output workspace
    #: (pairs x G x D elements: 2.1 GB of bf16 for 8K tokens at M3 TP1)
    max_tokens_per_pass: int = 16384
