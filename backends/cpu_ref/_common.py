"""Helpers shared by the reference kernels: work budgets and page gathers.

Everything here is plain tensor code that runs on whatever device the inputs
live on; nothing asks which device that is.
"""

from __future__ import annotations

import torch


__all__ = ["DEFAULT_MAX_ELEMENTS", "gather_pages", "page_ids"]

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
