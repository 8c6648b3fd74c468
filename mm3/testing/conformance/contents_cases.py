"""The conformance cases of a backend's own judge of a batch's contents (docs/errors.md §2.6).

mm3 leaves a device batch's contents (query starts, lengths, positions, page ids) to the backend that
reads them where it offers to judge them: its ``check_contents`` hook, or its ``index_topk`` handed the
fault word when it declares ``judges_contents``. A judge that misses a fault lets a bad batch run
silently, so each case breaks one rule of a fresh random step in one place (or none) and the judge's
word must be the one mm3's reference computes (:func:`~mm3.contract.contents.lengths_word`,
:func:`~mm3.contract.contents.pages_word`), bit for bit. One fault in one place is found by one program,
so the word is the same on every device (programs that find faults at once may race for it).

The suite plans these cases only for the judges a backend has (most leave the contents to mm3): a
``check_contents`` hook's whatever ops the backend provides (it is called alone), ``index_topk``'s with it.

Example (the cuda plugin judges in both places; cpu_ref in neither):
    >>> from mm3.testing.conformance import plan_cases
    >>> cases = [c for c in plan_cases("cuda") if c.spec.kind == "contents"]
    >>> len(cases), cases[0].name
    (18, 'contents/check_contents_decodes_fine:bfloat16')
    >>> [c for c in plan_cases("cpu_ref") if c.spec.kind == "contents"]
    []
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.contents import NO_FAULT, lengths_word, pages_word
from mm3.contract.hookspecs import Op
from mm3.testing.conformance.cases import MIXED_H1, Body, CaseContext, CaseSpec, Step
from mm3.testing.conformance.verdicts import CaseFailure
from mm3.testing.factories import Case

__all__ = ["CONTENTS_STEPS", "FAULTS", "JUDGES", "contents_body"]

CONTENTS_STEPS: dict[str, Step] = {
    "decodes": Step(H=2, decodes=(77, 16, 200)),   # a step of decodes alone (a score program per request)
    "mixed": MIXED_H1,
    # token slots (a backend declaring addressings "slots"): the table has a column per position
    "decodes_slots": Step(H=2, decodes=(77, 16, 200), addressing="slots"),
}
"""The steps each judge sees: decodes alone, decodes with prefills, decodes through token slots."""


def _position(case: Case) -> None:
    """The last token's position one lower (still a row of its request's context): rule 10."""
    case.batch.token_positions[-1] -= 1


def _page_id(case: Case) -> None:
    """Request 0's first block-table entry (or slot) past the cache: a used entry that is not a page id."""
    slots = case.batch.slots
    if slots is None:
        case.batch.block_table[0, 0] = case.caches.num_pages
    else:
        slots.table[int(slots.rows[0]), 0] = case.caches.num_pages


FAULTS: dict[str, Callable[[Case], None]] = {"fine": lambda case: None, "position": _position, "page_id": _page_id}
"""Each fault made in place, as an engine's edit would make it: none, a position, a page id."""

JUDGES = ("check_contents", "index_topk")
"""Where a backend judges: its ``check_contents`` hook, or its ``index_topk`` (``judges_contents``)."""


def contents_body(judge: str, fault: str) -> Body:
    """The body of the case of ``judge`` on a step with ``fault`` made in it."""

    def body(ctx: CaseContext, spec: CaseSpec) -> dict[str, Any]:
        case = spec.step.build(spec.dtype, spec.index_dtype, ctx.device, spec.seed)
        FAULTS[fault](case)
        batch, pages = case.batch, case.caches.num_pages
        want = int(torch.minimum(lengths_word(batch), pages_word(batch, pages)))
        # the suite's own step, judged by mm3's reference, before any backend's word: which side is wrong
        if fault == "fine" and want != NO_FAULT:
            raise AssertionError(f"mm3's reference word reports a fault ({want:#x}) on a step built to be fine: "
                                 f"the suite's step builder is wrong")
        if fault != "fine" and want == NO_FAULT:
            made = (FAULTS[fault].__doc__ or fault).rstrip(".")
            raise AssertionError(f"the {fault!r} fault made ({made}) did not change mm3's reference word (still no "
                                 f"fault): the suite's fault maker, or mm3's reference, is wrong")
        word = torch.full((1,), NO_FAULT, dtype=torch.int64, device=ctx.device)
        be = ctx.backend
        if judge == "check_contents":
            assert be.check_contents is not None     # the plan skips a backend without the hook
            try:
                be.check_contents(batch, pages, word)
            except Exception as e:
                be.reraise(e, "check_contents")
        else:   # the hook itself, handed the word, as a layer's step calls it
            p = case.params
            rows = TopkBuffer.allocate(batch.num_tokens, p.num_kv_heads, p.topk, be.capabilities.topk_layout,
                                       ctx.device)
            be.invoke(Op.INDEX_TOPK, (case.index_q, case.caches, batch, p, rows, word))
        got = int(word)
        details = {"tokens": batch.num_tokens, "want": hex(want), "got": hex(got)}
        if got != want:
            found = "no fault" if got == NO_FAULT else f"fault word {got:#x}"
            reference = "none" if want == NO_FAULT else f"{want:#x}"
            made = (FAULTS[fault].__doc__ or "no fault made").rstrip(".")
            raise CaseFailure(
                f"{judge} found {found} where mm3's reference finds {reference} ({fault}: {made}); lower the "
                f"word to the smallest fault word of the rules of docs/errors.md §2.6, as "
                f"mm3.contract.contents.lengths_word and pages_word compute it", details)
        return details

    return body
