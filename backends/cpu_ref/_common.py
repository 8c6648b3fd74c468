"""Helpers shared by the reference kernels: input checks, work budgets, page gathers.

Everything here is plain tensor code that runs on whatever device the inputs
live on; nothing asks which device that is.
"""

from __future__ import annotations

import torch

from mm3.batch import BatchMetadata
from mm3.buffers import PagedKVCache
from mm3.errors import InputError
from mm3.params import SparseAttentionParams

__all__ = ["DEFAULT_MAX_ELEMENTS", "check_common", "check_rows", "gather_pages"]

DEFAULT_MAX_ELEMENTS = 1 << 24
"""Largest intermediate (fp32 elements, 64 MiB) one chunk of work may create.

Chunk sizes are derived from it, so peak memory stays at a few hundred MiB
whatever the context length or prefill size.
"""


def check_common(name: str, caches: PagedKVCache, batch: BatchMetadata,
                 params: SparseAttentionParams) -> None:
    """Raise :class:`InputError` when caches, batch and params disagree on the basics."""
    if not isinstance(caches, PagedKVCache):
        raise InputError(f"cpu_ref.{name}: caches must be an mm3.PagedKVCache, got "
                         f"{type(caches).__name__}; wrap the tensors: PagedKVCache(k=..., v=..., index=...)")
    if not isinstance(batch, BatchMetadata):
        raise InputError(f"cpu_ref.{name}: batch must be an mm3.BatchMetadata (BatchMetadata.build(...)), "
                         f"got {type(batch).__name__}")
    if not (caches.block_size == batch.block_size == params.block_size):
        raise InputError(f"cpu_ref.{name}: block sizes disagree: cache pages hold {caches.block_size} "
                         f"tokens, batch.block_size={batch.block_size}, params.block_size="
                         f"{params.block_size}; the sparse block is the KV page, make them equal")
    if batch.device != caches.device:
        raise InputError(f"cpu_ref.{name}: batch tensors are on {batch.device} but the caches are on "
                         f"{caches.device}; move the batch with batch.to(device)")


def check_rows(name: str, what: str, t: torch.Tensor, num_tokens: int, tail: tuple[int, ...],
               device: torch.device, hint: str) -> None:
    """``t`` must be ``[>= num_tokens, *tail]`` on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"cpu_ref.{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 + len(tail) or tuple(t.shape[1:]) != tail or t.shape[0] < num_tokens:
        raise InputError(f"cpu_ref.{name}: {what} has shape {tuple(t.shape)}, expected "
                         f"[{num_tokens}, {', '.join(map(str, tail))}] {hint}")
    if t.device != device:
        raise InputError(f"cpu_ref.{name}: {what} is on {t.device} but the caches are on {device}")


def gather_pages(cache: torch.Tensor, block_table_rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` pages of each block-table row: ``[R, num_blocks, *page]``.

    Unused block-table entries may hold ``-1`` (or anything): they are clamped
    into the cache so the gather never goes out of bounds. Callers mask every
    position at or beyond a request's ``seq_len``, so those pages' contents
    never reach a result.
    """
    pages = block_table_rows[:, :num_blocks].to(torch.long).clamp(0, cache.shape[0] - 1)
    return cache[pages]
