"""The fp64 oracle: docs/spec.md §3 and §4 computed literally, one token at a time.

Slow on purpose and independent of every backend: it walks each token's
visible positions through the block table, computes scores in float64 on the
CPU and applies the selection rules exactly as docs/spec.md states them. Use it on
small shapes only.

Example:
    >>> from mm3.testing.factories import make_case
    >>> from mm3.params import SparseAttentionParams
    >>> p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[70, 33], prefills=[(20, 50)], dtype="float32")
    >>> sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    >>> out = oracle_attention(case.q, case.caches, sel, case.batch, p)
    >>> out.shape, out.dtype
    (torch.Size([22, 4, 16]), torch.float64)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm3.batch import BatchMetadata
from mm3.buffers import PagedKVCache, TopkBuffer
from mm3.params import SparseAttentionParams

__all__ = [
    "FORCED_INIT", "FORCED_LOCAL", "NAN_SCORE",
    "oracle_block_scores", "oracle_topk", "oracle_attention",
    "TopkRowError", "check_topk",
]

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


def oracle_block_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
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


def oracle_topk(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                params: SparseAttentionParams) -> TopkBuffer:
    """The oracle's selection as a head-major CPU buffer (ties -> lower block id)."""
    scores = oracle_block_scores(index_q, caches, batch, params)
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


def oracle_attention(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
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


@dataclass(frozen=True)
class TopkRowError:
    """One invalid or mis-selected top-k row."""

    head: int
    token: int
    rule: str
    row: list[int]

    def __str__(self) -> str:
        return f"head {self.head}, token {self.token}: {self.rule} (row = {self.row})"


def check_topk(result: TopkBuffer, index_q: torch.Tensor, caches: PagedKVCache,
               batch: BatchMetadata, params: SparseAttentionParams,
               rel_tol: float = 1e-3, scores: list[torch.Tensor] | None = None) -> list[TopkRowError]:
    """Every row of ``result`` that breaks docs/spec.md §3 (format rules and tie-tolerant optimality).

    A row passes when it is a prefix of exactly ``min(K, nb)`` unique in-range
    ids followed by ``-1``, contains every forced block, and
    ``min S(selected) >= max S(unselected) - tol`` with ``tol = rel_tol`` times
    the row's largest unforced |score|.
    """
    if scores is None:
        scores = oracle_block_scores(index_q, caches, batch, params)
    view = result.head_major().to("cpu")
    errors: list[TopkRowError] = []
    K = params.topk
    for t, S in enumerate(scores):
        nb = S.shape[1]
        for hh in range(params.num_index_heads):
            row = [int(x) for x in view[hh, t].tolist()]

            def bad(rule: str) -> None:
                errors.append(TopkRowError(hh, t, rule, row))

            if nb == 0:
                if any(x != -1 for x in row):
                    bad("padding token must have an all -1 row")
                continue
            k = min(K, nb)
            valid, tail = row[:k], row[k:]
            if any(x == -1 for x in valid) or any(x != -1 for x in tail):
                bad(f"expected exactly {k} ids as a prefix, then -1")
                continue
            if len(set(valid)) != k:
                bad("duplicate block ids")
                continue
            if any(not (0 <= x < nb) for x in valid):
                bad(f"block id outside [0, {nb})")
                continue
            forced = [b for b in range(nb) if S[hh, b] >= FORCED_LOCAL]
            if any(b not in valid for b in forced):
                bad(f"forced blocks {forced} not all selected")
                continue
            unselected = [b for b in range(nb) if b not in valid]
            if not unselected:
                continue
            free = [float(S[hh, b]) for b in range(nb) if S[hh, b] < FORCED_LOCAL and S[hh, b] > NAN_SCORE]
            scale = max((abs(x) for x in free), default=1.0) or 1.0
            tol = rel_tol * scale
            lo = min(float(S[hh, b]) for b in valid)
            hi = max(float(S[hh, b]) for b in unselected)
            if lo < hi - tol:
                bad(f"not a top-k choice: selected score {lo:.6g} < unselected {hi:.6g} - tol {tol:.3g}")
    return errors
