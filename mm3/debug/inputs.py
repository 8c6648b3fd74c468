"""Input data the backends cannot check cheaply: block-table entries, finiteness of a row's inputs."""

from __future__ import annotations

import threading
from typing import Any

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache
from mm3.contract.errors import InputError
from mm3.contract.params import SparseAttentionParams

__all__ = ["check_block_table", "finite_inputs"]


# Largest intermediate (elements) of the lazy non-finite attribution; it only
# runs when an output is non-finite, but must not blow up memory on a big step.
_ATTRIBUTION_BUDGET = 1 << 24


class _CheckedTables:
    """The block tables already checked, so a step's indexer and attention check once.

    A key holds the tensors themselves (so their ids cannot be reused while
    cached) and their in-place version counters (``update_`` for a graph
    replay bumps them, forcing a new check).
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._keys: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()

    @staticmethod
    def key(batch: BatchMetadata, caches: PagedKVCache) -> tuple[Any, ...]:
        bt, sl = batch.block_table, batch.seq_lens
        return (bt, bt._version, sl, sl._version, batch.block_size, caches.num_pages)

    def seen(self, key: tuple[Any, ...]) -> bool:
        with self._lock:
            return any(len(k) == len(key) and all(a is b if isinstance(a, torch.Tensor) else a == b
                                                   for a, b in zip(k, key)) for k in self._keys)

    def add(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._keys = [key, *self._keys][: self._size]


_CHECKED = _CheckedTables()


def check_block_table(batch: BatchMetadata, caches: PagedKVCache) -> None:
    """Raise :class:`InputError` when a request uses a block-table entry that is not a page id.

    :meth:`BatchMetadata.build` checks this when given ``num_pages``; the guard
    checks every batch it sees (once, however many hooks get it), because a
    kernel would read out of bounds. One host sync.
    """
    if batch.num_requests == 0 or batch.block_table.shape[1] == 0:
        return
    key = _CheckedTables.key(batch, caches)
    if _CHECKED.seen(key):
        return
    _check_block_table(batch, caches)
    _CHECKED.add(key)


def _check_block_table(batch: BatchMetadata, caches: PagedKVCache) -> None:
    need = (batch.seq_lens.to(torch.int64) + batch.block_size - 1) // batch.block_size  # [R]
    cols = torch.arange(batch.block_table.shape[1], device=batch.block_table.device)
    used = cols[None, :] < need[:, None]
    bt = batch.block_table.to(torch.int64)
    bad = used & ((bt < 0) | (bt >= caches.num_pages))
    if not bool(bad.any()):
        return
    r, b = (int(v) for v in bad.nonzero()[0])
    raise InputError(
        f"request {r}: block_table[{r}, {b}] = {int(bt[r, b])} is not a page id in [0, "
        f"{caches.num_pages}) (seq_len {int(batch.seq_lens[r])} uses {int(need[r])} blocks); "
        f"the cache has {caches.num_pages} pages. Build the batch with "
        f"BatchMetadata.build(..., num_pages=caches.num_pages) to catch this early")


# -- non-finite output attribution (slow path) --------------------------------------------------

def finite_inputs(q: torch.Tensor, caches: PagedKVCache, hm: torch.Tensor, batch: BatchMetadata,
                   params: SparseAttentionParams, tok: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Per (token, query head) pair: are all inputs of that output row finite? ``[n]`` bool.

    The inputs of ``out[t, g]`` are ``q[t, g]`` and the K/V rows of KV head
    ``g // G`` at the positions ``j <= p`` of the blocks selected for ``(h, t)``.
    """
    B, G, K = params.block_size, params.gqa_group, params.topk
    D = q.shape[-1]
    per_pair = max(1, K * B * D * 2)
    chunk = max(1, _ATTRIBUTION_BUDGET // per_pair)
    out = []
    for s in range(0, tok.numel(), chunk):
        t, g = tok[s:s + chunk], qh[s:s + chunk]
        h = torch.div(g, G, rounding_mode="floor")
        q_ok = torch.isfinite(q[t, g].float()).all(-1)
        ids = hm[h, t].to(torch.int64)                               # [n, K]
        r = batch.token_to_request[t].to(torch.int64)
        p = batch.token_positions[t].to(torch.int64)
        valid = ids >= 0
        # (ids past the table are clamped: their positions lie past the token and are masked below)
        cols = ids.clamp(0, batch.block_table.shape[1] - 1)
        pages = batch.block_table.to(torch.int64)[r[:, None], cols]
        pages = pages.clamp(0, caches.num_pages - 1)
        # Advanced indices separated by a slice: result is [n, K, B, D].
        kh = caches.k[pages, :, h[:, None]].float()
        vh = caches.v[pages, :, h[:, None]].float()
        pos = ids[:, :, None] * B + torch.arange(B, device=ids.device)[None, None, :]
        used = valid[:, :, None] & (pos <= p[:, None, None])        # [n, K, B]
        fin = torch.isfinite(kh).all(-1) & torch.isfinite(vh).all(-1)
        out.append(q_ok & (fin | ~used).all(-1).all(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=q.device)
