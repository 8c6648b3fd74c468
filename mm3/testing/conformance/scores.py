"""The conformance cases of the optional ``index_scores`` op (docs/spec.md §3.6).

Each case builds a fresh random step (one of the indexer steps of :mod:`.cases`)
and hands the backend's ``index_scores`` a NaN-filled ``[H, T, N]`` view of a
larger tensor whose spare rows and columns hold :data:`.verdicts.OUT_POISON`;
``N`` reaches past every token's blocks. The verdict: nothing outside the view
written and every element of it; ``-inf`` exactly where a token sees no block;
the forced values and a NaN block's ``-1e30`` exactly; every other score within
``1e-3`` of its row's largest unforced ``|S|`` of the fp64 oracle (§3's
selection tolerance); and the top-k of the scores (§3.5) a right selection for
every row (:func:`~mm3.testing.oracle.check_topk`), the oracle's bit for bit
where the step plants exact ties.
"""

from __future__ import annotations

from typing import Any

import torch

from mm3.contract.buffers import TopkBuffer
from mm3.testing.conformance.cases import INDEXER_STEPS, CaseContext, CaseSpec, Step, _timed
from mm3.testing.conformance.verdicts import OUT_POISON, CaseFailure, check_exact_selection, check_selection
from mm3.testing.factories import Case
from mm3.testing.oracle import FORCED_INIT, FORCED_LOCAL, NAN_SCORE, oracle_index_scores, topk_of_scores

__all__ = ["SCORE_STEPS", "scores_body", "check_scores", "REL_TOL"]

SCORE_STEPS: dict[str, Step] = {name: INDEXER_STEPS[name] for name in (
    "mixed_h2", "mixed_h4_di64", "spec_decode_q3", "padding_decodes", "init1_local2", "nan_index_query",
    "exact_ties", "exact_ties_half_tied")}
"""The indexer steps the scores cases run: mixed, speculative, padding, forced blocks, NaN, exact ties."""

REL_TOL = 1e-3
"""A score's tolerance, times the largest unforced ``|S|`` of its row (docs/spec.md §3's selection tolerance)."""


def check_scores(case: Case, got: torch.Tensor, details: dict[str, Any]) -> None:
    """``got`` (``[H, T, N]``) against the oracle's :func:`~mm3.testing.oracle.oracle_index_scores`."""
    ref = oracle_index_scores(case.index_q, case.caches, case.batch, case.params, got.shape[2])
    g = got.detach().to("cpu", torch.float64)
    hidden = ref == float("-inf")
    exact = (ref == FORCED_INIT) | (ref == FORCED_LOCAL) | (ref == NAN_SCORE)
    free = ~hidden & ~exact
    row_scale = torch.where(free, ref.abs(), 0.0).amax(dim=-1, keepdim=True).clamp(min=1.0)
    err = torch.where(free, (g - ref).abs() / row_scale, 0.0).nan_to_num(nan=float("inf"))
    details["max_rel_err"] = float(err.max()) if err.numel() else 0.0
    rules = (("left NaN (unwritten, or a NaN block not at -1e30)", torch.isnan(g)),
             ("is not -inf where the token sees no block", hidden & (g != float("-inf"))),
             ("is not exactly the forced value or a NaN block's -1e30", exact & (g != ref.float().double())),
             (f"is off the fp64 oracle by more than {REL_TOL:g} of the row's largest |S|", err > REL_TOL))
    for what, bad in rules:
        where = bad.permute(1, 0, 2).nonzero()
        if where.numel():
            t, h, b = (int(v) for v in where[0])
            raise CaseFailure(
                f"{int(where.shape[0])} block scores break docs/spec.md §3.6; first: head {h}, token {t} (position "
                f"{int(case.batch.token_positions[t])}), block {b} holds {float(g[h, t, b]):.7g}, the oracle "
                f"{float(ref[h, t, b]):.7g}: it {what}", details)


def scores_body(ctx: CaseContext, spec: CaseSpec) -> dict[str, Any]:
    """``index_scores`` into a poisoned view with spare rows and columns; the scores and their top-k checked."""
    case = spec.step.build(spec.dtype, spec.index_dtype, ctx.device, spec.seed)
    p, b = case.params, case.batch
    T, H = b.num_tokens, p.num_index_heads
    N = b.block_table.shape[1] + 3     # columns past every token's blocks
    full = torch.full((H, T + 2, N + 2), OUT_POISON, dtype=torch.float32, device=ctx.device)
    view = full[:, 1:T + 1, 1:N + 1].fill_(float("nan"))
    details: dict[str, Any] = {"tokens": T, "columns": N}
    details["backend_s"] = _timed(ctx.device, lambda: ctx.backend.index_scores(case.index_q, case.caches, b, p, view))
    spare = full.clone()
    spare[:, 1:T + 1, 1:N + 1] = OUT_POISON
    if not bool((spare == OUT_POISON).all()):
        raise CaseFailure("index_scores wrote outside the scores it was given (a view of a larger tensor: write "
                          "through out.stride(), rows [0, T) and columns [0, N) only)", details)
    check_scores(case, view, details)
    sel = TopkBuffer(topk_of_scores(view.detach().to("cpu", torch.float64), p.topk))
    check_selection(case, sel, details)
    if spec.step.exact:
        check_exact_selection(case, sel)
    return details
