"""docs/spec.md §3.6's rules for the block scores an ``index_scores`` hook writes, checked on the whole step.

One rule code per score, vectorised over ``[H, T, N]``; the slow path that
describes the first offending score in words runs only when a rule is broken.
The rules are about what can be judged without the scores themselves: every
element written, ``-inf`` where a token sees no block, the forced values, no
NaN. Whether the visible scores are right needs the oracle (the conformance
suite's ``scores/*`` cases).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.params import SparseAttentionParams
from mm3.debug.fences import still_marked

__all__ = ["SCORE_RULES", "ScoreViolation", "score_codes", "describe_score"]

FORCED_INIT, FORCED_LOCAL = 1e30, 1e29   # docs/spec.md §3.4

# In the order a score is judged: the first broken rule is the one reported.
SCORE_RULES = ("scores.unwritten", "scores.hidden", "scores.nan", "scores.forced")


@dataclass(frozen=True)
class ScoreViolation:
    """The first offending score: its rule, where it is and what it holds."""

    rule: str
    head: int
    token: int
    block: int
    detail: str


def score_codes(scores: torch.Tensor, positions: torch.Tensor, params: SparseAttentionParams) -> torch.Tensor:
    """``[H, T, N]`` int8: 0 for a score that keeps the rules, else 1 + index of its first broken rule."""
    N = scores.shape[-1]
    pos = positions.to(torch.int64)
    nb = torch.where(pos >= 0, torch.div(pos, params.block_size, rounding_mode="floor") + 1, 0)[:, None]  # [T, 1]
    b = torch.arange(N, device=scores.device)[None, :]
    visible = b < nb                                                      # [T, N]
    local = visible & (b >= nb - params.local_blocks)
    init = visible & (b < params.init_blocks) & ~local
    unwritten = still_marked(scores)
    hidden = ~visible & (scores != float("-inf"))
    nan = torch.isnan(scores) & ~unwritten
    forced = (init & (scores != FORCED_INIT)) | (local & (scores != FORCED_LOCAL))
    codes = torch.zeros(scores.shape, dtype=torch.int8, device=scores.device)
    for i, bad in reversed(list(enumerate((unwritten, hidden, nan, forced)))):
        codes = torch.where(bad, torch.full_like(codes, i + 1), codes)
    return codes


def describe_score(codes: torch.Tensor, scores: torch.Tensor, batch: BatchMetadata,
                   params: SparseAttentionParams) -> ScoreViolation:
    """The first offending score (lowest token, then head, then block) described in words. Slow path."""
    bad = (codes.permute(1, 0, 2) != 0).nonzero()                        # token-major order
    t, h, b = (int(v) for v in bad[0])
    rule = SCORE_RULES[int(codes[h, t, b]) - 1]
    p = int(batch.token_positions[t])
    nb = p // params.block_size + 1 if p >= 0 else 0
    where = (f"head {h}, token {t} (request {int(batch.token_to_request[t])}, position {p}, {nb} visible "
             f"block{'s' if nb != 1 else ''}), block {b}")
    value = "the guard's marked NaN (not written)" if rule == "scores.unwritten" else str(float(scores[h, t, b]))
    want = {"scores.unwritten": "a value", "scores.hidden": "-inf (the token does not see this block)",
            "scores.nan": "-1e30 for a NaN block (docs/spec.md §3.4)",
            "scores.forced": f"{FORCED_LOCAL if b >= nb - params.local_blocks else FORCED_INIT:g} (a forced block: "
                             f"init_blocks={params.init_blocks}, local_blocks={params.local_blocks})"}[rule]
    n = int(bad.shape[0])
    more = f"; {n} of {codes.numel()} scores break a rule" if n > 1 else ""
    return ScoreViolation(rule, h, t, b, f"{where} holds {value}, should hold {want}{more}")
