"""NVFP4 tiles for the Triton kernels (docs/spec.md §1): packed e2m1 bytes and per-16 e4m3 scales, unpacked
on chip into the dot's dtype, so no dequantized copy of a cache is ever made.

A row of an NVFP4 cache (one token's key of one KV head, or one index key) is ``D/2`` bytes, two e2m1
codes each, the low nibble the even element, and ``D/16`` e4m3 scales, one per 16 consecutive
elements; element ``i`` is ``e2m1(code_i) * scale[i // 16]``. That product has at most 6 significant
bits and lies within ``[2^-10, 2688]`` in magnitude (or is 0), so it is exact in fp16, bf16 and fp32:
the tile :func:`load_nvfp4_rows` returns holds the very values the reference reads
(``mm3.contract.quant.dequantize_nvfp4``), in whichever of those dtypes the dot takes. No rounding to
e4m3 as the model authors' SM100 kernels do (docs/spec.md §1 says why).

The e2m1 value comes from arithmetic on the code, not a table (a kernel has no registers it can index):
with ``e = (c >> 1) & 3`` and ``m = c & 1``, four times the magnitude is ``2m`` for ``e = 0`` and
``(2 + m) << e`` otherwise (0, 2, 4, 6, 8, 12, 16, 24); bit 3 is the sign. The 1/4 joins the scale.

Callers pass each row's start (``[R]`` pointers), so whatever addresses a kernel's rows (pages and
slots, NHD or HND) stays the kernel's; only the bytes of a row are read here.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["e2m1_times_4", "load_nvfp4_rows", "kv_block_scale_args", "index_block_scale_args"]

#: head-dim elements per e4m3 scale (mm3.contract.quant.NVFP4_GROUP)
GROUP = tl.constexpr(16)


@triton.jit
def e2m1_times_4(codes):
    """Four times the e2m1 values of ``codes`` (int32, 0-15): exact small integers, as float32."""
    e = (codes >> 1) & 3
    m = codes & 1
    q4 = tl.where(e == 0, 2 * m, (2 + m) << e)
    return tl.where((codes & 8) != 0, -q4, q4).to(tl.float32)


@triton.jit
def load_nvfp4_rows(byte_rows, scale_rows, s_byte, s_scale, D: tl.constexpr, DTYPE: tl.constexpr, row_mask=None,
                    SCALE_PER_ELEMENT: tl.constexpr = False):
    """The ``[R, D]`` values of ``R`` NVFP4 rows as ``DTYPE`` (exact in fp16, bf16 and fp32).

    ``byte_rows``: ``[R]`` pointers (uint8) to each row's first packed byte, the next ones ``s_byte``
    apart; ``scale_rows``: ``[R]`` pointers (float8e4nv) to each row's first scale, the next ones
    ``s_scale`` apart. ``row_mask`` (``[R]`` bool, optional): rows where it is False are not read and
    hold zeros (a zero scale, as a masked load gives).

    A row's ``D/2`` bytes load once; each byte is spread to its two elements by a broadcast and a
    reshape. ``SCALE_PER_ELEMENT`` says how the scales reach their sixteen elements: False, the
    ``D/16`` scales load once and spread the same way; True, each element loads its own scale (the
    repeats hit the cache). Which is faster depends on the dot the tile feeds, so each caller picks the
    faster for its own (BENCHMARKS.md, "The NVFP4 tile", has both timed in every kernel). Never
    ``tl.interleave`` (a join of the two nibbles): compiled for sm_90 it gave the attention kernels
    wrong tiles at every head dim, though right under the interpreter; the GPU conformance suite's
    NVFP4 cases hold this.
    """
    offs = tl.arange(0, D)
    byte_at = byte_rows[:, None] + tl.arange(0, D // 2)[None, :] * s_byte
    if SCALE_PER_ELEMENT:
        scale_at = scale_rows[:, None] + (offs // GROUP)[None, :] * s_scale
    else:
        scale_at = scale_rows[:, None] + tl.arange(0, D // GROUP)[None, :] * s_scale
    if row_mask is None:
        packed = tl.load(byte_at)
        scales = tl.load(scale_at)
    else:
        packed = tl.load(byte_at, mask=row_mask[:, None], other=0)
        scales = tl.load(scale_at, mask=row_mask[:, None], other=0.0)
    R: tl.constexpr = packed.shape[0]
    # element 2i is byte i's low nibble, 2i + 1 its high one
    pairs = tl.reshape(tl.broadcast_to(packed.to(tl.int32)[:, :, None], [R, D // 2, 2]), [R, D])
    codes = (pairs >> ((offs & 1) * 4)[None, :]) & 15
    factor = scales.to(tl.float32) * 0.25
    if not SCALE_PER_ELEMENT:
        factor = tl.reshape(tl.broadcast_to(factor[:, :, None], [R, D // GROUP, GROUP]), [R, D])
    return (e2m1_times_4(codes) * factor).to(DTYPE)


def kv_block_scale_args(caches: Any, dummy: torch.Tensor) -> tuple[tuple[Any, ...], bool]:
    """``((k_block_scale, its 4 strides, v_block_scale, its 4 strides), KV_NVFP4)`` for a kernel that reads
    ``caches``' K/V: NVFP4's scales read in place (any page layout), else ``dummy`` with zero strides,
    never read.

    Example:
        >>> from mm3.plugin import PagedKVCache
        >>> c = PagedKVCache.allocate(2, 16, 1, 32, 32, kv_format="nvfp4", layout="HND")
        >>> args, nvfp4 = kv_block_scale_args(c, c.k)
        >>> nvfp4, args[1:5]
        (True, (32, 2, 32, 1))
    """
    if caches.k_block_scale is None:
        return (dummy, 0, 0, 0, 0, dummy, 0, 0, 0, 0), False
    kb, vb = caches.k_block_scale, caches.v_block_scale
    return (kb, *kb.stride(), vb, *vb.stride()), True


def index_block_scale_args(caches: Any, dummy: torch.Tensor) -> tuple[tuple[Any, ...], bool]:
    """``((index_block_scale, its 3 strides), INDEX_NVFP4)`` for a kernel that reads ``caches``' index keys
    (NVFP4's scales read in place), else ``dummy`` with zero strides, never read.

    Example:
        >>> from mm3.plugin import PagedKVCache
        >>> c = PagedKVCache.allocate(2, 16, 1, 32, 64, index_format="nvfp4")
        >>> args, nvfp4 = index_block_scale_args(c, c.index)
        >>> nvfp4, args[1:]
        (True, (64, 4, 1))
    """
    s = caches.index_block_scale
    if s is None:
        return (dummy, 0, 0, 0), False
    return (s, *s.stride()), True
