"""Launch configurations of the shared Triton kernels, and the shape-only heuristics that use them.

A platform plugin (``cuda``, ``rocm``) picks one :class:`LaunchConfig`; the
kernels themselves are the same. Everything here is plain Python: no Triton
import, no GPU query at import time.

Every grid size is computed from *shapes* (number of decode requests, decode
query length, block-table width, top-k) and the device's multiprocessor
count, never from tensor contents, so the decode path can be captured in a
CUDA graph and replayed with new lengths and positions.

Example:
    >>> cfg = LaunchConfig(target_programs=264)
    >>> cfg.decode_index_blocks_per_split(num_requests=64, table_width=512)
    64
    >>> cfg.decode_attention_splits(num_tokens=64, num_kv_heads=4, topk=16)
    1
    >>> cfg.decode_attention_splits(num_tokens=1, num_kv_heads=4, topk=16)
    16
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from .prefill_config import PrefillAttentionConfig

__all__ = ["LaunchConfig", "next_pow2"]


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (and ``>= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes, warps and pipelining depth for one platform (defaults: NVIDIA Hopper/Ampere).

    ``target_programs`` is the number of programs a bandwidth-bound decode
    kernel should launch to fill the device (about two per multiprocessor);
    plugins replace it with the measured multiprocessor count at call time
    (:meth:`for_device_sms`).
    """

    #: programs that fill the device (2 x SMs on NVIDIA, 2 x CUs on AMD)
    target_programs: int = 264
    #: warp (wavefront) width of the platform; informative, Triton knows it
    warp_size: int = 32
    # decode indexer: one program scores a run of blocks of one request for all rows
    decode_index_min_blocks: int = 1
    decode_index_max_blocks: int = 128
    decode_index_warps: int = 4
    # top-k over a decode row's block scores
    topk_warps: int = 4
    # prefill indexer: rows = tokens x index heads in one tile
    prefill_index_rows: int = 128
    prefill_index_warps: int = 8
    # decode attention: all query heads of a KV group in one tile; split over selected blocks.
    # 4 warps: two persistent programs per SM (H200: 80 vs 95 us at TP1 b64 64K)
    decode_attention_warps: int = 4
    decode_attention_max_splits: int = 16
    #: loop over a split's blocks with masked loads instead of a data-dependent branch,
    #: so the next block's page, K and V loads can be in flight (software pipelining)
    decode_attention_branchless: bool = True
    decode_attention_stages: int = 3
    #: (per-item kernel) splits are sized for ``target_programs * decode_attention_programs_factor``
    #: programs; the persistent kernel sizes its splits from its own program count
    decode_attention_programs_factor: int = 8
    #: persistent decode attention: ``decode_attention_flat_programs_per_sm`` programs per
    #: multiprocessor (``target_programs`` is two per SM) each walk a run of (token, KV head,
    #: split) items as one pipelined loop
    decode_attention_flat: bool = True
    decode_attention_flat_programs_per_sm: int = 2
    #: flash-decoding merge with one program per (token, query head) instead of per KV head;
    #: None = when the per-KV-head grid is small (see :meth:`use_merge_per_row`)
    merge_per_row: Optional[bool] = None
    #: decode indexer programs are sized for ``target_programs * decode_index_programs_factor``
    decode_index_programs_factor: int = 2
    #: decode top-k by one bitonic ``tl.topk`` over packed (score, id) keys instead of K arg-max rounds
    topk_sort: bool = True
    #: indexer dots as ``keys @ q^T`` (keys are the register operand): an fp8 key tile is widened
    #: in registers and feeds the tensor cores without a shared-memory round trip
    index_keys_as_a: bool = False
    #: prefill indexer: 0 = running top-K updated per block; n = packed-key top-K merged every n
    #: blocks (a power of two >= topk)
    prefill_index_chunk: int = 32
    #: prefill attention grouped by selected block (:mod:`.prefill_attention`): each block is read once
    #: per tile of the tokens that chose it (H200, TP1, 8K chunk: 1.03-1.36x over the token tiles and
    #: the per-token kernel it replaced). None = the token-tile kernel below (AMD: not run there yet)
    prefill_attention: Optional[PrefillAttentionConfig] = PrefillAttentionConfig()
    #: (token tiles) visit only the union of the tile's selected blocks (walking the
    #: tile's top-k slots) instead of scanning every visible block for members
    prefill_attention_union: bool = False
    # prefill attention: rows = tokens x query heads of one KV group
    prefill_attention_rows: int = 128
    prefill_attention_warps: int = 8
    num_stages: int = 2
    #: keys per inner tile (a divisor of the block size, >= 16): bounds registers
    index_block_n: int = 128
    #: the same for the prefill indexer (its tiles hold 128 rows, so it wants fewer keys)
    prefill_index_block_n: int = 64
    #: pipelining depth of the decode indexer's loop over blocks (0 = ``num_stages``)
    decode_index_stages: int = 0
    #: bf16 index queries against an fp8 cache: dot in fp16 (queries scaled per row by a power
    #: of two) instead of bf16, because e4m3 -> fp16 is one native conversion
    index_fp8_as_f16: bool = True
    #: indexer: carry NaN scores through the block max (one row reduction instead of two)
    index_nan_in_max: bool = True
    #: keys per inner tile of the decode attention (a whole 128-key block: 1.03-1.08x over 64)
    attention_block_n: int = 128
    #: decode kernels with programmatic dependent launch (NVIDIA Hopper+): each kernel's launch
    #: overlaps the previous one's run; every kernel waits for its predecessor before any load.
    #: None = for small grids (see :meth:`use_pdl`)
    pdl: Optional[bool] = None
    #: keys per inner tile of the prefill attention (register pressure of its 128-row tiles)
    prefill_attention_block_n: int = 64
    #: extra launch options for this platform's Triton backend only (e.g. AMD's
    #: ``waves_per_eu``); applied only when the running backend is that platform
    platform_launch_options: tuple[tuple[str, Any], ...] = ()

    def for_device_sms(self, sms: int) -> "LaunchConfig":
        """This config with ``target_programs`` sized for a device with ``sms`` multiprocessors."""
        return replace(self, target_programs=max(1, 2 * sms))

    def decode_index_blocks_per_split(self, num_requests: int, table_width: int) -> int:
        """Blocks one decode-indexer program scores (a power of two).

        Small enough that ``num_requests * splits`` fills the device even for a
        single long request, large enough that each program streams a useful
        run of index keys.
        """
        target = self.target_programs * self.decode_index_programs_factor
        splits_wanted = max(1, -(-target // max(1, num_requests)))
        per_split = -(-max(1, table_width) // splits_wanted)
        per_split = min(max(per_split, self.decode_index_min_blocks), self.decode_index_max_blocks)
        return next_pow2(per_split)

    def use_merge_per_row(self, num_tokens: int, num_kv_heads: int) -> bool:
        """Per-row merge when the (token, KV head) grid fills under a quarter of the device.

        Measured on the H200 (TP1, 64K): batch 1 merge 12.4 -> 8.2 us per row; batch 64
        95 -> 102 us (the per-KV-head merge wins once the grid is full).
        """
        if self.merge_per_row is not None:
            return self.merge_per_row
        return self._small_grid(num_tokens, num_kv_heads)

    def _small_grid(self, num_tokens: int, num_kv_heads: int) -> bool:
        """The (token, KV head) grid fills under a quarter of the device."""
        return 4 * num_tokens * num_kv_heads <= self.target_programs

    def _flat_programs(self) -> int:
        return max(1, self.target_programs // 2) * self.decode_attention_flat_programs_per_sm

    def decode_attention_flat_items_per_program(self, items: int) -> int:
        """Work items (token, KV head, split) one persistent decode-attention program walks."""
        return -(-items // self._flat_programs())

    def use_pdl(self, num_tokens: int, num_kv_heads: int) -> bool:
        """Programmatic dependent launch for this decode step (``pdl``; None = small grids only).

        Measured on the H200 (TP1, 64K): batch 1 step 20.1 -> 17.7 us; batch 64 0.97x (the
        early-resident dependents take SM slots from a full grid).
        """
        if self.pdl is not None:
            return self.pdl
        return self._small_grid(num_tokens, num_kv_heads)

    def decode_attention_splits(self, num_tokens: int, num_kv_heads: int, topk: int) -> int:
        """Flash-decoding splits over the selected blocks (1 = no merge pass).

        Persistent kernel: the fewest splits that still give each program an item
        (rounded down: a few idle program slots cost less than a merge pass).
        """
        if self.decode_attention_flat:
            pairs = max(1, num_tokens * num_kv_heads)
            return max(1, min(self._flat_programs() // pairs, topk, self.decode_attention_max_splits))
        programs = max(1, num_tokens * num_kv_heads)
        splits = -(-self.target_programs * self.decode_attention_programs_factor // programs)
        return max(1, min(splits, topk, self.decode_attention_max_splits))
