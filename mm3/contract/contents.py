"""The data checks of a step: what the batch's tensors hold must describe a step of the cache.

Shapes are facts, judged once per plan (:mod:`mm3.contract.checks`); contents
are not: an engine rewrites its block table, lengths and query starts in place
from one step to the next, so they are judged for every batch a step runs on.
The rules (docs/errors.md §2.6), written once, as torch operations
(:func:`lengths_word`, :func:`pages_word`):

* ``query_start_loc`` starts at 0, never decreases and ends at the step's token count;
* the first ``num_decodes`` requests hold ``decode_query_len`` tokens each, or none
  (padding), ``num_decode_tokens`` of them together; a prefill holds at least one
  and at most ``max_prefill_query_len`` (which sizes the kernels' grids);
* a request's ``seq_len`` is at least its query length (it counts this step's tokens)
  and its blocks fit the block table; padding decodes have ``seq_len`` 0 or no tokens;
* every token's position and request (and each request's context length, when
  given) are the ones those lengths give;
* every block-table entry a request uses is a page of the cache (an id past the
  cache, read as an address, could fault the whole device); for token slots
  (:mod:`mm3.contract.slots`), each request with a ``seq_len`` has a slot row of
  the slot table, and every slot a position below its ``seq_len`` names is a row of the
  cache (:func:`slots_word`: every used entry, where pages read one per block);
* per-tensor and per-head fp8 K/V scales are finite and positive.

Where they run (the boundary picks, :mod:`mm3.runtime.step`); only the first
ever waits for a device:

* :func:`check_on_host` runs them on host copies and raises at once: for a
  batch in host memory, every call, and for a device batch at a target's first
  eager step (one synchronisation);
* :meth:`FaultFlag.record` runs them on the device and lowers a flag word, with
  no synchronisation; a backend may do the same in one launch instead (its
  ``check_contents`` hook: the Triton plugins');
* an indexer whose capabilities declare ``reports_bad_page_ids`` clamps every
  page id its kernels load and lowers the same word (its kernels read every
  used entry anyway).

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

import torch

from mm3.contract.errors import InputError
from mm3.contract.facts import LAYER_NAMES, ArgNames, BatchShape

if TYPE_CHECKING:  # batch.py imports this module to check num_pages when a batch is built
    from mm3.contract.batch import BatchMetadata
    from mm3.contract.slots import TokenSlots

__all__ = ["check_on_host", "FaultFlag", "NO_FAULT", "LENGTHS", "fault_word", "derive_tokens", "derive_context",
           "lengths_word", "pages_word", "slots_word"]

#: the flag word's value while no fault was met
NO_FAULT = 2 ** 63 - 1
#: the bit that marks a fault of a rule other than a page id (``LENGTHS | rule << 40 | index``)
LENGTHS = 1 << 62

# the rules other than page ids, by number: (what, about a request or a token)
_RULES = {
    1: "starts {qsl} at {v} instead of 0 (offsets sliced from a longer batch's must be rebased: subtract the "
       "first entry, and slice the per-token tensors alike)",
    2: "has a negative query length",
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
    12: "has slot row {v} ({slot_rows}), which is not a row of {slot_table}; pass each request's own row",
}
#: rule 9 of token slots: a position per column of the slot table
_SLOTS_RULE_9 = "has seq_len {v}, but {slot_table} has only {M} columns (one per position)"
#: columns of the slot table judged at once by the torch form of :func:`slots_word` (bounds its memory)
_SLOT_COLUMNS = 1 << 16


def fault_word(request: int, block: int) -> int:
    """The flag word of a bad page id ``block_table[request, block]``: ``request << 32 | block``
    (what a reporting backend's kernels lower the word to)."""
    return (request << 32) | block


def _where(rule: int, index: int) -> str:
    return f"token {index}" if rule == 10 else f"request {index}"


def _message(word: int, shape: Optional[BatchShape], num_pages: int, names: ArgNames,
             value: object = "?", page: Optional[int] = None, q: object = "?") -> str:
    slots = shape is not None and shape.addressing == "slots"
    if word < LENGTHS and slots:
        r, p = word >> 32, word & 0xFFFFFFFF
        entry = f"{names.slot_table}[{names.slot_rows}[{r}], {p}]" + ("" if page is None else f" = {page}")
        return (f"request {r}, position {p}: {entry} is not a slot of the cache, in [0, {num_pages}); every "
                f"position below a request's seq_len must name a slot of the K/V and index caches")
    if word < LENGTHS:
        r, b = word >> 32, word & 0xFFFFFFFF
        entry = f"{names.block_table}[{r}, {b}]" + ("" if page is None else f" = {page}")
        # a kernel that reads past a request's blocks (its lengths or positions wrong) reports the entry it read
        lengths = "" if page is not None else (f" (if request {r}'s seq_len does not reach block {b}, its query "
                                               f"start, seq_len or positions are what is wrong)")
        return (f"request {r}, block {b}: {entry} is not a page id in [0, {num_pages}) (the cache has {num_pages} "
                f"pages); every entry a request's seq_len uses must name a page of the cache{lengths}")
    rule, index = (word - LENGTHS) >> 40, word & ((1 << 40) - 1)
    # values a device-side report does not carry show as "?"
    facts: dict[str, object] = dict(v=value, q=q, qsl=names.query_start_loc, context_lens=names.context_lens,
                                    slot_table=names.slot_table, slot_rows=names.slot_rows)
    facts.update(dict.fromkeys(("T", "nd", "dql", "ndt", "mpq", "M", "B", "need"), "?"))
    if shape is not None:
        B = shape.block_size
        facts.update(T=shape.num_tokens, nd=shape.num_decodes, dql=shape.decode_query_len, B=B,
                     ndt=shape.num_decode_tokens, mpq=shape.max_prefill_query_len, M=shape.width,
                     need=-(-value // B) if isinstance(value, int) and B else "?")
    text = _SLOTS_RULE_9 if slots and rule == 9 else _RULES[rule]
    return (f"{_where(rule, index)} {text.format(**facts)}; fix {names.query_start_loc}, {names.seq_lens} "
            f"and {names.block_table} where they are made ({names.where_made})")


def _value(word: int, qsl: torch.Tensor, sl: torch.Tensor, bt: torch.Tensor, t2r: torch.Tensor,
           pos: torch.Tensor, ctx: Optional[torch.Tensor], nd: int,
           slots: Optional["TokenSlots"] = None) -> tuple[object, object, Optional[int]]:
    """``(value, query length, page)`` a message names for the fault ``word`` of host tensors."""
    if word < LENGTHS:
        r, b = word >> 32, word & 0xFFFFFFFF
        page = int(bt[r, b] if slots is None else slots.table[slots.rows[r], b])
        return page, "?", page
    rule, i = (word - LENGTHS) >> 40, word & ((1 << 40) - 1)
    if rule == 12:
        return int(slots.rows[i]), "?", None  # type: ignore[union-attr]
    if rule == 10:
        want_pos, want_req = derive_tokens(qsl, sl, nd, pos.shape[0])
        return (f"position {int(pos[i])} of request {int(t2r[i])}, expected {int(want_pos[i])} of request "
                f"{int(want_req[i])}"), "?", None
    if rule == 11:
        assert ctx is not None
        return f"{int(ctx[i])}, but its seq_len and query length give {int(derive_context(qsl, sl, nd)[i])}", "?", None
    ql = int(qsl[i + 1] - qsl[i])
    value = {1: int(qsl[0]), 3: int(qsl[-1]), 5: int(qsl[min(nd, sl.shape[0])]), 6: int(sl[i]), 9: int(sl[i])}
    return value.get(rule, ql), ql, None


def check_on_host(batch: "BatchMetadata", num_pages: Optional[int], *, entry: str, names: ArgNames = LAYER_NAMES,
                  scales: tuple[Optional[torch.Tensor], ...] = ()) -> None:
    """Raise :class:`InputError` (prefixed with ``entry``) for the first rule the batch's contents break.

    The device check's rules (:func:`lengths_word`, :func:`pages_word`) on host copies of the tensors,
    the lengths first: no copy for a batch in host memory, one synchronisation for one on a device.
    ``num_pages``: ``None`` judges no page id. ``scales``: the K/V scales to check too (per-tensor and
    per-head ones; per-slot scales are cache contents, not read).
    """
    for name, s in zip((names.k_scale, names.v_scale), scales):
        if s is not None and s.dim() == 1 and not bool((torch.isfinite(s) & (s > 0)).all()):
            raise InputError(f"{entry}: {name} must be finite and > 0 for every KV head (value = stored * scale), "
                             f"got {s.tolist()}")
    on_cpu = batch.block_table.device.type == "cpu"
    # a slot table is judged where it lives (it is the engine's whole pool: no host copy of it unless a fault)
    judged = batch if on_cpu or batch.slots is not None else batch.to("cpu")
    word = int(lengths_word(judged))
    if word == NO_FAULT and num_pages is not None:
        word = int(pages_word(judged, num_pages))
    if word == NO_FAULT:
        return
    host = batch if on_cpu else batch.to("cpu")
    ctx = host.__dict__.get("context_lens")
    value, q, page = _value(word, host.query_start_loc.long(), host.seq_lens.long(), host.block_table,
                            host.token_to_request, host.token_positions, ctx, host.num_decodes, host.slots)
    raise InputError(f"{entry}: " + _message(word, batch.facts, num_pages or 0, names, value, page=page, q=q))


def derive_context(qsl: torch.Tensor, sl: torch.Tensor, nd: int) -> torch.Tensor:
    """Each request's cached tokens before this step: ``seq_len - query_len``, at least 0 (a padding
    decode's seq_len is 0, so its context is 0 too)."""
    return (sl - (qsl[1:] - qsl[:-1])).clamp_(min=0)


def derive_tokens(qsl: torch.Tensor, sl: torch.Tensor, nd: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, requests)`` of the step's ``T`` tokens as the lengths give them (padding: ``-1``), in
    ``qsl``'s dtype; five torch operations that compute, no synchronisation (three for a step of one-token
    decodes only).

    Token ``t`` of request ``r`` sits at ``seq_len[r] - (query_start_loc[r + 1] - t)``; a padding decode
    (``seq_len`` 0) gives a negative position, which is where ``-1`` comes from (so does a request whose
    ``seq_len`` is below its query length, a fault the contents check names)."""
    R = sl.shape[0]
    t = torch.arange(T, dtype=qsl.dtype, device=qsl.device)
    if not R:
        return torch.full_like(t, -1), torch.zeros_like(t)
    if nd == R == T:
        # one-token decodes only, so query_start_loc is 0..R (rules 1-5 judge that it is): token t is request
        # t's last position, and the search and gather below would find just that
        return (sl.to(qsl.dtype) - 1).clamp_(min=-1), t
    # the request of token t: the first whose end is past t, searched among all but the last end, so a
    # token past every end (a batch whose starts end short of T) falls to the last request, never beyond
    req = torch.searchsorted(qsl[1:-1], t, right=True, out_int32=qsl.dtype == torch.int32)
    pos = (sl.to(qsl.dtype) - qsl[1:])[req].add_(t).clamp_(min=-1)
    return pos, req


def lengths_word(batch: "BatchMetadata") -> torch.Tensor:
    """The smallest fault word of the rules other than page ids (``[1]`` int64), as torch ops on the batch's
    device: no synchronisation."""
    qsl, sl = batch.query_start_loc.to(torch.int64), batch.seq_lens.to(torch.int64)
    R, M = batch.block_table.shape
    T, nd, B = batch.num_tokens, batch.num_decodes, batch.block_size
    if batch.slots is not None:   # a column per position: seq_len fits the slot table's width
        M, B = batch.slots.width, 1
    dev = sl.device
    if not R:
        bad = LENGTHS | 3 << 40 if T else NO_FAULT
        return torch.full((1,), bad, dtype=torch.int64, device=dev)
    ql = qsl[1:] - qsl[:-1]
    req = torch.arange(R, device=dev)
    dec = req < nd
    pad = dec & (sl == 0)
    ndt, mpq = batch.num_decode_tokens, batch.max_prefill_query_len
    first, prefill = req == 0, ~dec
    rules = [first & (qsl[0] != 0), ql < 0, (req == R - 1) & (qsl[-1] != T),
             dec & (ql != 0) & (ql != batch.decode_query_len), first & (qsl[min(nd, R)] != ndt),
             ~pad & (sl < ql), prefill & (ql < 1), prefill & (ql > mpq), (sl < 0) | ((sl + B - 1) // B > M)]
    # rules 1..9 of every request at once: one [rule, request] mask, one code each, the smallest kept
    codes = (torch.arange(1, len(rules) + 1, device=dev)[:, None] << 40 | req) | LENGTHS
    words = [torch.where(torch.stack(rules), codes, NO_FAULT).amin()]
    if T:
        pos, t2r = derive_tokens(qsl, sl, nd, T)
        wrong = (pos != batch.token_positions) | (t2r != batch.token_to_request)
        words.append(torch.where(wrong, LENGTHS | 10 << 40 | torch.arange(T, device=dev), NO_FAULT).amin())
    ctx = batch.__dict__.get("context_lens")
    if ctx is not None:
        words.append(torch.where(ctx != derive_context(qsl, sl, nd), LENGTHS | 11 << 40 | req, NO_FAULT).amin())
    return torch.stack(words).amin().view(1)


def pages_word(batch: "BatchMetadata", num_pages: int) -> torch.Tensor:
    """The smallest fault word of a block-table entry a request uses that is not a page id in
    ``[0, num_pages)`` (``[1]`` int64), as torch ops on the batch's device: no synchronisation.
    Token slots: :func:`slots_word` (``num_pages``: the cache's one-token pages)."""
    if batch.slots is not None:
        return slots_word(batch, num_pages)
    bt, sl = batch.block_table, batch.seq_lens.to(torch.int64)
    R, M = bt.shape
    if not (R and M):
        return torch.full((1,), NO_FAULT, dtype=torch.int64, device=bt.device)
    cols = torch.arange(M, device=bt.device)
    used = cols[None, :] < ((sl + batch.block_size - 1) // batch.block_size)[:, None]
    req = torch.arange(R, device=bt.device)
    bad = used & ((bt < 0) | (bt >= num_pages))
    return torch.where(bad, req[:, None] << 32 | cols[None, :], NO_FAULT).amin().view(1)


def slots_word(batch: "BatchMetadata", num_slots: int) -> torch.Tensor:
    """The smallest fault word of a batch of token slots (``[1]`` int64): a slot row outside the slot
    table (rule 12), else ``request << 32 | position`` of the first position below a request's
    ``seq_len`` whose slot is not a row of the cache, in ``[0, num_slots)``. Torch ops on the batch's
    device, no synchronisation; the table's columns in chunks (each used entry is read, one per token)."""
    table, rows = batch.slots.table, batch.slots.rows.to(torch.int64)  # type: ignore[union-attr]
    N, W = table.shape
    dev, R = rows.device, rows.shape[0]
    req = torch.arange(R, device=dev)
    sl = batch.seq_lens.to(torch.int64)
    row_ok = (rows >= 0) & (rows < N)     # a request with no tokens to read (padding) needs no row
    words = [torch.where(row_ok | (sl <= 0), NO_FAULT, LENGTHS | 12 << 40 | req).amin()] if R else []
    safe = rows.clamp(0, max(N - 1, 0))[:, None]
    sl = torch.where(row_ok, sl, 0)[:, None]
    for c0 in range(0, W if R and N else 0, _SLOT_COLUMNS):
        cols = torch.arange(c0, min(W, c0 + _SLOT_COLUMNS), device=dev)[None, :]
        ids = table[safe, cols]
        bad = (cols < sl) & ((ids < 0) | (ids >= num_slots))
        words.append(torch.where(bad, req[:, None] << 32 | cols, NO_FAULT).amin())
    if not words:
        return torch.full((1,), NO_FAULT, dtype=torch.int64, device=dev)
    return torch.stack(words).amin().view(1)


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
        #: the word as the host reads it (a step compares it with NO_FAULT before it calls raise_pending)
        self.host_word = memoryview(self._host.numpy())   # an index of it is a Python int (a numpy scalar costs more)
        self._lock = threading.Lock()
        #: what the message of a fault names: the entry, its spelling, the cache's pages and the batch of the
        #: last step that may have lowered the word (a step sets it: one attribute written)
        self.context: tuple[str, ArgNames, int, Optional[BatchShape]] = ("mm3", LAYER_NAMES, 0, None)
        # a device word: raise_pending reads the host copy only once a copy was started
        self._copied = False

    def about(self, entry: str, names: ArgNames, num_pages: int, batch: "BatchMetadata") -> None:
        """Name what a fault found from now on belongs to (no device work)."""
        self.context = (entry, names, num_pages, batch.facts)

    def record(self, batch: "BatchMetadata", num_pages: int, *, graph: bool = False, pages: bool = True) -> None:
        """Check ``batch``'s contents against ``num_pages`` with torch ops on its device; no host sync.

        ``pages``: the page ids too (:func:`pages_word`; the lengths' rules, :func:`lengths_word`, always);
        ``graph``: inside CUDA-graph capture (the replays lower the word; an eager step reads it).
        """
        self.context = (*self.context[:2], num_pages, batch.facts)
        torch.minimum(self.word, lengths_word(batch), out=self.word)
        if pages:
            torch.minimum(self.word, pages_word(batch, num_pages), out=self.word)
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
            got = int(self.host_word[0])
            if got == NO_FAULT:
                return
            self.host_word[0] = NO_FAULT
            if not self.shared:
                self.word.fill_(NO_FAULT)
        entry, names, num_pages, shape = self.context
        raise InputError(f"{entry}: " + _message(got, shape, num_pages, names)
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
