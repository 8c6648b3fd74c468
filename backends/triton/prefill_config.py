"""Launch configuration of the block-grouped prefill attention (:mod:`.prefill_attention`).

Plain Python (no Triton import), like :mod:`.launch`, so a plugin can build
its configuration without importing the kernels.

Example:
    >>> cfg = PrefillAttentionConfig(rows=64, warps=4, programs_per_sm=2, stages=4, run_tiles=8, merge_warps=4,
    ...                              max_tokens_per_pass=16384)
    >>> cfg.rows // 16          # tokens per tile at GQA group 16
    4
"""

from __future__ import annotations

from dataclasses import dataclass

from .interpreter_config import INTERPRETER_ROWS, size

__all__ = ["PrefillAttentionConfig"]


@dataclass(frozen=True)
class PrefillAttentionConfig:
    """Tile shape of the block-grouped prefill attention.

    A tile is one selected block of one KV head against the query rows of up
    to ``rows // G`` tokens that selected it (``G`` query heads each; rows
    are raised to the next power of two >= G when G is larger). A run is up
    to ``run_tiles`` tiles of one block: the block's K/V are loaded once per
    run, whole (no inner key tiles).
    """

    #: query rows of one tile (tokens x the G query heads of a KV head); a power of two >= G
    rows: int = size(interpreter=INTERPRETER_ROWS)
    warps: int
    #: persistent programs per multiprocessor, each walking its runs' tiles as one
    #: software-pipelined loop of ``stages`` stages
    programs_per_sm: int
    stages: int
    #: tiles of one segment per run (>= 1): the block's K/V loaded once per run
    run_tiles: int
    #: warps of the merge (one program per token and KV head)
    merge_warps: int
    #: prefill tokens planned and merged per pass: bounds the partial-output workspace
    #: (pairs x G x D elements: 2.1 GB of bf16 for 8K tokens at M3 TP1)
    max_tokens_per_pass: int
