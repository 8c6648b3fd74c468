"""Input data the backends cannot check cheaply: the finiteness of an output row's inputs."""

from __future__ import annotations

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache
from mm3.contract.params import SparseAttentionParams
from mm3.contract.slots import key_rows

__all__ = ["finite_inputs"]


# Largest intermediate (elements) of the lazy non-finite attribution; it only
# runs when an output is non-finite, but must not blow up memory on a big step.
_ATTRIBUTION_BUDGET = 1 << 24


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
        pos = ids[:, :, None] * B + torch.arange(B, device=ids.device)[None, None, :]
        # each key's cache row through the batch's pages or token slots (ids past the table are clamped:
        # their positions lie past the token and are masked below)
        Bc = caches.block_size
        rows = key_rows(batch, r[:, None, None], pos.clamp(min=0), caches.num_pages * Bc, Bc)   # [n, K, B]
        kh = caches.k[rows // Bc, rows % Bc, h[:, None, None]].float()                       # [n, K, B, D]
        vh = caches.v[rows // Bc, rows % Bc, h[:, None, None]].float()
        used = valid[:, :, None] & (pos <= p[:, None, None])        # [n, K, B]
        fin = torch.isfinite(kh).all(-1) & torch.isfinite(vh).all(-1)
        out.append(q_ok & (fin | ~used).all(-1).all(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=q.device)
