"""Where a key lives: the cache row of a position, for pages and for token slots (docs/spec.md §2.1).

Pages: block ``b`` of request ``r`` is page ``block_table[r, b]``, whose ``B`` rows hold its
positions in order, so a kernel adds ``offs_j * (row stride)`` to the page's base. Token slots
(``batch.slots``, caches of one-token pages): position ``p`` of request ``r`` is cache row
``slot_table[slot_rows[r], p]``, gathered key by key, with no copy of the cache and no gathered
pages; a "block" is still ``B`` consecutive positions, only their rows are scattered.

The kernels keep the page arithmetic and ask :func:`block_keys` for the keys of a chunk: with
``SLOTS`` off it returns ``offs_j`` unchanged (the page path compiles as before), with it each
position's slot. :func:`key_offsets` turns either into element offsets through the matching
stride. ``mm3.contract.slots.key_rows`` is the torch statement of the same address.

Every slot is clamped into the cache (a bad entry reads a real row, whose values are wrong but
whose address is valid, as :func:`.tl_utils.load_page` does for pages); a bad slot is reported
by the plugin's judge of the contents (:mod:`.contents`: its ``check_contents``, or its indexer
handed the fault word), which reads every used entry.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .tl_utils import load_page

__all__ = ["SlotArgs", "slot_args", "block_columns", "slot_block", "block_at", "block_keys", "key_offsets"]


class SlotArgs(NamedTuple):
    """The kernel arguments of a batch's token slots (dummies for pages, never read)."""

    table: torch.Tensor      # the slot table, used as it is
    s_row: int               # its row stride
    s_col: int               # its column stride
    num_rows: int            # its rows (a slot row is clamped into them)
    width: int               # its columns (positions past them are never read)
    rows: torch.Tensor       # each request's row of the table


def slot_args(batch: Any, dummy: torch.Tensor) -> tuple[SlotArgs, bool]:
    """``(SlotArgs, SLOTS)`` for a kernel that reads ``batch``'s keys.

    Example:
        >>> import torch
        >>> from mm3.plugin import BatchMetadata, TokenSlots
        >>> table = torch.arange(8, dtype=torch.int32).view(2, 4)
        >>> b = BatchMetadata.build([1], [3], torch.zeros(1, 0, dtype=torch.int32), block_size=2,
        ...                         slots=TokenSlots.of(table, torch.tensor([1])), num_pages=8)
        >>> args, on = slot_args(b, table)
        >>> on, args.s_row, args.num_rows, args.width
        (True, 4, 2, 4)
    """
    slots = batch.slots
    if slots is None:
        return SlotArgs(dummy, 0, 1, 1, 0, dummy), False
    t = slots.table
    return SlotArgs(t, t.stride(0), t.stride(1), t.shape[0], t.shape[1], slots.rows), True


def block_columns(batch: Any) -> int:
    """The most blocks a request of ``batch`` can hold: the block table's columns, or for token slots the
    slot table's columns in blocks (sizes per-block workspaces from shapes only).

    Example:
        >>> import torch
        >>> from mm3.plugin import BatchMetadata
        >>> block_columns(BatchMetadata.build([1], [3], torch.zeros(1, 5, dtype=torch.int32), block_size=2))
        5
    """
    slots = batch.slots
    if slots is None:
        return batch.block_table.shape[1]
    return -(-slots.width // batch.block_size)


@triton.jit
def slot_block(table_ptr, s_row, s_col, num_rows, width, rows_ptr, r, b, B: tl.constexpr):
    """``(pointer to slot_table[slot_rows[r], b * B], columns left from there)``: where block ``b`` of
    request ``r`` finds its positions' slots (the row clamped into the table)."""
    row = tl.load(rows_ptr + r).to(tl.int64)
    row = tl.maximum(tl.minimum(row, num_rows - 1), 0)
    col0 = tl.full((), 0, tl.int64) + b * B    # 64-bit: a long row of a strided table
    return table_ptr + row * s_row + col0 * s_col, width - col0


@triton.jit
def block_keys(offs_j, slot_blk, s_col, cols_left, num_slots, SLOTS: tl.constexpr, mask=None):
    """The keys ``offs_j`` of a block: ``offs_j`` itself for pages, each position's slot (int64, clamped
    into ``[0, num_slots)``) for token slots. ``slot_blk``, ``cols_left``: :func:`slot_block`'s; columns
    past the table, and lanes where ``mask`` is False, give slot 0 (a real row their caller masks)."""
    if SLOTS:
        ok = offs_j < cols_left
        if mask is not None:
            ok = ok & mask
        sid = tl.load(slot_blk + offs_j * s_col, mask=ok, other=0).to(tl.int64)
        return tl.maximum(tl.minimum(sid, num_slots - 1), 0)
    else:
        return offs_j


@triton.jit
def key_offsets(keys, s_page, s_in_page, SLOTS: tl.constexpr):
    """Element offsets of :func:`block_keys`' ``keys`` from their page's base (pages: ``keys * s_in_page``)
    or from the cache's (slots: one slot per page, ``keys * s_page``)."""
    if SLOTS:
        return keys * s_page
    else:
        return keys * s_in_page


@triton.jit
def block_at(bt_ptr, s_bt_r, s_bt_b, num_pages, r, b, st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr,
             B: tl.constexpr, SLOTS: tl.constexpr, mask=None):
    """``(page, slot_blk, cols_left)`` of block ``b`` of request ``r``: its page
    (:func:`.tl_utils.load_page`, ``mask`` as there) for pages; page 0 (the caches' bases) and where its
    positions' slots are (:func:`slot_block`) for token slots."""
    if SLOTS:
        slot_blk, cols_left = slot_block(st_ptr, s_st_r, s_st_c, st_rows, st_width, sr_ptr, r, b, B)
        return 0, slot_blk, cols_left
    else:
        return load_page(bt_ptr + r * s_bt_r + b * s_bt_b, num_pages, mask), st_ptr, 0
