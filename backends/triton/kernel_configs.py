"""Tile sizes, warps and pipelining depths of each Triton kernel family but the block-grouped prefill attention.

One frozen dataclass per family, grouped by :class:`.launch.LaunchConfig`;
:class:`.prefill_config.PrefillAttentionConfig` is the fifth. No field has a
default: each platform plugin (``backends/cuda``, ``backends/rocm``) states
every value it launches with, so no platform inherits another's tuning.
``num_stages`` is Triton's software-pipelining option of the launch;
``stages`` (decode attention) is the kernel's own pipelined loop depth.

Example:
    >>> DecodeIndexConfig(min_blocks=1, max_blocks=128, warps=4, topk_warps=4, programs_factor=2,
    ...                   block_n=128, num_stages=2, stream_waves=4).block_n
    128
    >>> DecodeAttentionConfig(warps=4, max_splits=16, stages=3, num_stages=2, programs_factor=8,
    ...                       flat_programs_per_sm=2, block_n=64).flat_programs_per_sm
    2
"""

from __future__ import annotations

from dataclasses import dataclass

from .interpreter_config import INTERPRETER_KEYS, INTERPRETER_ROWS, size

__all__ = ["DecodeIndexConfig", "PrefillIndexConfig", "DecodeAttentionConfig", "TokenTileAttentionConfig"]


@dataclass(frozen=True)
class DecodeIndexConfig:
    """The decode indexer: a score kernel (one program scores a run of blocks of one request
    for all its rows) and a top-k kernel over each row's block scores."""

    #: blocks one score program takes at least / at most (rounded to a power of two)
    min_blocks: int
    max_blocks: int
    warps: int
    #: warps of the top-k kernel
    topk_warps: int
    #: score programs are sized for ``target_programs * programs_factor``
    programs_factor: int
    #: keys per inner tile (a divisor of the block size, >= 16): bounds registers
    block_n: int = size(interpreter=INTERPRETER_KEYS)
    num_stages: int
    #: (streamed decode, ``Algorithms.streamed_decode``) waves of score programs: launched request
    #: by request, the requests finish one wave after another, and the attention of those done
    #: runs beside the last wave (it can launch only once every score program has started)
    stream_waves: int


@dataclass(frozen=True)
class PrefillIndexConfig:
    """The prefill indexer: a tile holds ``rows`` = tokens x index heads."""

    rows: int = size(interpreter=INTERPRETER_ROWS)
    warps: int
    #: keys per inner tile (its tiles hold many rows, so it wants fewer keys than the decode one)
    block_n: int
    #: blocks scored between two merges of the running packed-key top-K (a power of two; raised
    #: to the top-k's sort width when smaller)
    chunk: int
    num_stages: int
    #: most programs one token tile's visible blocks are split over when the tiles alone do not
    #: fill the device (each split keeps its own top-K, a small kernel merges them). 1 = never split
    max_splits: int
    #: the causal mask only on key tiles that some row of the tile sees in part;
    #: False = on every tile (the masks' compare and select per score: a quarter of the loop)
    unmasked_full: bool
    #: fp32 chunk scores packed once per chunk, and an ascending running top-K
    #: merged with the chunk's top-K by a bitonic merge instead of a second top-k (same result)
    sorted_merge: bool
    #: the index cache's row stride compiled in (one specialization per stride):
    #: each thread's key addresses become one register plus immediates
    static_key_stride: bool


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """Decode attention (all query heads of a KV group in one tile, split over the selected
    blocks) and its flash-decoding merge, which launches with the same warps."""

    warps: int
    max_splits: int
    #: depth of the kernel's own pipelined loop over a split's blocks
    stages: int
    num_stages: int
    #: (grid kernel) splits are sized for ``target_programs * programs_factor`` programs
    programs_factor: int
    #: (persistent kernel) programs per multiprocessor; ``target_programs`` is two per SM
    flat_programs_per_sm: int
    #: keys per inner tile
    block_n: int = size(interpreter=INTERPRETER_KEYS)


@dataclass(frozen=True)
class TokenTileAttentionConfig:
    """The token-tile prefill attention (used when ``LaunchConfig.prefill_attention`` is None):
    a tile holds ``rows`` = tokens x the query heads of one KV group."""

    rows: int = size(interpreter=INTERPRETER_ROWS)
    warps: int
    #: keys per inner tile (register pressure of its many-row tiles)
    block_n: int
    num_stages: int
