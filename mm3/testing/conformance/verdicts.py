"""The verdicts of the conformance cases: a backend's results against the fp64 oracle.

Each ``check_*`` raises :class:`CaseFailure` with a message that says what was
wrong and where (head, token, row) and records its numbers in ``details``.
The tolerances are docs/spec.md §4's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.topk_order import ASCENDING_FIX, is_ascending
from mm3.testing.conformance.oracle_cache import (
    oracle_attention_cached, oracle_scores_cached, oracle_topk_cached,
)
from mm3.testing.factories import Case
from mm3.testing.oracle import check_topk

__all__ = ["CaseFailure", "TOLERANCES", "QUANTIZED_TOLERANCE", "quantized", "SENTINEL", "OUT_POISON", "check_spare_rows", "check_selection",
           "check_exact_selection", "poisoned_out", "check_attention"]

TOLERANCES: dict[str, tuple[float, float]] = {
    "bfloat16": (3e-4, 2e-2),
    "float16": (1.5e-4, 1e-2),
    "float32": (1e-5, 1e-5),
}
"""docs/spec.md §4: ``(mean, max)`` absolute error against the fp64 oracle, per attention dtype."""

QUANTIZED_TOLERANCE: tuple[float, float] = (1e-2, 5e-2)
"""docs/spec.md §4: ``(mean, max)`` for a step with fp8 queries, unscaled e4m3 or NVFP4 K/V, where a backend
may round as the model's authors do (an NVFP4 product to e4m3, P * 448 to e4m3 for the P.V product)."""


def quantized(case: Case) -> bool:
    """Whether ``case`` reads fp8 queries, or K/V in unscaled e4m3 or NVFP4 (:data:`QUANTIZED_TOLERANCE`)."""
    return case.q.dtype == torch.float8_e4m3fn or case.caches.kv_format in ("float8_e4m3fn_unscaled", "nvfp4")


SENTINEL = 123456789
"""Fills top-k rows a backend must not write (an int32 no block id can equal)."""

OUT_POISON = 7777.0
"""Fills output rows past the step; rows of the step start as NaN."""


class CaseFailure(AssertionError):
    """A conformance check did not hold; ``details`` carries the numbers."""

    def __init__(self, message: str, details: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.details = details or {}


def check_spare_rows(full: TopkBuffer, start: int, stop: int, what: str) -> None:
    """Rows outside ``[start, stop)`` of ``full`` must still hold the sentinel."""
    hm = full.head_major()
    for label, part in (("before", hm[:, :start]), ("past", hm[:, stop:])):
        bad = (part != SENTINEL).nonzero()
        if bad.numel():
            h, t = int(bad[0, 0]), int(bad[0, 1]) + (0 if label == "before" else stop)
            raise CaseFailure(
                f"{what} wrote top-k rows {label} the step's rows [{start}, {stop}) (first: head {h}, "
                f"buffer row {t}, now {hm[h, t].tolist()}); kernels must write only the rows they are given",
                {"rows_changed": int((part != SENTINEL).any(dim=-1).sum())})


def check_selection(case: Case, sel: TopkBuffer, details: dict[str, Any], order: str = "score") -> None:
    """``sel`` holds the step's selection (docs/spec.md §3), each row in ``order``: the ``topk_order`` its
    indexer declares (``"ascending"``: mm3 then sorts nothing, so a row out of order would reach SGLang's
    callers and ascending readers as it is)."""
    errors = check_topk(sel, case.index_q, case.caches, case.batch, case.params,
                        scores=oracle_scores_cached(case))
    details["topk_rows"] = case.params.num_index_heads * case.batch.num_tokens
    details["bad_rows"] = len(errors)
    if errors:
        raise CaseFailure(f"{len(errors)} of {details['topk_rows']} top-k rows break docs/spec.md §3; first: "
                          f"{errors[0]}", details)
    if order != "ascending":
        return
    rows = sel.head_major()[:, :case.batch.num_tokens]
    bad = (~is_ascending(rows)).nonzero()
    if bad.numel():
        h, t = int(bad[0, 0]), int(bad[0, 1])
        raise CaseFailure(f"{bad.shape[0]} top-k rows are not ascending though the indexer declares "
                          f'topk_order="ascending"; first: head {h}, token {t}: {rows[h, t].tolist()}. Fix: '
                          f"{ASCENDING_FIX}",
                          {**details, "unordered_rows": int(bad.shape[0])})


def check_exact_selection(case: Case, sel: TopkBuffer) -> None:
    """Every row selects the oracle's blocks (exact ties: the lowest ids), in any order.

    The message shows the first differing row: the blocks selected instead of
    the oracle's, with the fp64 scores that tie (NaN scores rank as ``-1e30``).
    """
    T = case.batch.num_tokens
    got = sel.head_major()[:, :T].to("cpu").sort(dim=-1).values
    want = oracle_topk_cached(case).head_major().sort(dim=-1).values
    bad = (got != want).any(dim=-1).nonzero()
    if bad.numel():
        h, t = int(bad[0, 0]), int(bad[0, 1])
        g = {x for x in got[h, t].tolist() if x >= 0}
        w = {x for x in want[h, t].tolist() if x >= 0}
        S = oracle_scores_cached(case)[t][h]

        def scored(ids: set[int]) -> str:
            return ", ".join(f"{b} (score {float(S[b]):.6g})" if 0 <= b < S.numel() else f"{b} (not visible)"
                             for b in sorted(ids))
        raise CaseFailure(
            f"{bad.shape[0]} top-k rows break the exact-tie rule of docs/spec.md §3.5 (equal block "
            f"scores go to the lowest block id; a NaN score ranks as -1e30); first: head {h}, token {t} "
            f"(request {int(case.batch.token_to_request[t])}, position {int(case.batch.token_positions[t])}) "
            f"selected {sorted(g)}, the oracle {sorted(w)}: it took block(s) {scored(g - w)} instead of "
            f"{scored(w - g)}", {"tie_rows": int(bad.shape[0])})


def poisoned_out(case: Case, spare: int = 3) -> torch.Tensor:
    T = case.batch.num_tokens
    out = torch.full((T + spare, *case.q.shape[1:]), float("nan"), dtype=case.out_dtype, device=case.q.device)
    out[T:] = OUT_POISON
    return out


def check_attention(case: Case, sel: TopkBuffer, out: torch.Tensor, details: dict[str, Any]) -> None:
    """``out[:T]`` against the oracle on ``sel``; padding rows zero; spare rows untouched."""
    T = case.batch.num_tokens
    if not torch.equal(out[T:], torch.full_like(out[T:], OUT_POISON)):
        raise CaseFailure(f"attention wrote output rows past the step ({T} tokens); write only out[:T]",
                          details)
    got = out[:T].detach().to("cpu", torch.float64)
    pos = case.batch.token_positions.to("cpu")
    real, pad = pos >= 0, pos < 0
    if pad.any() and not bool((got[pad] == 0).all()):
        t = int(pad.nonzero()[0, 0])
        raise CaseFailure(f"padding token {t} (position -1) must output zeros; got values like "
                          f"{got[pad][got[pad] != 0][:3].tolist()}", details)
    bad = ~torch.isfinite(got[real])
    if bad.any():
        t = int(real.nonzero()[bad.any(dim=-1).any(dim=-1).nonzero()[0, 0], 0])
        raise CaseFailure(f"non-finite output for token {t} (NaN/inf, or a row left unwritten: rows "
                          f"start as NaN)", details)
    ref = oracle_attention_cached(case, sel)
    dtype = str(case.out_dtype).removeprefix("torch.")
    mean_tol, max_tol = TOLERANCES[dtype]
    if quantized(case):      # docs/spec.md §4: a backend may round as the model's authors do
        mean_tol, max_tol = max(mean_tol, QUANTIZED_TOLERANCE[0]), max(max_tol, QUANTIZED_TOLERANCE[1])
    err = (got - ref).abs()[real]
    floor = (ref.to(case.out_dtype).to(torch.float64) - ref).abs()[real]
    if err.numel():
        details.update(mean_err=float(err.mean()), max_err=float(err.max()),
                       floor_mean=float(floor.mean()), mean_tol=mean_tol, max_tol=max_tol)
        if details["mean_err"] > mean_tol or details["max_err"] > max_tol:
            worst = torch.nonzero(err == err.max())[0].tolist()
            token = int(real.nonzero()[worst[0], 0])
            raise CaseFailure(
                f"attention error vs fp64 oracle: mean {details['mean_err']:.3g} (tol {mean_tol:g}), max "
                f"{details['max_err']:.3g} (tol {max_tol:g}) at token {token}, head {worst[1]} "
                f"(the {dtype} rounding floor alone is mean {details['floor_mean']:.3g})", details)
