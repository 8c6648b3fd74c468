"""Block-sparse attention (docs/spec.md §4) on ``torch.nn.functional.scaled_dot_product_attention``.

Two formulations compute the same thing; which one runs is only about speed:

* **gathered blocks** (decodes, and prefills with long contexts): for a chunk
  of ``C`` tokens, each (token, KV head) pair gathers the ``K`` blocks its
  top-k row selected, giving keys and values ``[C, Hkv, K*B, D]``; the ``G``
  query heads of that KV head attend to them in one batched SDPA call. Work
  per token is ``K*B`` keys whatever the context length.
* **masked request** (a prefill whose context is at most
  :data:`DENSE_MAX_BLOCKS_PER_TOPK` x ``topk`` blocks): the request's keys are
  gathered once and all its query tokens attend to them in one SDPA call whose
  ``[C, S]`` boolean mask keeps exactly each token's selected blocks. More
  FLOPs, no per-token copies: faster while the context is short.

Either way the mask keeps key ``j`` when its block is a valid selection (an
id in ``[0, nb)``, counted once) and ``j <= p``, the token's own position, and
accumulation is fp32.

The top-k buffer is read the way a raw-pointer kernel would read it: as dense
token-major ``[T, H, K]`` storage. That is why the plugin declares
``topk_layout="token_major"`` and ``topk_requires_contiguous=True``; when the
indexer writes another layout, mm3 converts the step's rows before calling
us, and says so in the selection trace.

mm3 checks every argument before a hook runs (``mm3.runtime.backend.Backend``): types,
shapes, devices, dtypes, the limits in ``CAPABILITIES`` - and, because we
declare ``topk_requires_contiguous``, that the buffer is dense token-major. So
this module checks only what is its own (``strategy``) and calls
:func:`attention_forward` directly only with arguments it knows are valid.

Example:
    >>> import torch
    >>> from mm3 import SparseAttentionParams
    >>> from mm3.testing.factories import make_case
    >>> from mm3.testing.oracle import oracle_attention, oracle_topk
    >>> p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[70, 33], prefills=[(9, 40)], dtype="float32")
    >>> sel = oracle_topk(case.index_q, case.caches, case.batch, p).to_layout("token_major")
    >>> out = torch.empty_like(case.q)
    >>> attention_forward(case.q, case.caches, sel, case.batch, p, out)
    >>> ref = oracle_attention(case.q, case.caches, sel, case.batch, p)
    >>> bool((out.double() - ref).abs().max() < 1e-5)
    True
"""

from __future__ import annotations

import os
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from mm3.contract import BatchMetadata
from mm3.contract import PagedKVCache, TopkBuffer
from mm3.contract import InputError
from mm3.contract import SparseAttentionParams

__all__ = ["attention_forward", "DEFAULT_MAX_ELEMENTS", "MAX_ELEMENTS_ENV", "DENSE_MAX_BLOCKS_PER_TOPK",
           "Strategy"]

Strategy = Literal["auto", "gather", "dense"]

DEFAULT_MAX_ELEMENTS = 1 << 24
"""Largest fp32 intermediate (elements; 64 MiB) one chunk of tokens may create."""

MAX_ELEMENTS_ENV = "MM3_TORCH_SDPA_SPARSE_MAX_ELEMENTS"
"""Overrides :data:`DEFAULT_MAX_ELEMENTS`. mm3 leaves ``MM3_<ENTRY POINT>_*``
variables to the plugin that owns the entry point, so this is not a config error."""

DENSE_MAX_BLOCKS_PER_TOPK = 20
"""``auto`` runs a prefill as one masked request while its blocks <= this many x ``topk``.

Measured on 2 CPU cores at MiniMax-M3 TP8 shapes (8 query heads, 1 KV head,
D = B = 128, top-16, bf16), 256 new tokens: masked request / gathered blocks
took 0.44 / 2.1 s on an 8K context, 0.59 / 1.2 s on 20K, 1.4 / 1.3 s on 40K.
Gathering costs a fixed ``K*B`` keys per token but copies them per token; the
masked request is one fused SDPA over the whole context.
"""


def _max_elements() -> int:
    raw = os.environ.get(MAX_ELEMENTS_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_MAX_ELEMENTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InputError(f"{MAX_ELEMENTS_ENV}={raw!r} must be a positive integer (elements of the "
                         f"largest fp32 intermediate, default {DEFAULT_MAX_ELEMENTS}); fix or unset it")
    return value


def _valid_ids(ids: torch.Tensor, nb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted ids and the mask of those that select a block: in ``[0, nb)`` and not repeated."""
    ids = ids.sort(dim=-1).values
    valid = (ids >= 0) & (ids < nb)
    # The contract says ids are unique, but a duplicate must not double a block's weight.
    valid[..., 1:] &= ids[..., 1:] != ids[..., :-1]
    return ids, valid


def _sdpa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, keep: torch.Tensor,
          scale: float) -> torch.Tensor:
    """``softmax(scale * q k^T) v`` over the kept keys; a row that keeps no key is zero.

    ``keys``/``vals`` must already be zero wherever no query keeps them.
    """
    o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=keep, scale=scale)
    # docs/spec.md §4: a row with nothing to attend to is zero. SDPA implementations disagree on fully
    # masked rows (zeros or NaN), so do not rely on one.
    return torch.where(keep.any(dim=-1, keepdim=True), o, 0.0)


def _attend_gathered(q: torch.Tensor, pos: torch.Tensor, req: torch.Tensor, ids: torch.Tensor,
                     caches: PagedKVCache, block_table: torch.Tensor,
                     params: SparseAttentionParams) -> torch.Tensor:
    """``C`` tokens of any requests: ``q`` ``[C, Hq, D]``, ``ids`` ``[C, Hkv, K]``; fp32 ``[C, Hq, D]``."""
    C, Hq, D = q.shape
    Hkv, K = ids.shape[1], ids.shape[2]
    B, G = params.block_size, params.gqa_group
    dev = q.device
    # A padding token has position -1, so nb = 0 and no id is valid for it.
    nb = (torch.div(pos, B, rounding_mode="floor") + 1).view(C, 1, 1)
    ids, valid = _valid_ids(ids, nb)
    safe = torch.where(valid, ids, 0)
    # Unused block-table entries may hold -1: clamp so the gather stays in bounds; masked below.
    pages = block_table[req.view(C, 1, 1), safe].to(torch.long).clamp_(0, caches.num_pages - 1)
    head = torch.arange(Hkv, device=dev).view(1, Hkv, 1)
    keys = caches.k[pages, :, head].float().reshape(C, Hkv, K * B, D)      # [C, Hkv, K*B, D]
    vals = caches.v[pages, :, head].float().reshape(C, Hkv, K * B, D)
    j = safe.unsqueeze(-1) * B + torch.arange(B, device=dev)                # absolute key positions
    keep = (valid.unsqueeze(-1) & (j <= pos.view(C, 1, 1, 1))).reshape(C, Hkv, 1, K * B)
    # Slots past seq_len were never written; zero them so a stray NaN cannot leak through 0 * NaN
    # (SDPA adds -inf to masked logits, and NaN + -inf is NaN).
    drop = ~keep.transpose(2, 3)
    keys.masked_fill_(drop, 0.0)
    vals.masked_fill_(drop, 0.0)
    o = _sdpa(q.float().reshape(C, Hkv, G, D), keys, vals, keep, params.softmax_scale)
    return o.reshape(C, Hq, D)


def _attend_masked_request(q: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor,
                           vals: torch.Tensor, params: SparseAttentionParams) -> torch.Tensor:
    """``C`` tokens of one request against its first ``S`` keys (``[Hkv, S, D]``, fp32, zero past
    ``seq_len``), masked to each token's selection; ``ids`` ``[C, Hkv, K]``; fp32 ``[C, Hq, D]``."""
    C, Hq, D = q.shape
    Hkv, S = keys.shape[0], keys.shape[1]
    B, G = params.block_size, params.gqa_group
    nblk = S // B
    nb = (torch.div(pos, B, rounding_mode="floor") + 1).view(C, 1, 1)
    ids, valid = _valid_ids(ids, nb)
    chosen = torch.zeros(C, Hkv, nblk + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(2, torch.where(valid, ids, nblk), True)      # invalid ids land in a spare column
    keep = chosen[..., :nblk].repeat_interleave(B, dim=-1)       # [C, Hkv, S]
    keep &= torch.arange(S, device=q.device) <= pos.view(C, 1, 1)
    keep = keep.permute(1, 0, 2).unsqueeze(1)                     # [Hkv, 1, C, S]
    qh = q.float().reshape(C, Hkv, G, D).permute(1, 2, 0, 3)       # [Hkv, G, C, D]
    # The G query heads share their KV head: expand (a view, no copy) instead of repeating.
    o = _sdpa(qh, keys.unsqueeze(1).expand(Hkv, G, S, D), vals.unsqueeze(1).expand(Hkv, G, S, D),
              keep, params.softmax_scale)                         # [Hkv, G, C, D]
    return o.permute(2, 0, 1, 3).reshape(C, Hq, D)


@torch.no_grad()
def attention_forward(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                      params: SparseAttentionParams, out: torch.Tensor, *, strategy: Strategy = "auto",
                      max_elements: Optional[int] = None) -> None:
    """Write the block-sparse attention of the step's ``T`` tokens into ``out[:T]``.

    ``topk`` must be a dense token-major buffer with at least ``T`` rows; rows of
    ``out`` past ``T`` are never touched. Accumulation is fp32 whatever q's dtype;
    the result is cast to ``out``'s dtype. ``strategy`` forces one formulation
    (``"gather"`` or ``"dense"``; tests use it); ``max_elements`` bounds the largest
    fp32 intermediate (default: ``MM3_TORCH_SDPA_SPARSE_MAX_ELEMENTS`` or 2**24).
    """
    # mm3 checked every argument before calling us (see the module docstring).
    if strategy not in ("auto", "gather", "dense"):
        raise InputError(f"torch_sdpa_sparse.attention_forward: strategy must be 'auto', 'gather' or "
                         f"'dense', got {strategy!r}")
    T = batch.num_tokens
    if T == 0:
        return
    budget = max_elements if max_elements is not None else _max_elements()
    Hq, Hkv, D, B, G = (params.num_heads, params.num_kv_heads, params.head_dim, params.block_size,
                        params.gqa_group)
    K = topk.topk
    ids_all = topk.storage                                   # dense [capacity, Hkv, K]: read it raw
    positions = batch.token_positions.to(torch.long)
    requests = batch.token_to_request.to(torch.long)
    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)

    def gathered(a: int, b: int) -> None:
        chunk = max(1, budget // (Hkv * K * B * max(D, G)))
        for s in range(a, b, chunk):
            e = min(b, s + chunk)
            o = _attend_gathered(q[s:e], positions[s:e], requests[s:e], ids_all[s:e].to(torch.long),
                                 caches, batch.block_table, params)
            out[s:e] = o.to(out.dtype)

    def masked_request(r: int) -> None:
        a, b = starts[r], starts[r + 1]
        seq = batch.seq_lens_host[r]
        nblk = -(-seq // B)
        pages = batch.block_table[r, :nblk].to(torch.long)
        # [nblk, B, Hkv, D] -> [Hkv, nblk*B, D]; works for NHD and HND page storage alike.
        keys = caches.k[pages].float().reshape(nblk * B, Hkv, D).permute(1, 0, 2).contiguous()
        vals = caches.v[pages].float().reshape(nblk * B, Hkv, D).permute(1, 0, 2).contiguous()
        keys[:, seq:] = 0.0  # never written: keep NaN garbage out of the matmuls
        vals[:, seq:] = 0.0
        ctx = seq - (b - a)
        chunk = max(1, budget // (Hq * nblk * B))
        for s in range(a, b, chunk):
            e = min(b, s + chunk)
            S = ((ctx + (e - a) - 1) // B + 1) * B            # keys up to the chunk's last block
            o = _attend_masked_request(q[s:e], positions[s:e], ids_all[s:e].to(torch.long),
                                       keys[:, :S], vals[:, :S], params)
            out[s:e] = o.to(out.dtype)

    nd = batch.num_decode_tokens
    if nd:
        gathered(0, nd)  # decodes attend to K*B keys each: gathering is always cheaper
    for r in range(batch.num_decodes, batch.num_requests):
        nblk = -(-batch.seq_lens_host[r] // B)
        if strategy == "dense" or (strategy == "auto" and nblk <= DENSE_MAX_BLOCKS_PER_TOPK * K):
            masked_request(r)
        else:
            gathered(starts[r], starts[r + 1])
