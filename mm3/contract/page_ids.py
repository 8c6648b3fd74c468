"""Every block-table entry a step uses must be a page of the cache (docs/errors.md §2.6).

A page id past the cache or below zero names no page. The built-in kernels
clamp it into the cache and read a real page (wrong output; the Triton
kernels' ``load_page``); a backend that does not may read memory outside the
cache (a fault). Either way the step is wrong, so it must be reported.
``BatchMetadata.build(..., num_pages=...)`` catches it when the batch is built; when the caller did not
pass ``num_pages`` (the README example does not), the layer checks each new
block table against the cache it is used with:

* on the host (:func:`check_page_ids`) when the block table lives in host
  memory (no device to wait for): once per block table, however many layers
  and hooks see it;
* on the device (:class:`PageIdFlag`) otherwise, without a host sync: a few
  torch ops raise a sticky flag tensor that the host reads one step later,
  through an asynchronous copy, and :meth:`PageIdFlag.raise_pending` turns
  into an :class:`~mm3.contract.errors.InputError` at the layer's next step.

Example:
    >>> import torch
    >>> from mm3 import BatchMetadata
    >>> b = BatchMetadata.build([1], [20], torch.tensor([[3, 9]]), block_size=16, num_decodes=1)
    >>> check_page_ids(b, num_pages=8)   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: request 0, block 1: block_table[0, 1] = 9 is not a page id in [0, 8) ...
    >>> flag = PageIdFlag("cpu")
    >>> flag.record(b, num_pages=8)      # no sync: only torch ops on the batch's device
    >>> flag.raise_pending()             # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: request 0, block 1: block_table[0, 1] = 9 ... (found on the device ...
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from mm3.contract.errors import InputError

if TYPE_CHECKING:  # batch.py imports this module to check num_pages when a batch is built
    from mm3.contract.batch import BatchMetadata

__all__ = ["check_page_ids", "PageIdFlag"]


class _Seen:
    """The block tables already checked, so a step's layers and hooks check each once.

    Keyed by the tables' ids and in-place version counters (``update_`` for a
    graph replay bumps them, forcing a new check); an entry holds the tensors
    themselves, so their ids cannot be reused while it is remembered. One dict
    lookup per step and layer.
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._keys: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(batch: BatchMetadata, num_pages: int) -> tuple[Any, ...]:
        bt, sl = batch.block_table, batch.seq_lens
        return (id(bt), bt._version, id(sl), sl._version, batch.block_size, num_pages), (bt, sl)

    def seen(self, key: tuple[Any, ...]) -> bool:
        held = self._keys.get(key[0])
        return held is not None and held[0] is key[1][0] and held[1] is key[1][1]

    def add(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._keys[key[0]] = key[1]
            while len(self._keys) > self._size:
                del self._keys[next(iter(self._keys))]


_SEEN = _Seen()        # checked on the host: known good
_RECORDED = _Seen()    # checked on a device: a PageIdFlag holds the verdict


def _bad_entries(batch: BatchMetadata, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bad, table)``: ``[R, M]`` mask of the used entries that are not page ids, the table as int64."""
    need = (batch.seq_lens.to(torch.int64) + batch.block_size - 1) // batch.block_size  # [R]
    cols = torch.arange(batch.block_table.shape[1], device=batch.block_table.device)
    bt = batch.block_table.to(torch.int64)
    return (cols[None, :] < need[:, None]) & ((bt < 0) | (bt >= num_pages)), bt


def _message(r: int, b: int, page: int, seq_len: int, block_size: int, num_pages: int,
             hint: bool = True) -> str:
    blocks = -(-seq_len // block_size)
    msg = (f"request {r}, block {b}: block_table[{r}, {b}] = {page} is not a page id in "
           f"[0, {num_pages}) (seq_len {seq_len} uses {blocks} blocks); the cache has {num_pages} pages")
    return msg + (". Build the batch with BatchMetadata.build(..., num_pages=caches.num_pages) to "
                  "catch this where the table is made" if hint else "")


def check_page_ids(batch: BatchMetadata, num_pages: int, *, hint: bool = True) -> None:
    """Raise :class:`InputError` naming request, block and id when a used entry is not a page id.

    Once per block table (and its contents' version); one host read of the
    result (free when the table lives in host memory). ``hint``: end the
    message with the advice to pass ``num_pages`` to ``BatchMetadata.build``.
    """
    if batch.num_requests == 0 or batch.block_table.shape[1] == 0:
        return
    key = _Seen.key(batch, num_pages)
    if _SEEN.seen(key):
        return
    bad, bt = _bad_entries(batch, num_pages)
    if bool(bad.any()):
        r, b = (int(v) for v in bad.nonzero()[0])
        raise InputError(_message(r, b, int(bt[r, b]), int(batch.seq_lens[r]), batch.block_size,
                                  num_pages, hint))
    _SEEN.add(key)


class PageIdFlag:
    """A sticky device-side record of the first bad block-table entry, read one step later.

    :meth:`record` runs a few torch ops on the batch's device (no host sync)
    and keeps the first offence ``(request, block, id, seq_len, num_pages)``;
    an asynchronous copy brings it to host memory (pinned where the device
    has it). :meth:`raise_pending` reads that host copy, without waiting for
    the device, and raises :class:`InputError` when an offence arrived; so a
    bad id is reported at the layer's next step (or at :meth:`check`, which
    waits). Under CUDA-graph capture :meth:`record` is captured with the
    step, so replays are checked too.

    Args:
        device: where the block tables live.
    """

    _NONE = -1

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        self._dev = torch.full((6,), self._NONE, dtype=torch.int64, device=self.device)
        self._host = torch.full((6,), self._NONE, dtype=torch.int64)
        if self.device.type != "cpu":
            try:  # pinned host memory makes the copy asynchronous
                self._host = self._host.pin_memory()
            except RuntimeError:
                pass
        self._lock = threading.Lock()
        # raise_pending reads the host copy only while a recorded check may still report: from a
        # record until its copy has landed (an event says so), or for ever once a CUDA graph
        # captured one (each replay records again, with no Python run)
        self._armed = False
        self._sticky = False
        self._landed: Optional[Any] = None
        # the table a captured step's first hook recorded: its second hook (same table, same
        # replay) need not capture the check again
        self._captured: Optional[tuple[Any, ...]] = None

    def record(self, batch: BatchMetadata, num_pages: int, *, always: bool = False, start: bool = True) -> None:
        """Check ``batch``'s used entries against ``num_pages`` on the device; no host sync.

        A block table already recorded (by any flag: every layer of a step shares the table)
        is skipped unless ``always`` (CUDA-graph capture: the replays must check). Under
        capture, ``start=False`` (a step's later hook) skips the table the same flag's step
        start recorded just before: one check per layer and replay, not one per hook.
        """
        R, M = batch.block_table.shape
        key = _Seen.key(batch, num_pages)
        captured, self._captured = self._captured, (key[0] if always and start else None)
        if always and not start and captured == key[0]:
            return
        if R == 0 or M == 0 or (not always and (_RECORDED.seen(key) or _SEEN.seen(key))):
            return
        _RECORDED.add(key)
        bad, bt = _bad_entries(batch, num_pages)
        n = R * M
        first = torch.where(bad.flatten(), torch.arange(n, device=bt.device), n).amin()   # n: none
        at = first.clamp(max=n - 1)
        r = at // M
        # index_select, not t[at]: a 0-d index tensor would be read on the host (a sync, and an
        # error while a CUDA graph is being captured)
        page = bt.flatten().index_select(0, at.view(1))[0]
        seq_len = batch.seq_lens.to(torch.int64).index_select(0, r.view(1))[0]
        new = torch.stack([r, at % M, page.to(torch.int64), seq_len,
                           torch.full_like(r, num_pages), torch.full_like(r, batch.block_size)])
        with self._lock:
            keep = (self._dev[0] >= 0) | (first >= n)        # an earlier offence, or none now
            self._dev.copy_(torch.where(keep, self._dev, new))
            self._host.copy_(self._dev, non_blocking=True)
            self._armed = True
            self._sticky = self._sticky or always
            self._landed = None
            if self.device.type == "cuda" and not always:
                self._landed = torch.cuda.Event()
                self._landed.record()

    def raise_pending(self) -> None:
        """Raise :class:`InputError` if a recorded step used a bad entry (reads host memory only)."""
        if not self._armed:
            return
        with self._lock:
            landed = self._landed is None or self._landed.query()   # before the read: then it is final
            r, b, page, seq_len, num_pages, block_size = (int(v) for v in self._host.tolist())
            if r < 0:
                self._armed = self._sticky or not landed
                return
            self._armed = self._sticky
            self._dev.fill_(self._NONE)
            self._host.fill_(self._NONE)
        raise InputError(_message(r, b, page, seq_len, block_size, num_pages)
                         + " (found on the device in an earlier step of this layer, whose output "
                           "is not valid; reported at the next step)")

    def check(self) -> None:
        """Wait for the device, then :meth:`raise_pending`."""
        with self._lock:
            self._host.copy_(self._dev)
            self._armed = True
        self.raise_pending()
