"""The data checks of a step: what the batch's tensors hold must describe a step of the cache.

Shapes are facts, judged once per class (:mod:`mm3.contract.checks`); contents
are not: an engine rewrites its block table, lengths and query starts in place
from one step to the next, so they are judged every step, never remembered by
the tensor that holds them. The rules (docs/errors.md §2.6):

* ``query_start_loc`` starts at 0, never decreases and ends at the step's token count;
* the first ``num_decodes`` requests hold ``decode_query_len`` tokens each, or none
  (padding), ``num_decode_tokens`` of them together; a prefill holds at least one
  and at most ``max_prefill_query_len`` (which sizes the kernels' grids);
* a request's ``seq_len`` is at least its query length (it counts this step's tokens)
  and its blocks fit the block table; padding decodes have ``seq_len`` 0 or no tokens;
* every token's position and request (and each request's context length, when
  given) are the ones those lengths give;
* every block-table entry a request uses is a page of the cache (an id past the
  cache, read as an address, could fault the whole device);
* per-tensor and per-head fp8 K/V scales are finite and positive.

Three ways to check; only the first ever waits for a device, once per shape class:

* :func:`check_on_host` reads the tensors on the host and raises at once: for a
  batch in host memory, every step (a few numpy operations), and for any batch
  at the first step of its shape class (one synchronisation per class);
* :meth:`FaultFlag.record` runs the same rules as torch operations on the
  device and lowers a flag word, with no synchronisation;
* an indexer whose capabilities declare ``reports_bad_page_ids`` clamps every
  page id its kernels load and lowers the same word (its kernels read every
  used entry anyway: no launch of mm3's).

The word lives in host memory the device writes (pinned and mapped), so the
host reads it with no copy: :meth:`FaultFlag.raise_pending` turns a fault into
an :class:`~mm3.contract.errors.InputError` at the next step (or at
:meth:`FaultFlag.check`, which waits). It is an int64: ``request << 32 |
block`` of a bad page id (:func:`fault_word`, what kernels write), or
``LENGTHS | rule << 40 | index`` for the other rules, or :data:`NO_FAULT`.

Example:
    >>> import torch
    >>> from mm3 import BatchMetadata
    >>> b = BatchMetadata.build([1], [20], torch.tensor([[3, 9]]), block_size=16, num_decodes=1)
    >>> check_on_host(b, num_pages=8, entry="demo")   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: demo: request 0, block 1: batch.block_table[0, 1] = 9 is not a page id in [0, 8)...
    >>> flag = FaultFlag("cpu")
    >>> flag.record(b, num_pages=8)      # no sync: torch ops on the batch's device
    >>> flag.raise_pending()             # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: mm3: request 0, block 1: batch.block_table[0, 1] is not a page id in [0, 8)...
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch

from mm3.contract.errors import InputError
from mm3.contract.facts import LAYER_NAMES, ArgNames

if TYPE_CHECKING:  # batch.py imports this module to check num_pages when a batch is built
    from mm3.contract.batch import BatchMetadata

__all__ = ["check_on_host", "FaultFlag", "NO_FAULT", "LENGTHS", "fault_word", "derive_tokens", "derive_context"]

#: the flag word's value while no fault was met
NO_FAULT = 2 ** 63 - 1
#: the bit that marks a fault of a rule other than a page id (``LENGTHS | rule << 40 | index``)
LENGTHS = 1 << 62

# the rules other than page ids, by number: (what, about a request or a token)
_RULES = {
    1: "starts {qsl} at {v} instead of 0 (offsets sliced from a longer batch's must be rebased: subtract the "
       "first entry, and slice the per-token tensors alike)",
    2: "has a negative query length: query_start_loc decreases there",
    3: "ends query_start_loc at {v} tokens, but the step has {T} (num_tokens)",
    4: "is one of the num_decodes={nd} decodes but holds {v} query tokens, not decode_query_len={dql} (or 0 "
       "for padding); if it is a prefill, num_decodes is too large",
    5: "closes the decodes at token {v}, but num_decode_tokens is {ndt}",
    6: "has seq_len {v} < query_len {q}: seq_len counts the cached tokens including this step's",
    7: "is a prefill without query tokens; prefills need >= 1 token (list empty requests among the decodes as "
       "padding)",
    8: "holds {v} query tokens, more than max_prefill_query_len={mpq} (which sizes the kernels' grids)",
    9: "has seq_len {v}, which needs {need} blocks of {B} but the block table has only {M} columns",
    10: "has a position or request that the lengths do not give ({v})",
    11: "has {context_lens} {v} cached tokens",
}


def fault_word(request: int, block: int) -> int:
    """The flag word of a bad page id ``block_table[request, block]``: ``request << 32 | block``
    (what a reporting backend's kernels lower the word to)."""
    return (request << 32) | block


def _where(rule: int, index: int) -> str:
    return f"token {index}" if rule == 10 else f"request {index}"


def _message(word: int, batch: "Optional[BatchMetadata]", num_pages: int, names: ArgNames,
             value: object = "?", page: Optional[int] = None, q: object = "?") -> str:
    if word < LENGTHS:
        r, b = word >> 32, word & 0xFFFFFFFF
        entry = f"{names.block_table}[{r}, {b}]" + ("" if page is None else f" = {page}")
        return (f"request {r}, block {b}: {entry} is not a page id in [0, {num_pages}) (the cache has {num_pages} "
                f"pages); every entry a request's seq_len uses must name a page of the cache")
    rule, index = (word - LENGTHS) >> 40, word & ((1 << 40) - 1)
    # values a device-side report does not carry show as "?"
    facts: dict[str, object] = dict(v=value, q=q, qsl=names.query_start_loc, context_lens=names.context_lens)
    facts.update(dict.fromkeys(("T", "nd", "dql", "ndt", "mpq", "M", "B", "need"), "?"))
    if batch is not None:
        B, known = batch.block_size, batch.__dict__
        facts.update(T=batch.num_tokens, nd=batch.num_decodes, dql=batch.decode_query_len, B=B,
                     ndt=known.get("num_decode_tokens", "?"), mpq=known.get("max_prefill_query_len", "?"),
                     M=batch.block_table.shape[1], need=-(-value // B) if isinstance(value, int) else "?")
    return (f"{_where(rule, index)} {_RULES[rule].format(**facts)}; fix {names.query_start_loc}, {names.seq_lens} "
            f"and {names.block_table} where they are made ({names.where_made})")


def _request_rules(qsl: np.ndarray, sl: np.ndarray, nd: int, dql: int, ndt: int, mpq: int, B: int, M: int,
                   T: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """``(bad, value)`` of rules 1..9 over the requests (``qsl`` and ``sl`` int64)."""
    R = sl.shape[0]
    ql = qsl[1:] - qsl[:-1]
    req = np.arange(R)
    dec = req < nd
    pad = dec & (sl == 0)
    first, last = req == 0, req == R - 1
    return ((first & (qsl[0] != 0), qsl[:-1]), (ql < 0, ql), (last & (qsl[-1] != T), qsl[1:]),
            (dec & (ql != 0) & (ql != dql), ql), (first & (qsl[min(nd, R)] != ndt), qsl[min(nd, R)] + 0 * req),
            (~pad & (sl < ql), sl), (~dec & (ql < 1), ql), (~dec & (ql > mpq), ql),
            ((sl < 0) | ((sl + B - 1) // B > M), sl))


def _first_fault(qsl: np.ndarray, sl: np.ndarray, bt: np.ndarray, t2r: np.ndarray, pos: np.ndarray,
                 ctx: Optional[np.ndarray], nd: int, dql: int, ndt: int, mpq: int, B: int, T: int,
                 num_pages: int) -> Optional[tuple[int, object, object]]:
    """``(word, value, query length)`` of the first rule the host arrays break, or ``None``. numpy only: a
    good step costs a few vectorised passes; which rule broke is worked out only when one did."""
    R, M = bt.shape
    if not R:
        return None if T == 0 else (LENGTHS | 3 << 40, int(qsl[-1]), "?")
    qsl, sl = qsl.astype(np.int64), sl.astype(np.int64)
    rules = _request_rules(qsl, sl, nd, dql, ndt, mpq, B, M, T)
    any_bad = rules[0][0]
    for bad, _ in rules[1:]:
        any_bad = any_bad | bad
    ql = qsl[1:] - qsl[:-1]
    if np.count_nonzero(any_bad):
        for rule, (bad, value) in enumerate(rules, 1):
            if np.count_nonzero(bad):
                r = int(np.argmax(bad))
                return LENGTHS | rule << 40 | r, int(value[r]), int(ql[r])
    # every token's request and position as the lengths give them (padding decodes: -1)
    pad = (np.arange(R) < nd) & (sl == 0)
    want_req = np.repeat(np.arange(R), ql)
    want_pos = np.arange(T) - np.repeat(qsl[1:] - sl, ql)
    want_pos[pad[want_req]] = -1
    wrong = (want_pos != pos) | (want_req != t2r)
    if np.count_nonzero(wrong):
        t = int(np.argmax(wrong))
        return (LENGTHS | 10 << 40 | t, f"position {int(pos[t])} of request {int(t2r[t])}, expected "
                f"{int(want_pos[t])} of request {int(want_req[t])}", "?")
    if ctx is not None:
        want_ctx = np.where(pad, 0, np.maximum(sl - ql, 0))
        bad = ctx != want_ctx
        if np.count_nonzero(bad):
            r = int(np.argmax(bad))
            return LENGTHS | 11 << 40 | r, f"{int(ctx[r])}, but its seq_len and query length give {int(want_ctx[r])}", "?"
    used = np.arange(M)[None, :] < ((sl + B - 1) // B)[:, None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if np.count_nonzero(bad):
        r, b = (int(v) for v in np.argwhere(bad)[0])
        return fault_word(r, b), int(bt[r, b]), "?"
    return None


def check_on_host(batch: "BatchMetadata", num_pages: int, *, entry: str, names: ArgNames = LAYER_NAMES,
                  scales: tuple[Optional[torch.Tensor], ...] = ()) -> None:
    """Raise :class:`InputError` (prefixed with ``entry``) for the first rule the batch's contents break.

    Reads the tensors on the host: no copy for a batch in host memory, one
    synchronisation for one on a device. ``scales``: the K/V scales to check too
    (per-tensor and per-head ones; per-slot scales are cache contents, not read).
    """
    for name, s in zip((names.k_scale, names.v_scale), scales):
        if s is not None and s.dim() == 1 and not bool((torch.isfinite(s) & (s > 0)).all()):
            raise InputError(f"{entry}: {name} must be finite and > 0 for every KV head (value = stored * scale), "
                             f"got {s.tolist()}")
    ctx = batch.__dict__.get("context_lens")
    a = [t.cpu().numpy() for t in (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.token_to_request,
                                   batch.token_positions)]
    fault = _first_fault(*a, None if ctx is None else ctx.cpu().numpy(), batch.num_decodes,
                         batch.decode_query_len, batch.num_decode_tokens, batch.max_prefill_query_len,
                         batch.block_size, batch.num_tokens, num_pages)
    if fault is not None:
        word, value, q = fault
        page = value if word < LENGTHS else None
        raise InputError(f"{entry}: " + _message(word, batch, num_pages, names, value, page=page, q=q))


def derive_context(qsl: torch.Tensor, sl: torch.Tensor, nd: int) -> torch.Tensor:
    """Each request's cached tokens before this step (0 for padding decodes)."""
    pad = (torch.arange(sl.shape[0], device=sl.device) < nd) & (sl == 0)
    return (sl - (qsl[1:] - qsl[:-1])).clamp_(min=0).masked_fill_(pad, 0)


def derive_tokens(qsl: torch.Tensor, sl: torch.Tensor, nd: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, requests)`` of the step's ``T`` tokens as the lengths give them (padding: ``-1``)."""
    ends = qsl[1:]
    t = torch.arange(T, dtype=qsl.dtype, device=qsl.device)
    R = sl.shape[0]
    if not R:
        return torch.full_like(t, -1), torch.zeros_like(t)
    req = torch.searchsorted(ends, t, right=True).clamp_(max=R - 1).to(qsl.dtype)
    pad = (torch.arange(R, device=sl.device) < nd) & (sl == 0)
    pos = (sl[req] - (ends[req] - t)).masked_fill_(pad[req], -1)
    return pos, req


def _device_word(batch: "BatchMetadata", num_pages: int) -> torch.Tensor:
    """The smallest fault word of the batch's contents, as torch ops on its device (no synchronisation)."""
    qsl, sl, bt = (getattr(batch, f).to(torch.int64) for f in ("query_start_loc", "seq_lens", "block_table"))
    R, M = bt.shape
    T, nd, B = batch.num_tokens, batch.num_decodes, batch.block_size
    dev = sl.device
    words = []
    if R:
        ql = qsl[1:] - qsl[:-1]
        req = torch.arange(R, device=dev)
        dec, pad = req < nd, (req < nd) & (sl == 0)
        ndt, mpq = batch.num_decode_tokens, batch.max_prefill_query_len
        rules = [(req == 0) & (qsl[0] != 0), ql < 0, (req == R - 1) & (qsl[-1] != T),
                 dec & (ql != 0) & (ql != batch.decode_query_len), (req == 0) & (qsl[min(nd, R)] != ndt),
                 ~pad & (sl < ql), ~dec & (ql < 1), ~dec & (ql > mpq), (sl < 0) | ((sl + B - 1) // B > M)]
        for rule, bad in enumerate(rules, 1):
            words.append(torch.where(bad, LENGTHS | rule << 40 | req, NO_FAULT).amin())
        pos, t2r = derive_tokens(qsl, sl, nd, T)
        tok = torch.arange(T, device=dev)
        wrong = (pos != batch.token_positions) | (t2r != batch.token_to_request)
        words.append(torch.where(wrong, LENGTHS | 10 << 40 | tok, NO_FAULT).amin() if T else words[0])
        ctx = batch.__dict__.get("context_lens")
        if ctx is not None:
            words.append(torch.where(ctx != derive_context(qsl, sl, nd), LENGTHS | 11 << 40 | req, NO_FAULT).amin())
        need = (sl + B - 1) // B
        cols = torch.arange(M, device=dev)
        bad = (cols[None, :] < need[:, None]) & ((bt < 0) | (bt >= num_pages))
        words.append(torch.where(bad, req[:, None] << 32 | cols[None, :], NO_FAULT).amin() if M else words[0])
    return torch.stack(words).amin().view(1) if words else torch.full((1,), NO_FAULT, dtype=torch.int64, device=dev)


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


class FaultFlag:
    """A sticky word of the first bad content a step met, lowered on the device, read by the host.

    :attr:`word` (int64, one element, a tensor on ``device``) is what a
    reporting backend's kernels lower; :meth:`record` lowers it with torch ops
    for the others (no host sync). Its memory is host memory wherever the
    device can address it (pinned and mapped: CUDA and ROCm GPUs; plain memory
    on the CPU), so the device's stores land where the host reads them:
    :meth:`raise_pending` reads the word with no copy, no event and no launch,
    and raises :class:`InputError` when a fault arrived — at the owner's next
    step (or at :meth:`check`, which waits for the device). A CUDA graph replays
    the kernels' (or the captured record's) stores with no Python run: the word
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
        #: what the message of the last recorded step names: its entry, spelling, cache size and batch
        self.entry, self.names, self.num_pages = "mm3", LAYER_NAMES, 0
        self._batch: "Optional[BatchMetadata]" = None
        # a device word: raise_pending reads the host copy only once a copy was started
        self._copied = False

    def about(self, entry: str, names: ArgNames, num_pages: int, batch: "BatchMetadata") -> None:
        """Name what a fault found from now on belongs to (no device work)."""
        self.entry, self.names, self.num_pages, self._batch = entry, names, num_pages, batch

    def record(self, batch: "BatchMetadata", num_pages: int, *, graph: bool = False) -> None:
        """Check ``batch``'s contents against ``num_pages`` with torch ops on its device; no host sync.

        ``graph``: inside CUDA-graph capture (the replays lower the word; an eager step reads it).
        """
        self.num_pages, self._batch = num_pages, batch
        torch.minimum(self.word, _device_word(batch, num_pages), out=self.word)
        if not graph:
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
        """Raise :class:`InputError` if a step met a fault (reads host memory only, never waits)."""
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
        raise InputError(f"{self.entry}: " + _message(got, self._batch, self.num_pages, self.names)
                         + " (found on the device in an earlier step, whose output is not valid; reported at "
                           "the next step)")

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
