"""The launch configuration of the shared Triton kernels, and the shape-only heuristics that use it.

A :class:`LaunchConfig` groups one tile config per kernel family
(:mod:`.kernel_configs`, :mod:`.prefill_config`), the choice of kernel
variants and the kernels' numerics (:mod:`.algorithms`). Its values belong to
the platform plugins (``backends/cuda``, ``backends/rocm``): nothing here
knows a platform. Plain Python: no Triton import, no GPU query at import time.

Every grid size is computed from *shapes* (number of decode requests, decode
query length, block-table width, top-k) and the device's multiprocessor
count, never from tensor contents, so the decode path can be captured in a
CUDA graph and replayed with new lengths and positions.

The rules' decisions at the cuda plugin's values are the examples of
``backends/cuda/tuning.py``; tests/test_triton_interpreter.py checks them too.

Example:
    >>> next_pow2(5), next_pow2(16), next_pow2(0)
    (8, 16, 1)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from .algorithms import Algorithms, Numerics
from .interpreter_config import INTERPRETER_PROGRAMS, size
from .kernel_configs import DecodeAttentionConfig, DecodeIndexConfig, PrefillIndexConfig, TokenTileAttentionConfig
from .prefill_config import PrefillAttentionConfig

__all__ = ["LaunchConfig", "next_pow2", "override"]


#: most splits the last program of a pair merges (:meth:`LaunchConfig.use_merge_in_last_program`)
MERGE_LAST_MAX_SPLITS = 4


#: decode requests from which the attention overlaps the indexer (:meth:`LaunchConfig.use_streamed_decode`):
#: the batch it was measured at (fewer requests finish in fewer waves)
STREAM_MIN_REQUESTS = 64


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (and ``>= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one platform launches the kernels with.

    ``target_programs`` is the number of programs a bandwidth-bound decode
    kernel should launch to fill the device (about two per multiprocessor);
    plugins replace it with the measured multiprocessor count at call time
    (:meth:`for_device_sms`).
    """

    #: programs that fill the device (2 x SMs on NVIDIA, 2 x CUs on AMD)
    target_programs: int = size(interpreter=INTERPRETER_PROGRAMS)
    decode_index: DecodeIndexConfig
    prefill_index: PrefillIndexConfig
    decode_attention: DecodeAttentionConfig
    #: prefill attention grouped by selected block (:mod:`.prefill_attention`): each block is read
    #: once per tile of the tokens that chose it. None = the token-tile kernel (``prefill_tiles``)
    prefill_attention: Optional[PrefillAttentionConfig]
    prefill_tiles: TokenTileAttentionConfig
    algorithms: Algorithms
    numerics: Numerics
    #: extra Triton launch options of every kernel (e.g. AMD's ``waves_per_eu``); the plugin
    #: drops them where they do not apply (:meth:`portable`)
    launch_options: tuple[tuple[str, Any], ...] = ()

    def portable(self) -> "LaunchConfig":
        """This config for the other vendor's GPU (the plugins' test-only overrides): no
        platform-only launch options, and no PDL, which only NVIDIA's Triton backend has."""
        return replace(self, launch_options=(), algorithms=replace(self.algorithms, pdl=False))

    def for_device_sms(self, sms: int) -> "LaunchConfig":
        """This config with ``target_programs`` sized for a device with ``sms`` multiprocessors."""
        return replace(self, target_programs=max(1, 2 * sms))

    def decode_index_blocks_per_split(self, num_requests: int, table_width: int, streamed: bool = False) -> int:
        """Blocks one decode-indexer work item scores (a power of two).

        Small enough that ``num_requests * splits`` fills the device even for a
        single long request, large enough that each program streams a useful
        run of index keys. ``streamed``: ``decode_index.stream_waves`` times as many
        programs, so that the requests, launched one after another, finish in waves.
        """
        idx = self.decode_index
        target = self.target_programs * idx.programs_factor * (idx.stream_waves if streamed else 1)
        splits_wanted = max(1, -(-target // max(1, num_requests)))
        per_split = -(-max(1, table_width) // splits_wanted)
        per_split = min(max(per_split, idx.min_blocks), idx.max_blocks)
        return next_pow2(per_split)

    def prefill_index_splits(self, num_tiles: int, table_width: int) -> int:
        """Programs each prefill-indexer token tile is split over (a power of two; 1 = no merge pass).

        Shapes only: with fewer tiles than multiprocessors (``target_programs / 2``;
        TP8 has one index head, so an 8K chunk is 128 tiles of 64 tokens on a
        132-SM GPU) the tiles' visible blocks are split towards ``target_programs``
        programs, with at least two chunks (``prefill_index.chunk`` blocks each) of
        the block table per split. Measured on the H200 (8K chunk): TP8 at 32K
        context 4 splits of 128-row tiles 490 -> 273 us; splitting where the tiles
        already fill the SMs (TP1) or where the table is short (context 0) was
        slower (TP1 ctx 0, 2 splits: 152 -> 206 us), hence both conditions.
        """
        pic = self.prefill_index
        if pic.max_splits <= 1 or 2 * num_tiles >= self.target_programs:
            return 1
        wanted = -(-self.target_programs // max(1, num_tiles))
        by_width = max(1, table_width // (2 * pic.chunk))
        splits = min(wanted, pic.max_splits, by_width)
        return 1 << (splits.bit_length() - 1)  # rounded down to a power of two: one bitonic merge

    def use_merge_per_row(self, num_tokens: int, num_kv_heads: int) -> bool:
        """Per-row merge when the (token, KV head) grid fills under a quarter of the device.

        Measured on the H200 (TP1, 64K): batch 1 merge 12.4 -> 8.2 us per row; batch 64
        95 -> 102 us (the per-KV-head merge wins once the grid is full).
        """
        return self._small_grid(num_tokens, num_kv_heads)

    def _small_grid(self, num_tokens: int, num_kv_heads: int) -> bool:
        """The (token, KV head) grid fills under a quarter of the device."""
        return 4 * num_tokens * num_kv_heads <= self.target_programs

    def use_merge_in_last_program(self, splits: int) -> bool:
        """The flash-decoding merge done by the last split of each pair (``algorithms.merge_in_last_program``;
        None = this rule): with at most :data:`MERGE_LAST_MAX_SPLITS` splits.

        Measured on the H200 (64K context, CUDA graphs): TP8 b64 (4 splits) step 279.5 -> 274.8 us;
        TP1 b1 (16 splits: one program reads 16 partials) attention 6.6 -> 10.1 us. Eager steps of many
        splits keep their merge launch too (the ~10 us of host time it costs is left there): the
        per-row merge kernel small grids take sums the splits in another order than the last
        program, and a step replayed from a CUDA graph must give the eager step's bits, so the
        choice depends on the shape only, never on a capture.
        """
        if self.algorithms.merge_in_last_program is not None:
            return self.algorithms.merge_in_last_program
        return splits <= MERGE_LAST_MAX_SPLITS

    def use_topk_in_last_program(self, num_tokens: int, num_kv_heads: int, capturing: bool) -> bool:
        """The decode top-k done by each request's last score program (``algorithms.topk_in_last_program``;
        None = this rule): on eager steps of a small grid only.

        Measured on the H200 (64K context, CUDA graphs), the indexer: TP1 b1 10.4 -> 15.1 us (one
        program sorts the request's 4 rows), TP1 b64 252.9 -> 259.4 us, TP8 b64 251.2 -> 249.9 us.
        It pays only where the host is the bound: an eager step of a small grid, where a launch
        costs ~20 us of host time.
        """
        if self.algorithms.topk_in_last_program is not None:
            return self.algorithms.topk_in_last_program
        return not capturing and self._small_grid(num_tokens, num_kv_heads)

    def use_streamed_decode(self, num_requests: int, rows_per_request: int) -> bool:
        """The decode attention overlapping the indexer (``algorithms.streamed_decode``; None = this
        rule): requests of one index row (one index head, no draft tokens), from
        :data:`STREAM_MIN_REQUESTS` of them, with the persistent attention kernel and PDL not ruled out.

        Measured on the H200 (64K context, CUDA graphs): TP8 b64 step 276.2 -> 271.9 and
        275.8 -> 271.5 us (fp8 index 174.8 -> 172.8 and 175.0 -> 172.6); TP1 b64 322.8 -> 324.9 us (fp8 index 221.0 -> 226.9): with four
        index rows per request the four times shorter score programs are 2-6% slower, more than
        the overlap saves.
        """
        if self.algorithms.streamed_decode is not None:
            return self.algorithms.streamed_decode
        return (self.algorithms.decode_attention_flat and self.algorithms.pdl is not False
                and rows_per_request == 1 and num_requests >= STREAM_MIN_REQUESTS)

    def _flat_programs(self) -> int:
        return max(1, self.target_programs // 2) * self.decode_attention.flat_programs_per_sm

    def decode_attention_flat_items_per_program(self, items: int) -> int:
        """Work items (token, KV head, split) one persistent decode-attention program walks."""
        return -(-items // self._flat_programs())

    def use_pdl(self, num_tokens: int, num_kv_heads: int) -> bool:
        """Programmatic dependent launch for this decode step (``algorithms.pdl``; None = small grids only).

        Measured on the H200 (TP1, 64K): batch 1 step 20.1 -> 17.7 us; batch 64 0.97x (the
        early-resident dependents take SM slots from a full grid).
        """
        if self.algorithms.pdl is not None:
            return self.algorithms.pdl
        return self._small_grid(num_tokens, num_kv_heads)

    def decode_attention_splits(self, num_tokens: int, num_kv_heads: int, topk: int) -> int:
        """Flash-decoding splits over the selected blocks (1 = no merge pass).

        Persistent kernel: the fewest splits that still give each program an item
        (rounded down: a few idle program slots cost less than a merge pass).
        """
        dac = self.decode_attention
        if self.algorithms.decode_attention_flat:
            pairs = max(1, num_tokens * num_kv_heads)
            return max(1, min(self._flat_programs() // pairs, topk, dac.max_splits))
        programs = max(1, num_tokens * num_kv_heads)
        splits = -(-self.target_programs * dac.programs_factor // programs)
        return max(1, min(splits, topk, dac.max_splits))


def override(cfg: LaunchConfig, **changes: Any) -> LaunchConfig:
    """``cfg`` with fields replaced; a dict for a group replaces only those fields of the group.

    ``override(cfg, decode_attention=dict(warps=8), algorithms=dict(pdl=False))`` is
    ``replace(cfg, decode_attention=replace(cfg.decode_attention, warps=8), ...)``; a
    non-dict value (``prefill_attention=None``, a whole config) replaces the field.
    """
    return replace(cfg, **{name: replace(getattr(cfg, name), **value) if isinstance(value, dict) else value
                           for name, value in changes.items()})
