"""Helpers shared by the reference kernels: work budgets and page gathers.

Everything here is plain tensor code that runs on whatever device the inputs
live on; nothing asks which device that is.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mm3.plugin import BatchMetadata, PagedKVCache, key_rows

__all__ = ["DEFAULT_MAX_ELEMENTS", "block_rows", "gather_rows", "widened"]

DEFAULT_MAX_ELEMENTS = 1 << 24
"""Largest intermediate (fp32 elements, 64 MiB) one chunk of work may create.

Chunk sizes are derived from it, so peak memory stays at a few hundred MiB
whatever the context length or prefill size.
"""


def block_rows(batch: BatchMetadata, req: torch.Tensor, pos: torch.Tensor, caches: PagedKVCache) -> torch.Tensor:
    """The cache rows (of the flattened ``[num_pages * page_size]``) of positions ``pos`` of requests
    ``req`` (broadcast), through the batch's pages or token slots, clamped into the cache: positions
    at or past a request's ``seq_len`` read a real row that callers mask."""
    return key_rows(batch, req, pos, caches.num_pages * caches.block_size, caches.block_size)


def gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``cache`` ``[num_pages, page_size, ...]`` at the flat rows ``rows`` (of :func:`block_rows`):
    ``[*rows.shape, ...]``, any strides, no copy of the cache."""
    page_size = cache.shape[1]
    return cache[rows // page_size, rows % page_size]


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
