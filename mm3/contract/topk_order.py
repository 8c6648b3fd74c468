"""Top-k rows put in ascending order on their device: what the core does when a reader or an entry point needs it.

An indexer declares the order it writes a row's ids in (``topk_order``), an
attention the order it needs (``topk_order_required``) and an entry point the
order of the rows it returns (SGLang's functions: ascending); the plan of a call
(:func:`mm3.contract.checks.check`) says whether to sort, and the boundary
(:mod:`mm3.runtime.step`) sorts. Sorting is three device operations on the
step's rows, no host read, so it can be captured in a CUDA graph.

Example:
    >>> import torch
    >>> buf = TopkBuffer(torch.tensor([[[5, -1, 2, 7], [3, 0, -1, -1]]], dtype=torch.int32))
    >>> sort_ascending_(buf).storage.tolist()
    [[[2, 5, 7, -1], [0, 3, -1, -1]]]
    >>> is_ascending(torch.tensor([[0, 3, -1], [4, 1, -1], [2, 2, 5]]))
    tensor([ True, False,  True])
"""

from __future__ import annotations

import torch

from mm3.contract.buffers import TopkBuffer

__all__ = ["sort_ascending_", "sorted_ascending", "is_ascending", "ASCENDING_FIX"]

ASCENDING_FIX = ('write each row\'s valid ids increasing, then -1; or declare topk_order="score", and mm3 sorts the '
                 'rows where a reader or an entry point needs them ascending')
"""What an indexer that declares ``topk_order="ascending"`` and writes a row out of that order must change."""

# int32's sign bit, flipped on every id before the sort and back after it: the non-negative ids keep their order
# and -1 (every negative id) becomes larger than all of them, so one plain sort puts it last
_SIGN = -(2 ** 31)


def _sorted(storage: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_xor(storage, _SIGN).sort(dim=-1).values


def sort_ascending_(buf: TopkBuffer) -> TopkBuffer:
    """Sort every row of ``buf`` ascending, ``-1`` last, in place (K is the last axis of either layout)."""
    s = buf.storage
    torch.bitwise_xor(_sorted(s), _SIGN, out=s)
    return buf


def sorted_ascending(buf: TopkBuffer) -> TopkBuffer:
    """A new dense buffer of ``buf``'s rows in ascending order, ``-1`` last (``buf`` is left as it is)."""
    return TopkBuffer._wrap(torch.bitwise_xor(_sorted(buf.storage), _SIGN), buf.layout)


def is_ascending(ids: torch.Tensor) -> torch.Tensor:
    """Per row of ``ids`` (``[..., K]``): its valid ids never decrease and every ``-1`` follows them. A repeat,
    which only a caller's rows hold (docs/spec.md §3 rules it out of an indexer's), stays next to itself: every
    attention counts it once (§4)."""
    valid = ids >= 0
    cur, nxt = ids[..., :-1], ids[..., 1:]
    # each neighbour pair: valid then valid no smaller, valid then -1, or -1 then -1
    ok = torch.where(valid[..., :-1], (nxt >= cur) | ~valid[..., 1:], ~valid[..., 1:])
    return ok.all(-1)
