"""Token slots: a batch that finds each token's cache row through a slot table (docs/spec.md §2).

Beside the block table (``block_table[r, pos // block_size]`` names the page
of ``block_size`` consecutive positions), a batch may say where every token
lives on its own: ``slot_table[slot_rows[r], pos]`` is the cache row of
position ``pos`` of request ``r``, in caches of one-token pages
(``[num_slots, 1, Hkv, D]``, index keys ``[num_slots, 1, Di]``). That is
SGLang's ``req_to_token`` with ``--page-size 1``: ``slot_table`` is the whole
request pool's table, used as it is (never gathered into pages), and
``slot_rows`` the pool row of each request of the step. The sparse block is
still ``block_size`` positions; only where a position's key lives changes.

:func:`key_rows` is the one torch statement of that address, for both
addressings (the reference backend and the oracle read through it); the
Triton kernels have their own (``backends/triton/addressing.py``).

Example:
    >>> import torch
    >>> table = torch.tensor([[7, 3, 5, 0], [2, 6, 1, 4]], dtype=torch.int32)
    >>> s = TokenSlots.of(table, torch.tensor([1]))
    >>> s.rows.tolist(), s.width
    ([1], 4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from mm3.contract.errors import InputError

if TYPE_CHECKING:
    from mm3.contract.batch import BatchMetadata

__all__ = ["TokenSlots", "key_rows", "slots_fault"]

_INTS = (torch.int32, torch.int64)


class TokenSlots(NamedTuple):
    """The slot table of a batch of token slots and each request's row of it (used as they are).

    Example:
        >>> import torch
        >>> from mm3.contract.batch import BatchMetadata
        >>> table = torch.randperm(8, dtype=torch.int32).view(2, 4)   # two requests' rows of 4 slots
        >>> b = BatchMetadata.build([1], [3], torch.zeros(1, 0, dtype=torch.int32), block_size=2,
        ...                         slots=TokenSlots.of(table, torch.tensor([1])), num_pages=8)
        >>> b.facts.addressing, b.facts.width
        ('slots', 4)
    """

    #: ``[num_table_rows, max_context]`` int32 or int64: ``table[row, pos]`` is a position's cache row
    table: torch.Tensor
    #: ``[R]`` int32 or int64: the table row of each request of the step
    rows: torch.Tensor

    @property
    def width(self) -> int:
        """The most positions a request can hold: the table's columns."""
        return self.table.shape[1]

    @classmethod
    def of(cls, table: object, rows: object, table_name: str = "slot_table",
           rows_name: str = "slot_rows") -> "TokenSlots":
        """Check the types, dims and dtypes (never the contents) and return the pair; errors name the
        arguments as the caller spells them."""
        for name, t, dim, what in ((table_name, table, 2, "[num_table_rows, max_context]"),
                                   (rows_name, rows, 1, "[num_requests]")):
            if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype not in _INTS:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"{name} must be a {dim}-D int32 or int64 tensor {what}, got {got}")
        t, r = table, rows
        assert isinstance(t, torch.Tensor) and isinstance(r, torch.Tensor)
        if t.device != r.device:
            raise InputError(f"{table_name} is on {t.device} and {rows_name} on {r.device}; put them on the step's "
                             f"device")
        return cls(t, r)

    def to(self, device: torch.device | str) -> "TokenSlots":
        return TokenSlots(self.table.to(device), self.rows.to(device))


def key_rows(batch: "BatchMetadata", req: torch.Tensor, pos: torch.Tensor, num_rows: int,
             page_size: int) -> torch.Tensor:
    """The cache row of position ``pos`` of request ``req`` (broadcast, long), counted over the cache's
    flattened ``[num_pages * page_size]`` rows and clamped into them (a position past a request's
    ``seq_len`` reads a real row its caller masks).

    Pages: ``block_table[req, pos // block_size] * page_size + pos % block_size``; token slots:
    ``slot_table[slot_rows[req], pos]`` (``page_size`` 1). ``num_rows``: the cache's rows.

    Example:
        >>> from mm3.contract.batch import BatchMetadata
        >>> b = BatchMetadata.build([1], [3], torch.tensor([[4]]), block_size=4)
        >>> key_rows(b, torch.tensor([0]), torch.arange(3), 32, 4).tolist()
        [16, 17, 18]
    """
    slots = batch.slots
    if slots is None:
        bt = batch.block_table
        B = batch.block_size
        page = bt[req, (pos // B).clamp(0, max(bt.shape[1] - 1, 0))].long()
        page = page.clamp(0, max(num_rows // page_size - 1, 0))
        return page * page_size + pos % B
    table = slots.table
    row = slots.rows.long()[req].clamp(0, max(table.shape[0] - 1, 0))
    return table[row, pos.clamp(0, max(table.shape[1] - 1, 0))].long().clamp(0, max(num_rows - 1, 0))



def slots_fault(table: Any, rows: Any, num_requests: int, names: Any) -> Optional[str]:
    """What is wrong with the facts (shapes, dtypes) of a batch's slot table and slot rows, or ``None``;
    ``names``: the caller's :class:`~mm3.contract.facts.ArgNames`."""
    for name, t, dim in ((names.slot_table, table, 2), (names.slot_rows, rows, 1)):
        if len(t.shape) != dim or t.dtype not in _INTS:
            return f"{name} must be a {dim}-D int32 or int64 tensor, got {t.dtype} {tuple(t.shape)}"
    if tuple(rows.shape) != (num_requests,):
        return (f"{names.slot_rows} has shape {tuple(rows.shape)}, expected ({num_requests},): one slot-table row "
                f"per request ({names.seq_lens})")
    return None
