"""The oracle as the spec reads, one token and one head at a time, in plain Python loops.

Kept only to check :mod:`mm3.testing.oracle`: the shipped oracle is
vectorized per request and head, and tests/test_oracle.py asserts the two
agree (scores and selections exactly, outputs to fp64 rounding) on random
mixed batches, ties, NaN and forced blocks. Slow on purpose; tiny shapes only.
"""

from __future__ import annotations

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.params import SparseAttentionParams

FORCED_INIT = 1e30
FORCED_LOCAL = 1e29
NAN_SCORE = -1e30


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").to(torch.float64)


def _host(batch: BatchMetadata) -> dict[str, list]:
    return {
        "pos": batch.token_positions.tolist(),
        "req": batch.token_to_request.tolist(),
        "bt": batch.block_table.to("cpu").tolist(),
    }


def _positions(bt_row: list[int], p: int, block_size: int) -> tuple[list[int], list[int]]:
    """(page, slot) of every absolute position 0..p of one request."""
    pages = [bt_row[j // block_size] for j in range(p + 1)]
    slots = [j % block_size for j in range(p + 1)]
    return pages, slots


def literal_block_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                        params: SparseAttentionParams) -> list[torch.Tensor]:
    """Per token, the fp64 block scores S after forcing (docs/spec.md §3.3-3.4): ``[H, nb]``.

    Padding tokens get an empty ``[H, 0]`` tensor.
    """
    B = params.block_size
    iq = _f64(index_q)
    icache = _f64(caches.index)
    h = _host(batch)
    out: list[torch.Tensor] = []
    for t, (p, r) in enumerate(zip(h["pos"], h["req"])):
        H = params.num_index_heads
        if p < 0:
            out.append(torch.empty(H, 0, dtype=torch.float64))
            continue
        nb = p // B + 1
        pages, slots = _positions(h["bt"][r], p, B)
        keys = icache[torch.tensor(pages), torch.tensor(slots)]          # [p+1, Di]
        s = (iq[t] @ keys.T) * params.index_scale                          # [H, p+1]
        S = torch.full((H, nb), float("-inf"), dtype=torch.float64)
        for b in range(nb):
            S[:, b] = s[:, b * B: min((b + 1) * B, p + 1)].max(dim=1).values
        S = torch.where(torch.isnan(S), torch.full_like(S, NAN_SCORE), S)
        S[:, : min(params.init_blocks, nb)] = FORCED_INIT
        S[:, max(nb - params.local_blocks, 0):] = FORCED_LOCAL
        out.append(S)
    return out


def literal_topk(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                params: SparseAttentionParams) -> TopkBuffer:
    """The oracle's selection as a head-major CPU buffer (ties -> lower block id)."""
    scores = literal_block_scores(index_q, caches, batch, params)
    H, K = params.num_index_heads, params.topk
    buf = TopkBuffer.allocate(len(scores), H, K, "head_major", "cpu")
    view = buf.head_major()
    for t, S in enumerate(scores):
        nb = S.shape[1]
        k = min(K, nb)
        for hh in range(H):
            order = sorted(range(nb), key=lambda b: (-float(S[hh, b]), b))[:k]
            view[hh, t, :k] = torch.tensor(order, dtype=torch.int32)
    return buf


def literal_attention(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
                     batch: BatchMetadata, params: SparseAttentionParams) -> torch.Tensor:
    """docs/spec.md §4 in float64 on the CPU; returns ``[T, Hq, D]`` float64."""
    B, G = params.block_size, params.gqa_group
    qf = _f64(q)
    kc, vc = _f64(caches.k), _f64(caches.v)
    sel = topk.head_major().to("cpu").tolist()
    h = _host(batch)
    T, Hq, D = q.shape
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for t, (p, r) in enumerate(zip(h["pos"], h["req"])):
        if p < 0:
            continue
        for kvh in range(params.num_kv_heads):
            blocks = sorted({b for b in sel[kvh][t] if b >= 0})
            js = [j for b in blocks for j in range(b * B, min((b + 1) * B, p + 1))]
            if not js:
                continue
            pages = torch.tensor([h["bt"][r][j // B] for j in js])
            slots = torch.tensor([j % B for j in js])
            keys, vals = kc[pages, slots, kvh], vc[pages, slots, kvh]        # [n, D]
            for g in range(kvh * G, (kvh + 1) * G):
                logits = params.softmax_scale * (keys @ qf[t, g])
                w = torch.softmax(logits, dim=0)
                out[t, g] = w @ vals
    return out
