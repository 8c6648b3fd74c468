"""Reference indexer (docs/spec.md §3): per token and index head, the top-k blocks of its context, or
the block scores the top-k is chosen from (``index_scores``, §3.6).

Vectorized over tokens: one batched matmul scores a chunk of query tokens
against every visible index key of their request(s), a reshape + ``amax``
turns token scores into block scores, and a stable sort picks the blocks (exact ties:
the lowest block id).
Work is split into *items* so the ``[tokens, heads, keys]`` score tensor stays
under a fixed element budget:

* real decodes are grouped several requests at a time (each contributes its
  ``decode_query_len`` tokens; keys are padded to the longest request in the
  group and masked);
* each prefill is split into chunks of query tokens; a chunk only scores the
  keys up to its last token's position (causality), so early chunks of a long
  prompt are cheaper.

Padding tokens (position ``-1``) and empty decodes are never scored: their rows
are filled with ``-1`` first.

Example:
    >>> import torch
    >>> from mm3 import SparseAttentionParams, TopkBuffer
    >>> from mm3.testing.factories import make_case
    >>> p = SparseAttentionParams(num_heads=2, num_kv_heads=1, head_dim=16,
    ...     num_index_heads=1, index_head_dim=16, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[100], prefills=[(5, 40)], dtype="float32")
    >>> out = TopkBuffer.allocate(case.batch.num_tokens, 1, 4)
    >>> index_topk(case.index_q, case.caches, case.batch, p, out)
    >>> out.head_major()[0, 1].tolist()     # first prefill token, position 35: 3 visible blocks
    [2, 0, 1, -1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

import torch

from mm3.plugin import BatchMetadata
from mm3.plugin import PagedKVCache, TopkBuffer
from mm3.plugin import SparseAttentionParams

from ._common import DEFAULT_MAX_ELEMENTS, first_blocks, widened

__all__ = ["index_topk", "index_scores", "FORCED_INIT", "FORCED_LOCAL", "NAN_SCORE"]

FORCED_INIT = 1e30
FORCED_LOCAL = 1e29
NAN_SCORE = -1e30
# Real scores are clamped into [_FLOOR, _CEIL] before forcing so that
# (a) a +inf / huge score can never outrank a forced block, and (b) a genuine
# -inf score still ranks above blocks a token cannot see (kept at -inf), so
# topk never returns an ineligible block even when every visible score is -inf.
_CEIL = 1e28
_FLOOR = -3.0e38


@dataclass(frozen=True)
class _Item:
    """One unit of work: ``len(requests)`` requests x ``num_tokens`` consecutive tokens each."""

    requests: tuple[int, ...]
    token_starts: tuple[int, ...]   # flat batch index of each request's first token in this item
    first_positions: tuple[int, ...]  # absolute position of that token
    num_tokens: int
    num_blocks: int                 # key blocks to gather (covers the last token of every request)


def _plan(batch: BatchMetadata, num_heads: int, head_dim: int, max_elements: int) -> Iterator[_Item]:
    """Split the step into items whose score + key tensors fit ``max_elements``."""
    B = batch.block_size
    starts = [0]
    for q in batch.query_lens:
        starts.append(starts[-1] + q)

    # Decodes: all real ones have the same query length, so they batch cleanly.
    group: list[int] = []
    group_blocks = 0
    C = batch.decode_query_len

    def cost(n_req: int, n_blocks: int) -> int:
        return n_req * n_blocks * B * (C * num_heads + head_dim)

    def flush() -> Iterator[_Item]:
        if group:
            yield _Item(tuple(group), tuple(starts[r] for r in group),
                        tuple(batch.seq_lens_host[r] - C for r in group), C, group_blocks)

    for r in range(batch.num_decodes):
        q, s = batch.query_lens[r], batch.seq_lens_host[r]
        if q == 0 or s == 0:
            continue  # padding decode: its rows stay -1
        nblk = -(-s // B)
        if group and cost(len(group) + 1, max(group_blocks, nblk)) > max_elements:
            yield from flush()
            group, group_blocks = [], 0
        group.append(r)
        group_blocks = max(group_blocks, nblk)
    yield from flush()

    # Prefills: chunks of query tokens; a chunk needs keys up to its last token only.
    for r in range(batch.num_decodes, batch.num_requests):
        q, s = batch.query_lens[r], batch.seq_lens_host[r]
        ctx = s - q
        keys = -(-s // B) * B
        chunk = max(1, max_elements // (num_heads * keys + head_dim))
        for i in range(0, q, chunk):
            n = min(chunk, q - i)
            last = ctx + i + n - 1
            yield _Item((r,), (starts[r] + i,), (ctx + i,), n, last // B + 1)


def _block_max(iq: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block maxima ``[G, C, H, nbmax]`` of queries ``iq`` ``[G, C, H, Di]``: docs/spec.md §3.3's S before §3.4.

    ``pos`` ``[G, C]`` are the queries' absolute positions (all >= 0);
    ``keys`` ``[G, S, Di]`` are their requests' index keys, ``S`` a multiple of
    the block size; keys past a query's position are masked, whatever they hold,
    so a block with no visible key is ``-inf`` and a NaN at a visible key makes
    its block NaN.
    """
    G, C, H, Di = iq.shape
    S = keys.shape[1]
    scores = torch.matmul(iq.reshape(G, C * H, Di), keys.transpose(1, 2)).view(G, C, H, S)
    visible = torch.arange(S, device=iq.device).view(1, 1, 1, S) <= pos.view(G, C, 1, 1)
    # where(), not an additive mask: keys past seq_len may hold NaN/garbage.
    scores = torch.where(visible, scores, float("-inf"))
    return scores.view(G, C, H, S // block_size, block_size).amax(dim=-1)  # NaN propagates: handled next


def _forced(block: torch.Tensor, pos: torch.Tensor, params: SparseAttentionParams) -> torch.Tensor:
    """``block`` ``[n, H, nbmax]`` of tokens at ``pos`` ``[n]`` with docs/spec.md §3.4's forced blocks set and
    ``-inf`` past each token's visible blocks."""
    b = torch.arange(block.shape[-1], device=block.device).view(1, 1, -1)
    nb = (pos // params.block_size + 1).view(-1, 1, 1)
    eligible = b < nb
    block = torch.where(eligible & (b < params.init_blocks), FORCED_INIT, block)
    block = torch.where(eligible & (b >= nb - params.local_blocks), FORCED_LOCAL, block)
    return torch.where(eligible, block, float("-inf"))


def _select(block: torch.Tensor, pos: torch.Tensor, params: SparseAttentionParams) -> torch.Tensor:
    """Top-k block ids ``[n, H, K]`` (int32, -1 padded) from the block maxima ``[n, H, nbmax]`` of tokens at
    ``pos`` ``[n]``."""
    n, H, nbmax = block.shape
    K = params.topk
    block = torch.nan_to_num(block, nan=NAN_SCORE, posinf=_CEIL, neginf=_FLOOR).clamp_(_FLOOR, _CEIL)
    block = _forced(block, pos, params)
    kk = min(K, nbmax)
    # Exact ties go to the lowest block id (docs/spec.md §3.5): a stable descending sort keeps
    # equal scores in block order, which torch.topk does not promise.
    ids = torch.sort(block, dim=-1, descending=True, stable=True).indices[..., :kk]   # [n, H, kk]
    slot = torch.arange(kk, device=block.device).view(1, 1, kk)
    nb = (pos // params.block_size + 1).view(-1, 1, 1)
    ids = torch.where(slot < torch.clamp(nb, max=K), ids, -1).to(torch.int32)
    if kk < K:
        ids = torch.cat([ids, ids.new_full((n, H, K - kk), -1)], dim=-1)
    return ids


def _scored(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata, params: SparseAttentionParams,
            max_elements: int) -> Iterator[tuple[Union[slice, torch.Tensor], torch.Tensor, torch.Tensor]]:
    """Per work item of the step: ``(its tokens, their positions [n], their block maxima [n, H, nbmax])``
    (:func:`_block_max`); padding tokens and empty decodes are in no item."""
    H, Di, B = params.num_index_heads, params.index_head_dim, params.block_size
    dev = caches.device
    for item in _plan(batch, H, Di, max_elements):
        C = item.num_tokens
        ar = torch.arange(C, device=dev)
        rows = torch.tensor(item.requests, device=dev)
        pos = torch.tensor(item.first_positions, device=dev).view(-1, 1) + ar
        keys = widened(caches.index, caches.index_block_scale,
                       lambda t: first_blocks(t, batch, rows, item.num_blocks, caches))   # NVFP4: unpacked
        keys = keys.reshape(len(item.requests), item.num_blocks * B, Di)
        G = len(item.requests)
        if G == 1:
            a = item.token_starts[0]
            tok: Union[slice, torch.Tensor] = slice(a, a + C)
            iq = index_q[a:a + C].float().unsqueeze(0)
        else:
            tok = (torch.tensor(item.token_starts, device=dev).view(-1, 1) + ar).view(-1)
            iq = index_q[tok].float().reshape(G, C, H, Di)
        block = _block_max(iq, pos, keys, B)
        yield tok, pos.view(-1), block.view(G * C, H, -1)


@torch.no_grad()
def index_topk(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
               params: SparseAttentionParams, out: TopkBuffer, *,
               max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
    """Write the top-k selection of the step's ``T`` tokens into rows ``[0, T)`` of ``out``.

    ``out`` may be in either layout and any strides (it is written through its
    ``head_major()`` view); rows at and past ``T`` are never touched.
    Scores accumulate in fp32; ``params.index_scale`` is positive and does not
    change the ranking (docs/spec.md §3.2), so it is not applied. ``max_elements``
    bounds the largest intermediate tensor (see :data:`DEFAULT_MAX_ELEMENTS`).
    """
    # The bound backend (mm3.runtime.backend.Backend) has checked every argument against the contract.
    view = out.head_major()[:, :batch.num_tokens]  # [H, T, K]; a view, so writes land in out's storage
    view.fill_(-1)
    for tok, pos, block in _scored(index_q, caches, batch, params, max_elements):
        view[:, tok] = _select(block, pos, params).permute(1, 0, 2)


@torch.no_grad()
def index_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                 params: SparseAttentionParams, out: torch.Tensor, *,
                 max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
    """Write the block scores of the step's ``T`` tokens (docs/spec.md §3.6) into ``out`` ``[H, T, N]``.

    The block maxima :func:`index_topk` selects from, with ``params.index_scale``
    applied, a NaN block at ``-1e30`` and the forced blocks set; ``-inf`` in every
    column a token does not see and in every column of a padding token.
    """
    N = out.shape[-1]
    out.fill_(float("-inf"))
    for tok, pos, block in _scored(index_q, caches, batch, params, max_elements):
        w = min(N, block.shape[-1])
        S = torch.where(torch.isnan(block), NAN_SCORE, block * params.index_scale)
        out[:, tok, :w] = _forced(S, pos, params)[..., :w].permute(1, 0, 2)
