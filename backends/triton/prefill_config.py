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
    rows: int = 64
    #: keys per inner step of a tile (a divisor of the block size, >= 16): bounds registers.
    #: Only the one-tile-per-step kernel (``run_tiles = 0``) splits blocks; runs take whole blocks
    block_n: int = 64
    warps: int = 4
    #: persistent programs per multiprocessor, each walking its work as one software-pipelined
    #: loop of ``stages`` stages (H200: two 4-warp programs of 64-row tiles 1.07-1.10x over one
    #: 8-warp program of 128-row tiles at TP1)
    programs_per_sm: int = 2
    stages: int = 4
    #: n = runs of up to n tiles of one segment: the block's K/V loaded once per run, the run's
    #: tiles one pipelined loop; 0 = the previous kernel, one tile per loop step (K/V per tile)
    run_tiles: int = 8
    #: warps of the merge (one program per token and KV head)
    merge_warps: int = 4
    #: prefill tokens planned and merged per pass: bounds the partial-output workspace
    #: (pairs x G x D elements: 2.1 GB of bf16 for 8K tokens at M3 TP1)
    max_tokens_per_pass: int = 16384
