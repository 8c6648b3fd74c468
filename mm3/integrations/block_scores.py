"""Index block scores as a tensor, and the top-k chosen from such a tensor (docs/spec.md §3).

mm3's indexers are fused: a backend's ``index_topk`` scores the blocks and keeps
the top-k in one pass. Engines whose ops hand a score tensor from one op to the
next (vLLM's ``minimax_m3_index_score`` -> ``minimax_m3_index_topk``) get the
scores from the selected backend's optional ``index_scores`` op, and from
:func:`block_scores` here where that backend has none: plain torch on whatever
device the inputs live on, float32 accumulation, the values docs/spec.md §3.6
asks of the op, fixed shapes from the host ints the caller passes (no
device-to-host copy, so it can be captured in a CUDA graph). It is a
reference-speed path: every query row is scored against every position of its
request up to ``num_blocks`` blocks, in chunks of bounded size.

Example:
    >>> import torch
    >>> from mm3 import SparseAttentionParams
    >>> from mm3.testing.factories import make_case
    >>> from mm3.testing.oracle import oracle_topk
    >>> p = SparseAttentionParams(num_heads=2, num_kv_heads=2, head_dim=16, num_index_heads=2,
    ...                           index_head_dim=16, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[70, 33], prefills=[(9, 40)], dtype="float32")
    >>> b = case.batch
    >>> s = block_scores(case.index_q, case.caches.index, b, num_blocks=5, max_query_len=9)
    >>> s.shape
    torch.Size([2, 11, 16])
    >>> out = torch.empty(2, 11, 4, dtype=torch.int32)
    >>> select_topk(s, b.token_positions, out, block_size=16, init_blocks=0, local_blocks=1)
    >>> want = oracle_topk(case.index_q, case.caches, b, p).head_major()
    >>> bool((out.sort(-1).values == want.sort(-1).values).all())
    True
"""

from __future__ import annotations

from typing import Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.testing.oracle import FORCED_INIT, FORCED_LOCAL, NAN_SCORE   # docs/spec.md §3.4's values

__all__ = ["block_scores", "select_topk", "score_width"]

#: fp32 elements of the largest intermediate (the logits of a chunk): 64 MiB
MAX_ELEMENTS = 1 << 24


def score_width(num_blocks: int) -> int:
    """Columns of a score tensor for ``num_blocks`` blocks: a multiple of 16 (so kernels that read
    it by strides keep aligned rows, as vLLM's allocation does)."""
    return max(16, -(-num_blocks // 16) * 16)


def _forced(S: torch.Tensor, nb: torch.Tensor, init_blocks: int, local_blocks: int) -> torch.Tensor:
    """``S`` ``[..., N]`` with the forced blocks of each row set (docs/spec.md §3.4; ``nb`` ``[...]``:
    the row's visible blocks). Local wins over init, as it is applied last."""
    b = torch.arange(S.shape[-1], device=S.device)
    nb = nb.unsqueeze(-1)
    visible = b < nb
    S = torch.where(visible & (b < init_blocks), FORCED_INIT, S)
    return torch.where(visible & (b >= nb - local_blocks), FORCED_LOCAL, S)


def block_scores(index_q: torch.Tensor, index_cache: torch.Tensor, batch: BatchMetadata, *, num_blocks: int,
                 max_query_len: int, forced: Optional[tuple[int, int]] = None,
                 max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """``S[h, t, b]``: the max over the positions ``j <= p(t)`` of block ``b`` of ``<index_q[t, h], key(j)>``.

    A ``[H, T, score_width(num_blocks)]`` float32 tensor: ``-inf`` where a block
    has no visible position (blocks past the token's own, padding tokens,
    columns past ``num_blocks``); a NaN at a visible position makes its block
    ``-1e30`` (docs/spec.md §3.4). ``forced=(init_blocks, local_blocks)`` sets the
    forced blocks of each token to ``1e30`` / ``1e29``, as a decode scorer whose
    output feeds a top-k directly does. ``max_query_len`` bounds every
    request's query length (the rows scored per request).
    """
    T, H, Di = index_q.shape
    P, B = index_cache.shape[:2]
    R = batch.num_requests
    W = max(0, min(num_blocks, batch.block_table.shape[1]))
    dev = index_q.device
    # row T is where the padding rows of a chunk (past a request's last token) write
    out = torch.full((H, T + 1, score_width(num_blocks)), float("-inf"), dtype=torch.float32, device=dev)
    if R == 0 or W == 0 or T == 0:
        return out[:, :T]
    pos_pad = torch.cat([batch.token_positions, batch.token_positions.new_full((1,), -1)])
    q_pad = torch.cat([index_q.float(), index_q.new_zeros((1, H, Di), dtype=torch.float32)])
    qmax = max(1, max_query_len)
    per_row = H * W * B
    qc = max(1, min(qmax, max_elements // per_row))
    rc = max(1, min(R, max_elements // (qc * per_row)))
    j = torch.arange(W * B, device=dev)
    starts = batch.query_start_loc.to(torch.long)
    for r0 in range(0, R, rc):
        n = min(rc, R - r0)
        pages = batch.block_table[r0:r0 + n, :W].to(torch.long).clamp(0, P - 1)
        keys = index_cache[pages].float().reshape(n, W * B, Di)                    # [n, W*B, Di]
        first, end = starts[r0:r0 + n, None], starts[r0 + 1:r0 + n + 1, None]
        for q0 in range(0, qmax, qc):
            m = min(qc, qmax - q0)
            tok = first + torch.arange(q0, q0 + m, device=dev)                       # [n, m]
            tok = torch.where(tok < end, tok, T)
            pos = pos_pad[tok]
            logits = torch.matmul(q_pad[tok].reshape(n, m * H, Di), keys.transpose(1, 2)).view(n, m, H, W * B)
            logits.masked_fill_((j > pos[..., None])[:, :, None, :], float("-inf"))
            S = logits.view(n, m, H, W, B).amax(dim=-1)                              # NaN propagates
            S = torch.where(torch.isnan(S), NAN_SCORE, S)
            if forced is not None:
                S = _forced(S, (pos // B + 1).clamp_(min=0)[..., None], *forced)
            out[:, :, :W].index_copy_(1, tok.flatten(), S.reshape(n * m, H, W).transpose(0, 1))
    return out[:, :T]


def select_topk(scores: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, *, block_size: int,
                init_blocks: int, local_blocks: int) -> None:
    """Write into ``out`` (``[H, T, K]`` int32, any strides) the top-k blocks of ``scores`` (``[H, T, N]``).

    docs/spec.md §3.4-3.5 on the given scores: token ``t`` at ``positions[t]`` sees
    ``nb = p // block_size + 1`` blocks (none for a padding token, ``-1``); columns
    from ``nb`` on are ignored whatever they hold; a NaN scores ``-1e30``; the
    forced blocks are set; then the ``min(K, nb)`` highest, equal scores to the
    lowest block id, fill the row's first slots and ``-1`` the rest. The order
    of the ids is by score, highest first.
    """
    H, T, N = scores.shape
    K = out.shape[-1]
    nb = (positions.to(torch.long) // block_size + 1).clamp_(min=0)                  # [T]
    S = torch.where(torch.isnan(scores), NAN_SCORE, scores.float())
    S = _forced(S, nb[None, :], init_blocks, local_blocks)
    S = S.masked_fill(torch.arange(N, device=S.device) >= nb[:, None], float("-inf"))
    k = min(K, N)
    order = torch.sort(S, dim=-1, descending=True, stable=True).indices[..., :k]     # [H, T, k]
    ids = torch.where(torch.arange(k, device=S.device) < nb[:, None], order, -1)
    out[..., :k].copy_(ids)
    if k < K:
        out[..., k:].fill_(-1)
