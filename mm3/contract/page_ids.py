"""Every block-table entry a step uses must be a page of the cache (docs/errors.md §2.6).

A page id past the cache or below zero names no page. A backend that reads
such an id as an address may read memory outside the cache (a fault that
poisons the whole CUDA context), so the step is wrong and must be reported,
and the check must not cost every step a trip to the host. Three places
check, each once:

* when the batch is built: ``BatchMetadata.build(..., num_pages=...)``;
* on the host (:func:`check_page_ids`) when the block table lives in host
  memory: once per batch object and cache size, however many layers see it
  (the verdict is kept by the batch and dropped by its in-place updates);
* on the device otherwise, into a layer's :class:`PageIdFlag`: an indexer
  backend whose capabilities declare ``reports_bad_page_ids`` clamps every id
  it loads and lowers the flag's word to a bad entry it meets (its
  kernels read every used entry anyway: no launch of its own); for any other
  backend the layer records the check with a few torch ops, once per batch
  (or in every captured step). The word is host memory that the device
  writes (pinned and mapped), so the host reads it with no copy and no
  launch: :meth:`PageIdFlag.raise_pending` turns a fault into an
  :class:`~mm3.contract.errors.InputError` at the layer's next step (or at
  :meth:`PageIdFlag.check`, which waits).

The word is an int64: ``request << 32 | block`` of a bad entry, or
:data:`NO_FAULT`. It is lowered with a plain load and store (atomics on host
memory are not portable), so of bad entries met at once by several programs
it keeps one, not always the smallest; each is a true report.

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
    mm3.contract.errors.InputError: request 0, block 1: block_table[0, 1] is not a page id in [0, 8)...found on the device...
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch

from mm3.contract.errors import InputError

if TYPE_CHECKING:  # batch.py imports this module to check num_pages when a batch is built
    from mm3.contract.batch import BatchMetadata

__all__ = ["check_page_ids", "PageIdFlag", "NO_FAULT", "fault_word"]

#: the flag word's value while no bad entry was met
NO_FAULT = 2 ** 63 - 1


def fault_word(request: int, block: int) -> int:
    """The flag word of a bad entry ``block_table[request, block]``: ``request << 32 | block``
    (what a reporting backend's kernels lower the word to; the smallest offence wins)."""
    return (request << 32) | block


def _bad_entries(batch: BatchMetadata, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bad, table)``: ``[R, M]`` mask of the used entries that are not page ids, the table as int64."""
    need = (batch.seq_lens.to(torch.int64) + batch.block_size - 1) // batch.block_size  # [R]
    cols = torch.arange(batch.block_table.shape[1], device=batch.block_table.device)
    bt = batch.block_table.to(torch.int64)
    return (cols[None, :] < need[:, None]) & ((bt < 0) | (bt >= num_pages)), bt


def _message(r: int, b: int, page: Optional[int], num_pages: int, seq_len: Optional[int] = None,
             block_size: Optional[int] = None, hint: bool = True) -> str:
    entry = f"block_table[{r}, {b}]" + ("" if page is None else f" = {page}")
    msg = f"request {r}, block {b}: {entry} is not a page id in [0, {num_pages})"
    if seq_len is not None and block_size is not None:
        msg += f" (seq_len {seq_len} uses {-(-seq_len // block_size)} blocks)"
    msg += f"; the cache has {num_pages} pages"
    return msg + (". Build the batch with BatchMetadata.build(..., num_pages=caches.num_pages) to "
                  "catch this where the table is made" if hint else "")


def _verdicts(batch: BatchMetadata) -> dict[Any, bool]:
    """The batch's own memo of page-id verdicts, by cache size (dropped by its in-place updates)."""
    return batch.page_id_verdicts


def check_page_ids(batch: BatchMetadata, num_pages: int, *, hint: bool = True) -> None:
    """Raise :class:`InputError` naming request, block and id when a used entry is not a page id.

    Once per batch and ``num_pages``; one host read of the result (for a table
    in host memory, a few numpy operations on it, no copy: every custom-op call
    of an engine on the CPU pays it). ``hint``: end the message with the advice
    to pass ``num_pages`` to ``BatchMetadata.build``.
    """
    if batch.num_requests == 0 or batch.block_table.shape[1] == 0:
        return
    verdicts = _verdicts(batch)
    if verdicts.get(num_pages) == "host":
        return
    if batch.block_table.device.type == "cpu":
        bt = batch.block_table.numpy()
        need = (batch.seq_lens.numpy().astype(np.int64) + batch.block_size - 1) // batch.block_size
        bad = (np.arange(bt.shape[1])[None, :] < need[:, None]) & ((bt < 0) | (bt >= num_pages))
        found = bool(bad.any())
    else:
        bad_t, bt_t = _bad_entries(batch, num_pages)
        found = bool(bad_t.any())
        bad, bt = (bad_t.cpu().numpy(), bt_t.cpu().numpy()) if found else (None, None)
    if found:
        r, b = (int(v) for v in np.argwhere(bad)[0])
        raise InputError(_message(r, b, int(bt[r, b]), num_pages, int(batch.seq_lens[r]), batch.block_size,
                                  hint))
    verdicts[num_pages] = "host"


class _MappedInterface:
    """``__cuda_array_interface__`` of a pinned host tensor: ``torch.as_tensor`` then makes a device
    tensor over the same memory (where the device can address host memory), with no copy."""

    def __init__(self, host: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i8", "version": 3,
                                         "data": (host.data_ptr(), False), "strides": None}


def _shared_word(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(word, host, shared)``: the flag word as a tensor on ``device``, the host memory the host
    reads, and whether they are one memory (the CPU; a device that addresses pinned host memory,
    checked by address, not by device type). Otherwise the word is device memory and ``host`` is
    pinned where possible, so its copies are asynchronous."""
    host = torch.full((1,), NO_FAULT, dtype=torch.int64)
    if device.type == "cpu":
        return host, host, True
    try:
        host = host.pin_memory()
        view = torch.as_tensor(_MappedInterface(host), device=device)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        view = None
    same_device = view is not None and view.device.type == device.type and \
        (device.index is None or view.device.index == device.index)
    if same_device and view.data_ptr() == host.data_ptr():  # type: ignore[union-attr]
        return view, host, True                                 # type: ignore[return-value]
    return host.to(device, copy=True), host, False


class PageIdFlag:
    """A layer's sticky word of a bad block-table entry, lowered on the device, read by the host.

    :attr:`word` (int64, one element, a tensor on ``device``) is what a
    reporting backend's kernels lower; :meth:`record` lowers it with torch ops
    for the others (no host sync). Its memory is host memory wherever the
    device can address it (pinned and mapped: CUDA and ROCm GPUs; plain memory
    on the CPU), so the device's stores land where the host reads them:
    :meth:`raise_pending` reads the word with no copy, no event and no launch,
    and raises :class:`InputError` when a fault arrived — at the layer's next
    step, or at a later one while the step that met it still runs (or at
    :meth:`check`, which waits for the device). A CUDA graph replays the
    kernels' (or the captured record's) stores with no Python run: the word
    stays set until an eager step or :meth:`check` reads it. On a device that
    cannot address host memory the word lives on the device, and each eager
    step that may have lowered it starts an asynchronous copy (:meth:`after_step`).

    Args:
        device: where the block tables live.
    """

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        #: ``word``: what the device lowers; ``shared``: it is host memory, read where it is
        #: (else a device word, copied by after_step)
        self.word, self._host, self.shared = _shared_word(self.device)
        self._read = self._host.numpy()
        self._lock = threading.Lock()
        #: the cache size the message names (the last step's)
        self.num_pages = 0
        # a device word: raise_pending reads the host copy only once a copy was started
        self._copied = False

    def record(self, batch: BatchMetadata, num_pages: int, *, always: bool = False) -> None:
        """Check ``batch``'s used entries against ``num_pages`` with torch ops on its device; no host sync.

        Once per batch and cache size unless ``always`` (a CUDA-graph capture: the
        replays must check). For an indexer backend that does not report bad ids itself.
        """
        self.num_pages = num_pages
        R, M = batch.block_table.shape
        if R == 0 or M == 0:
            return
        verdicts = _verdicts(batch)
        if not always and num_pages in verdicts:
            return
        verdicts.setdefault(num_pages, "device")
        bad, _ = _bad_entries(batch, num_pages)
        rows = torch.arange(R, device=bad.device, dtype=torch.int64)[:, None] << 32
        cols = torch.arange(M, device=bad.device, dtype=torch.int64)[None, :]
        first = torch.where(bad, rows | cols, NO_FAULT).amin().view(1)
        torch.minimum(self.word, first, out=self.word)
        if not always:
            self.after_step()

    def after_step(self) -> None:
        """After an eager step that may have lowered the word: where the word is device memory, start
        the copy that the next :meth:`raise_pending` reads (a shared word needs nothing)."""
        if self.shared:
            return
        with self._lock:
            self._host.copy_(self.word, non_blocking=True)
            self._copied = True

    def raise_pending(self) -> None:
        """Raise :class:`InputError` if a step met a bad entry (reads host memory only, never waits)."""
        if not self.shared and not self._copied:
            return
        with self._lock:
            self._copied = False
            got = int(self._read[0])
            if got == NO_FAULT:
                return
            self._read[0] = NO_FAULT
            if not self.shared:
                self.word.fill_(NO_FAULT)
        r, b = got >> 32, got & 0xFFFFFFFF
        raise InputError(_message(r, b, None, self.num_pages)
                         + " (found on the device in an earlier step of this layer, whose output "
                           "is not valid; reported at the next step)")

    def check(self) -> None:
        """Wait for the device, then :meth:`raise_pending`."""
        with self._lock:
            if self.shared:
                if self.device.type != "cpu":
                    torch.accelerator.synchronize(self.device)
            else:
                self._host.copy_(self.word)
                self._copied = True
        self.raise_pending()
