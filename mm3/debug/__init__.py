"""The contract guard (by default on the first step of each kind of batch) and its checks.

* :mod:`.guard` - :class:`GuardedBackend`: every backend call checked against the contract;
* :mod:`.topk_rows` - docs/spec.md §3's row format rules, vectorised over a step;
* :mod:`.fences` - snapshots proving nothing outside a writable view changed;
* :mod:`.inputs` - the finiteness of an output row's inputs.

``Settings.check_contracts`` (``MM3_CHECK_CONTRACTS``) says when a layer uses it:
``"first"`` (default), ``"always"`` or ``"never"``; wrap one backend by hand with
:func:`guard_backend`.
"""

from mm3.debug.guard import (
    GUARD_SENTINEL, RULES, GuardedBackend, check_topk_allocation, guard_backend, unguarded,
)
from mm3.debug.topk_rows import TopkRowViolation, find_topk_violation

__all__ = [
    "GUARD_SENTINEL", "RULES", "GuardedBackend", "guard_backend", "unguarded", "check_topk_allocation",
    "TopkRowViolation", "find_topk_violation",
]
