"""Helpers shared by the reference kernels: work budgets and the gathers of pages or token slots.

Everything here is plain tensor code that runs on whatever device the inputs
live on; nothing asks which device that is.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mm3.plugin import BatchMetadata, PagedKVCache, key_rows

__all__ = ["DEFAULT_MAX_ELEMENTS", "gather_pages", "page_ids", "block_rows", "first_blocks", "first_block_rows",
           "widened"]

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


def block_rows(batch: BatchMetadata, req: torch.Tensor, pos: torch.Tensor, caches: PagedKVCache) -> torch.Tensor:
    """The cache rows (of the flattened ``[num_pages * page_size]``) of positions ``pos`` of requests
    ``req`` (broadcast), through the batch's pages or token slots, clamped into the cache: positions
    at or past a request's ``seq_len`` read a real row that callers mask."""
    return key_rows(batch, req, pos, caches.num_pages * caches.block_size, caches.block_size)


def first_blocks(cache: torch.Tensor, batch: BatchMetadata, requests: torch.Tensor, num_blocks: int,
                 caches: PagedKVCache) -> torch.Tensor:
    """The rows of ``cache`` (K, V, index keys or their block scales) at the first ``num_blocks`` blocks of
    each of ``requests`` (``[G]`` long): ``[G, num_blocks * B, *row]``; pages gathered whole, token slots
    row by row."""
    if batch.slots is None:
        return gather_pages(cache, batch.block_table[requests], num_blocks).flatten(1, 2)
    return cache[first_block_rows(batch, requests, num_blocks, caches), 0]


def first_block_rows(batch: BatchMetadata, requests: torch.Tensor, num_blocks: int,
                     caches: PagedKVCache) -> torch.Tensor:
    """The flat cache rows :func:`first_blocks` reads: ``[G, num_blocks * B]`` long."""
    B = batch.block_size
    if batch.slots is None:
        pages = page_ids(batch.block_table[requests], num_blocks, caches.num_pages)
        return (pages.unsqueeze(-1) * B + torch.arange(B, device=pages.device)).flatten(1)
    pos = torch.arange(num_blocks * B, device=requests.device)
    return block_rows(batch, requests[:, None], pos[None, :], caches)


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
