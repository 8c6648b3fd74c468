"""The fp64 oracle: docs/spec.md §3 and §4 computed literally, in float64 on the CPU.

Independent of every backend: it gathers each request's keys through the block
table, computes every score in float64 and applies the selection rules
exactly as the spec states them. It is vectorized per request and head (all
tokens of a request at once, in chunks that bound memory), not per token in
Python, so conformance runs take seconds; it is still meant for test-sized
shapes, not for production contexts.

Example:
    >>> from mm3.testing.factories import make_case
    >>> from mm3.contract.params import SparseAttentionParams
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
from typing import Iterator

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.params import SparseAttentionParams

__all__ = [
    "FORCED_INIT", "FORCED_LOCAL", "NAN_SCORE",
    "oracle_block_scores", "oracle_index_scores", "oracle_topk", "topk_of_scores", "oracle_attention",
    "TopkRowError", "check_topk",
]

FORCED_INIT = 1e30
FORCED_LOCAL = 1e29
NAN_SCORE = -1e30

#: fp64 elements of the largest intermediate (scores or logits) built at once: 32 MB
_CHUNK_ELEMENTS = 1 << 22


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").to(torch.float64)


@dataclass(frozen=True)
class _Request:
    """The step's tokens of one request, and where each of its positions ``0..L-1`` lives."""

    tokens: torch.Tensor   # [n] indices into the step's tokens
    pos: torch.Tensor      # [n] absolute positions
    pages: torch.Tensor    # [L] page of position j
    slots: torch.Tensor    # [L] slot of position j inside its page

    @property
    def length(self) -> int:
        return int(self.pages.shape[0])


def _requests(batch: BatchMetadata, block_size: int) -> Iterator[_Request]:
    """Every request with at least one real token (padding tokens have position -1), its positions found
    through the batch's block table or, for token slots, its slot table (docs/spec.md §2; written out
    here, apart from the backends' :func:`mm3.contract.slots.key_rows`, so a wrong address there shows)."""
    pos = batch.token_positions.to("cpu").long()
    req = batch.token_to_request.to("cpu").long()
    slots = None if batch.slots is None else batch.slots.to("cpu")
    table = batch.block_table.to("cpu").long() if slots is None else slots.table.long()
    real = pos >= 0
    for r in torch.unique(req[real]).tolist():
        tokens = torch.nonzero(real & (req == r)).flatten()
        p = pos[tokens]
        j = torch.arange(int(p.max()) + 1)
        if slots is None:
            yield _Request(tokens, p, table[r, j // block_size], j % block_size)
        else:   # one-token pages: a position's slot is its page
            yield _Request(tokens, p, table[int(slots.rows[r]), j], torch.zeros_like(j))


def _chunks(n: int, elements_per_token: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(elements_per_token, 1))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _padded_block_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                         params: SparseAttentionParams) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk of a request's tokens: (token indices ``[n]``, forced scores ``[n, H, nb_max]``).

    Blocks a token cannot see (``b >= nb``) hold ``-inf``, below every visible
    score (visible ones are finite or ``NAN_SCORE``).
    """
    B = params.block_size
    iq = _f64(index_q)
    icache = _f64(caches.index_values(torch.float64))   # an NVFP4 index cache: its dequantized keys (§1)
    H = params.num_index_heads
    for rq in _requests(batch, B):
        # each distinct key is scored once: equal keys then score exactly alike (§3.5's exact ties), which
        # a matmul over every position does not promise (its sums' order depends on the column)
        keys, which = torch.unique(icache[rq.pages, rq.slots], dim=0, return_inverse=True)   # [U, Di], [L]
        L = rq.length
        nb_max = (L - 1) // B + 1
        j = torch.arange(L)
        b = torch.arange(nb_max)
        for sl in _chunks(len(rq.tokens), H * nb_max * B):
            t, p = rq.tokens[sl], rq.pos[sl]
            s = torch.matmul(iq[t], keys.T)[..., which] * params.index_scale     # [n, H, L]
            s = s.masked_fill((j[None, :] > p[:, None])[:, None, :], float("-inf"))
            s = torch.nn.functional.pad(s, (0, nb_max * B - L), value=float("-inf"))
            S = s.view(len(t), H, nb_max, B).amax(dim=-1)                        # NaN propagates
            S = torch.where(torch.isnan(S), torch.full_like(S, NAN_SCORE), S)
            nb = (p // B + 1)[:, None, None]                                     # [n, 1, 1]
            S = torch.where(b < min(params.init_blocks, nb_max), torch.full_like(S, FORCED_INIT), S)
            S = torch.where(b >= nb - params.local_blocks, torch.full_like(S, FORCED_LOCAL), S)
            S = S.masked_fill(b >= nb, float("-inf"))
            yield t, S


def oracle_block_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                        params: SparseAttentionParams) -> list[torch.Tensor]:
    """Per token, the fp64 block scores S after forcing (docs/spec.md §3.3-3.4): ``[H, nb]``.

    Padding tokens get an empty ``[H, 0]`` tensor.
    """
    H = params.num_index_heads
    out = [torch.empty(H, 0, dtype=torch.float64) for _ in range(batch.num_tokens)]
    for t, S in _padded_block_scores(index_q, caches, batch, params):
        visible = torch.isfinite(S[:, 0]).sum(dim=-1).tolist()                 # nb per token
        for i, (tok, nb) in enumerate(zip(t.tolist(), visible)):
            out[tok] = S[i, :, :nb].clone()
    return out


def oracle_index_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                        params: SparseAttentionParams, num_blocks: int) -> torch.Tensor:
    """What ``index_scores`` writes (docs/spec.md §3.6), in float64: ``[H, T, num_blocks]``.

    S after §3.4 for each block ``b < min(nb, num_blocks)`` a token sees, ``-inf`` in
    every other column and in every column of a padding token.
    """
    out = torch.full((params.num_index_heads, batch.num_tokens, num_blocks), float("-inf"), dtype=torch.float64)
    for t, S in _padded_block_scores(index_q, caches, batch, params):
        w = min(num_blocks, S.shape[-1])
        out[:, t, :w] = S[..., :w].permute(1, 0, 2)
    return out


def oracle_topk(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                params: SparseAttentionParams) -> TopkBuffer:
    """The oracle's selection as a head-major CPU buffer; equal scores go to the lower block id."""
    H, K = params.num_index_heads, params.topk
    buf = TopkBuffer.allocate(batch.num_tokens, H, K, "head_major", "cpu")
    view = buf.head_major()
    view.fill_(-1)
    for t, S in _padded_block_scores(index_q, caches, batch, params):
        view[:, t] = topk_of_scores(S, K).permute(1, 0, 2)
    return buf


def topk_of_scores(S: torch.Tensor, K: int) -> torch.Tensor:
    """docs/spec.md §3.5 on block scores after §3.4 (``S`` ``[..., N]``, ``-inf`` where a block is not
    visible): the ``K`` highest finite scores' block ids, exact ties to the lowest id, then ``-1``;
    int32 ``[..., K]``, highest first."""
    # a stable descending sort keeps equal scores in ascending block order
    order = torch.sort(S, dim=-1, descending=True, stable=True).indices[..., :K]
    visible = torch.isfinite(torch.gather(S, -1, order))                              # drops -inf
    ids = torch.where(visible, order, torch.full_like(order, -1)).to(torch.int32)
    return torch.nn.functional.pad(ids, (0, K - ids.shape[-1]), value=-1)


def _attend(qg: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Softmax attention of ``qg [n, G, D]`` over the ``allowed [n, L]`` keys of ``[L, D]``.

    Rows with no allowed key give zeros. Values outside a row's allowed keys
    never touch it (a NaN there must not leak through a zero weight).
    """
    logits = scale * torch.matmul(qg, keys.T)                                   # [n, G, L]
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    w = torch.softmax(logits, dim=-1)
    w = torch.where(allowed.any(dim=-1)[:, None, None], w, torch.zeros_like(w))
    finite = torch.isfinite(vals).all(dim=-1)                                   # [L]
    out = torch.matmul(w, torch.where(finite[:, None], vals, torch.zeros_like(vals)))
    # rows that do read a non-finite value get it, as the literal sum would
    tainted = (allowed & ~finite[None, :]).any(dim=-1)
    for i in torch.nonzero(tainted).flatten().tolist():
        out[i] = w[i] @ vals
    return out


def oracle_attention(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
                     batch: BatchMetadata, params: SparseAttentionParams) -> torch.Tensor:
    """docs/spec.md §4 in float64 on the CPU; returns ``[T, Hq, D]`` float64."""
    B, G = params.block_size, params.gqa_group
    qf = _f64(q)
    # fp8 and NVFP4 K/V: the oracle's input is the dequantized cache (docs/spec.md §1), exact in float64;
    # fp8 queries are widened exactly
    values = caches.dequantized(torch.float64)
    kc, vc = _f64(values.k), _f64(values.v)
    sel = topk.head_major().to("cpu").long()                                    # [Hkv, T, K]
    T, Hq, D = q.shape
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for rq in _requests(batch, B):
        L = rq.length
        nb_max = (L - 1) // B + 1
        j = torch.arange(L)
        keys_all, vals_all = kc[rq.pages, rq.slots], vc[rq.pages, rq.slots]    # [L, Hkv, D]
        for h in range(params.num_kv_heads):
            heads = slice(h * G, (h + 1) * G)
            for sl in _chunks(len(rq.tokens), G * L):
                t, p = rq.tokens[sl], rq.pos[sl]
                ids = sel[h, t]                                                   # [n, K]
                # ids outside [0, nb_max) select nothing (as an empty key range would)
                chosen = torch.zeros(len(t), nb_max + 1, dtype=torch.bool)
                chosen.scatter_(1, torch.where((ids >= 0) & (ids < nb_max), ids, nb_max), True)
                allowed = chosen[:, j // B] & (j[None, :] <= p[:, None])          # [n, L]
                out[t, heads] = _attend(qf[t, heads], keys_all[:, h], vals_all[:, h], allowed,
                                        params.softmax_scale)
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
    view = result.head_major().to("cpu").tolist()
    errors: list[TopkRowError] = []
    K = params.topk
    for t, S_t in enumerate(scores):
        nb = S_t.shape[1]
        for hh, S in enumerate(S_t.tolist()):
            row = [int(x) for x in view[hh][t]]

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
            chosen = set(valid)
            if len(chosen) != k:
                bad("duplicate block ids")
                continue
            if any(not (0 <= x < nb) for x in valid):
                bad(f"block id outside [0, {nb})")
                continue
            forced = [b for b in range(nb) if S[b] >= FORCED_LOCAL]
            if any(b not in chosen for b in forced):
                bad(f"forced blocks {forced} not all selected")
                continue
            unselected = [S[b] for b in range(nb) if b not in chosen]
            if not unselected:
                continue
            free = [x for x in S if NAN_SCORE < x < FORCED_LOCAL]
            scale = max((abs(x) for x in free), default=1.0) or 1.0
            tol = rel_tol * scale
            lo = min(S[b] for b in valid)
            hi = max(unselected)
            if lo < hi - tol:
                bad(f"not a top-k choice: selected score {lo:.6g} < unselected {hi:.6g} - tol {tol:.3g}")
    return errors
