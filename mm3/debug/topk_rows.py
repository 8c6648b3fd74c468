"""docs/spec.md §3's format rules for the rows of a top-k buffer, checked on the whole step at once.

One ``[H, T]`` rule code per row, vectorised; the slow path that describes
the first offending row in words runs only when a rule is broken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import TopkBuffer
from mm3.contract.params import SparseAttentionParams
from mm3.contract.topk_order import is_ascending

__all__ = ["GUARD_SENTINEL", "ROW_RULES", "TopkRowViolation", "find_topk_violation", "row_codes",
           "describe_row"]

GUARD_SENTINEL = -0x4D4D33
"""What the guard fills top-k rows with before they are written (not a valid id, not ``-1``)."""

# Rule codes of the per-row check, in the order a row is judged: the first
# broken rule is the one reported (a row with an id out of range usually also
# looks like a bad prefix; the range message is the more useful one, and a row
# still holding the sentinel was simply not written).
ROW_RULES = ("topk.unwritten", "topk.padding", "topk.range", "topk.prefix", "topk.unique", "topk.forced",
             "topk.order")


@dataclass(frozen=True)
class TopkRowViolation:
    """The first invalid row of a top-k buffer, and how many rows break rules."""

    rule: str
    head: int
    token: int
    row: list[int]
    detail: str
    bad_rows: int

    def __str__(self) -> str:
        return f"{self.rule}: {self.detail}"


def row_codes(hm: torch.Tensor, positions: torch.Tensor, params: SparseAttentionParams,
              ascending: bool = False) -> torch.Tensor:
    """``[H, T]`` int8: 0 for a valid row, else 1 + index of its first broken rule in ROW_RULES
    (``ascending``: the indexer declares ``topk_order="ascending"``, so a row out of that order breaks
    ``topk.order``)."""
    x = hm.to(torch.int64)
    K = x.shape[-1]
    pos = positions.to(torch.int64)
    real = pos >= 0                                                  # [T]
    nb = torch.where(real, torch.div(pos, params.block_size, rounding_mode="floor") + 1,
                     torch.zeros_like(pos))                          # visible blocks
    k = nb.clamp(max=K)
    slot = torch.arange(K, device=x.device)
    want_id = slot[None, :] < k[:, None]                             # [T, K]
    empty = x == -1
    in_range = (x >= 0) & (x < nb[None, :, None])
    row_real = real[None, :]

    pad_bad = ~row_real & ~empty.all(-1)
    range_bad = row_real & ~(in_range | empty).all(-1)
    prefix_bad = row_real & ((want_id[None] & empty) | (~want_id[None] & ~empty)).any(-1)
    srt = x.sort(dim=-1).values
    unique_bad = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(-1)
    # Forced blocks are [0, a) and [c, nb); with ids unique and in range, the row
    # holds them all iff it holds as many forced ids as there are forced blocks.
    a = nb.clamp(max=params.init_blocks)
    c = (nb - params.local_blocks).clamp(min=0)
    n_forced = a + nb - torch.maximum(a, c)
    is_forced = in_range & ((x < a[None, :, None]) | (x >= c[None, :, None]))
    forced_bad = row_real & (is_forced.sum(-1) != n_forced[None, :])
    unwritten = (x == GUARD_SENTINEL).any(-1)
    order_bad = row_real & ~is_ascending(x) if ascending else torch.zeros_like(unwritten)

    codes = torch.zeros(x.shape[:2], dtype=torch.int8, device=x.device)
    # Lowest-priority rule first, so the earliest rule in ROW_RULES wins.
    for i, bad in reversed(list(enumerate((unwritten, pad_bad, range_bad, prefix_bad, unique_bad, forced_bad,
                                           order_bad)))):
        codes = torch.where(bad, torch.full_like(codes, i + 1), codes)
    return codes


def describe_row(codes: torch.Tensor, hm: torch.Tensor, batch: BatchMetadata,
                  params: SparseAttentionParams) -> TopkRowViolation:
    """The first row (lowest token, then head) that breaks the gravest rule broken anywhere (the earliest in
    ROW_RULES: an indexer that breaks ``topk.order`` on every row must not hide an id out of range on a later
    one), described in words. Slow path."""
    broken = codes != 0
    worst = int(codes[broken].min())
    bad = (codes.T == worst).nonzero()                               # token-major order
    t, h = int(bad[0, 0]), int(bad[0, 1])
    rule = ROW_RULES[int(codes[h, t]) - 1]
    row = [int(v) for v in hm[h, t].tolist()]
    p = int(batch.token_positions[t])
    r = int(batch.token_to_request[t])
    kind = "decode" if r < batch.num_decodes else "prefill"
    K = params.topk
    if rule == "topk.unwritten":
        slots = [k for k, v in enumerate(row) if v == GUARD_SENTINEL]
        detail = (f"head {h}, token {t} (request {r}, position {p}): slot(s) {slots} still hold "
                  f"{GUARD_SENTINEL}, the guard's fill before the call: row {row} was not written")
    elif p < 0:
        where = f"token {t} (padding slot of decode request {r})"
        detail = f"head {h}, {where}: row {row} should be all -1"
    else:
        nb = p // params.block_size + 1
        k = min(K, nb)
        where = (f"token {t} ({kind} request {r}, position {p}, {nb} visible block"
                 f"{'s' if nb != 1 else ''})")
        if rule == "topk.range":
            odd = [v for v in row if v != -1 and not 0 <= v < nb]
            what = f"holds {odd[0]}, outside [0, {nb})"
        elif rule == "topk.prefix":
            what = f"should hold exactly {k} ids" + (f" then {K - k} x -1" if K > k else " (no -1)")
        elif rule == "topk.order":
            what = 'is not ascending, though the indexer declares topk_order="ascending" (nothing sorts its rows)'
        elif rule == "topk.unique":
            dup = sorted({v for v in row if v >= 0 and row.count(v) > 1})
            what = f"holds {dup} more than once"
        else:
            forced = sorted(set(range(min(params.init_blocks, nb)))
                            | set(range(max(nb - params.local_blocks, 0), nb)))
            what = (f"lacks forced block(s) {[b for b in forced if b not in row]} "
                    f"(init_blocks={params.init_blocks}, local_blocks={params.local_blocks})")
        detail = f"head {h}, {where}: row {row} {what}"
    n = int(broken.sum())
    if n > 1:
        detail += f"; {n} of {codes.numel()} (head, token) rows break a rule"
    return TopkRowViolation(rule, h, t, row, detail, n)


def find_topk_violation(topk: TopkBuffer, batch: BatchMetadata, params: SparseAttentionParams
                        ) -> Optional[TopkRowViolation]:
    """The first row of ``topk`` (rows ``[0, T)``) that breaks docs/spec.md §3's format rules, or None.

    Checks padding rows, id range, the prefix of exactly ``min(K, nb)`` ids,
    uniqueness and forced blocks, vectorised; one host sync. It does not check
    *which* blocks were chosen (that needs the scores: see
    :func:`mm3.testing.oracle.check_topk`).

    Example:
        >>> import torch
        >>> bt = torch.arange(4, dtype=torch.int32).reshape(2, 2)
        >>> b = BatchMetadata.build([1, 2], [20, 2], bt, block_size=16, num_decodes=1)
        >>> p = SparseAttentionParams(num_heads=1, num_kv_heads=1, head_dim=16,
        ...     num_index_heads=1, index_head_dim=16, block_size=16, topk=2)
        >>> buf = TopkBuffer(torch.tensor([[[1, 1], [0, -1], [0, -1]]], dtype=torch.int32))
        >>> print(find_topk_violation(buf, b, p))
        topk.unique: head 0, token 0 (decode request 0, position 19, 2 visible blocks): row [1, 1] holds [1] more than once
    """
    T = batch.num_tokens
    if T == 0:
        return None
    hm = topk.rows(0, T).head_major()
    codes = row_codes(hm, batch.token_positions, params)
    if not bool(codes.any()):
        return None
    return describe_row(codes, hm, batch, params)
