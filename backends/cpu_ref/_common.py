"""Helpers shared by the reference kernels: work budgets and page gathers.

Everything here is plain tensor code that runs on whatever device the inputs
live on; nothing asks which device that is.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


__all__ = ["DEFAULT_MAX_ELEMENTS", "gather_pages", "page_ids", "widened"]

DEFAULT_MAX_ELEMENTS = 1 << 24
"""Largest intermediate (fp32 elements, 64 MiB) one chunk of work may create.

Chunk sizes are derived from it, so peak memory stays at a few hundred MiB
whatever the context length or prefill size.
"""


def gather_pages(cache: torch.Tensor, block_table_rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` pages of each block-table row: ``[R, num_blocks, *page]``.

    Unused block-table entries may hold ``-1`` (or anything): they are clamped
    into the cache so the gather never goes out of bounds. Callers mask every
    position at or beyond a request's ``seq_len``, so those pages' contents
    never reach a result.
    """
    return cache[page_ids(block_table_rows, num_blocks, cache.shape[0])]


def page_ids(block_table_rows: torch.Tensor, num_blocks: int, num_pages: int) -> torch.Tensor:
    """The pages :func:`gather_pages` reads: ``[R, num_blocks]`` long, clamped into ``[0, num_pages)``."""
    return block_table_rows[:, :num_blocks].to(torch.long).clamp(0, num_pages - 1)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def widened(stored: torch.Tensor, block_scale: Optional[torch.Tensor], pick: Callable[[torch.Tensor], torch.Tensor],
            ) -> torch.Tensor:
    """fp32 values of ``pick(stored)`` (a gather of a cache's rows): widened as they are, or for an NVFP4
    cache (``block_scale`` given: uint8 pairs of e2m1 codes, low nibble first, and one e4m3 scale per 16
    elements) each e2m1 value times its scale, a product fp32 holds exactly (docs/spec.md §1)."""
    x = pick(stored)
    if block_scale is None:
        return x.float()
    table = torch.tensor(_E2M1, dtype=torch.float32, device=x.device)
    values = table[torch.stack((x & 15, x >> 4), dim=-1).flatten(-2).long()]           # [..., D]
    scales = pick(block_scale).float()                                                  # [..., D / 16]
    return (values.unflatten(-1, (scales.shape[-1], 16)) * scales.unsqueeze(-1)).flatten(-2)
