"""The contract guard (by default on the first call of each op and kind of batch) and its checks.

* :mod:`.guard` - :func:`checked_call`: a backend's hook call, checked against the contract;
* :mod:`.topk_rows` - docs/spec.md §3's row format rules, vectorised over a step;
* :mod:`.fences` - snapshots proving nothing outside a writable view changed;
* :mod:`.inputs` - the finiteness of an output row's inputs.

``Settings.check_contracts`` (``MM3_CHECK_CONTRACTS``) says which calls of a step it
checks: ``"first"`` (default), ``"always"`` or ``"never"`` (:mod:`mm3.runtime.step`).
"""

from mm3.debug.guard import GUARD_SENTINEL, RULES, check_topk_allocation, checked_call, fill_sentinel
from mm3.debug.topk_rows import TopkRowViolation, find_topk_violation

__all__ = [
    "GUARD_SENTINEL", "RULES", "checked_call", "fill_sentinel", "check_topk_allocation",
    "TopkRowViolation", "find_topk_violation",
]
