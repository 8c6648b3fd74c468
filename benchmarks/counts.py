"""Minimal bytes and FLOPs of one step: the floors every timing is compared against.

"Minimal" means each input read once and each output written once, no
intermediate traffic: the index keys of every visible token, the K/V of the
*distinct* blocks the selection actually picked (counted from the selection
itself, so speculative rows that share blocks are not double-counted), the
queries, the outputs and the block-table entries used. The top-k buffer is an
intermediate of the whole step (a fused step would not need it); it is
counted for the indexer alone (written) and the attention alone (read).

FLOPs count multiply-adds as two operations, and only the work the math
needs: ``2 * Di`` per (token, index head, visible key) for the indexer and
``4 * D`` per (token, query head, attended key) for the attention (Q.K and
P.V). Dense attention FLOPs count every causally visible key.

Example:
    >>> from mm3.contract import SparseAttentionParams
    >>> p = SparseAttentionParams.minimax_m3(tp_size=1)
    >>> b = decode_bytes(p, batch=64, context=65536, qlen=1, index_elt=2, kv_elt=2,
    ...                  kv_tokens=64 * 4 * 16 * 128)
    >>> round(b["index_keys"] / 1e9, 3), round(b["kv"] / 1e6, 1), round(b["step"] / 1e9, 3)
    (1.074, 268.4, 1.344)
"""

from __future__ import annotations

from typing import Optional

import torch

from mm3.contract import SparseAttentionParams

__all__ = ["decode_bytes", "distinct_kv_tokens", "prefill_counts", "attended_keys"]


def decode_bytes(p: SparseAttentionParams, *, batch: int, context: int, qlen: int, index_elt: int,
                 kv_elt: int, kv_tokens: int, q_elt: Optional[int] = None) -> dict[str, int]:
    """Fewest bytes of a decode step of ``batch`` requests of ``context`` tokens (query length ``qlen``).

    ``kv_tokens`` = sum over (request, KV head) of the visible tokens in the
    distinct selected blocks (:func:`distinct_kv_tokens`).
    """
    q_elt = kv_elt if q_elt is None else q_elt
    T = batch * qlen
    nb = -(-context // p.block_size)
    index_keys = batch * context * p.index_head_dim * index_elt
    index_q = T * p.num_index_heads * p.index_head_dim * q_elt
    topk = T * p.num_index_heads * p.topk * 4
    table = batch * nb * 4
    kv = kv_tokens * p.head_dim * 2 * kv_elt
    q_out = 2 * T * p.num_heads * p.head_dim * q_elt
    return {
        "index_keys": index_keys, "index_q": index_q, "topk": topk, "block_table": table,
        "kv": kv, "q_out": q_out,
        "indexer": index_keys + index_q + topk + table,
        "attention": kv + q_out + topk,
        "step": index_keys + index_q + table + kv + q_out,
    }


def _valid_ids(sel_hm: torch.Tensor) -> torch.Tensor:
    return sel_hm >= 0


def distinct_kv_tokens(sel_hm: torch.Tensor, seq_lens: torch.Tensor, qlen: int, block_size: int) -> int:
    """Visible tokens in the distinct blocks each (request, KV head) selected, summed.

    ``sel_hm``: the decode rows of a top-k buffer, head-major ``[H, R * qlen, K]``
    (request ``r`` owns rows ``r*qlen .. r*qlen+qlen-1``); ``seq_lens`` ``[R]``.
    """
    H, T, K = sel_hm.shape
    R = T // qlen
    ids = sel_hm.reshape(H, R, qlen * K).long()
    nbmax = int(ids.max().item()) + 1 if ids.numel() else 1
    valid = ids >= 0
    req = torch.arange(R, device=ids.device).view(1, R, 1).expand_as(ids)
    head = torch.arange(H, device=ids.device).view(H, 1, 1).expand_as(ids)
    key = (head * R + req) * nbmax + ids.clamp(min=0)
    uniq = torch.unique(key[valid])
    r = (uniq // nbmax) % R
    b = uniq % nbmax
    vis = (seq_lens.to(ids.device).long()[r] - b * block_size).clamp(min=0, max=block_size)
    return int(vis.sum().item())


def attended_keys(sel_hm: torch.Tensor, positions: torch.Tensor, block_size: int) -> int:
    """Sum over (KV head, token, selected block) of the keys ``j <= p`` in that block."""
    ids = sel_hm.long()
    pos = positions.to(ids.device).long().view(1, -1, 1)
    vis = (pos - ids * block_size + 1).clamp(min=0, max=block_size)
    return int(torch.where(ids >= 0, vis, 0).sum().item())


def prefill_counts(p: SparseAttentionParams, sel_hm: torch.Tensor, positions: torch.Tensor, *,
                   index_elt: int, kv_elt: int, q_elt: int = 2) -> dict[str, float]:
    """FLOPs and minimal bytes of one prefill chunk, from its selection ``[H, T, K]`` and positions ``[T]``.

    ``positions`` are absolute (context + i). Returns indexer FLOPs, sparse
    attention FLOPs, dense causal FLOPs (what full attention over the same
    tokens would do) and minimal bytes of each part.
    """
    pos = positions.long()
    T = int(pos.numel())
    visible = int((pos + 1).sum().item())        # sum over tokens of keys j <= p
    seq = int(pos.max().item()) + 1 if T else 0
    G = p.gqa_group
    att_keys = attended_keys(sel_hm, pos, p.block_size)   # per KV head, summed
    index_flops = 2.0 * p.index_head_dim * p.num_index_heads * visible
    sparse_flops = 4.0 * p.head_dim * G * att_keys
    dense_flops = 4.0 * p.head_dim * p.num_heads * visible
    index_bytes = seq * p.index_head_dim * index_elt + T * p.num_index_heads * p.index_head_dim * q_elt \
        + T * p.num_index_heads * p.topk * 4
    kv_bytes = seq * p.num_kv_heads * p.head_dim * 2 * kv_elt
    q_out = 2 * T * p.num_heads * p.head_dim * q_elt
    return {"index_flops": index_flops, "sparse_flops": sparse_flops, "dense_flops": dense_flops,
            "indexer_bytes": index_bytes, "attention_bytes": kv_bytes + q_out,
            "step_bytes": index_bytes + kv_bytes + q_out, "attended_keys_per_row": att_keys / max(1, T * p.num_kv_heads)}
