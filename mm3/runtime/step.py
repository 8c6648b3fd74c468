"""One step on a bound backend pair, with the host work it needs done once, not every step.

An :class:`OpTarget` is what a :class:`~mm3.SparseAttention` layer and the
custom ops (:mod:`mm3.runtime.ops`) run a step on. It owns the per-step
decisions, so the eager layer and an eagerly called ``torch.ops.mm3.*`` make
the same ones:

* **which pair runs** (``Settings.check_contracts``): ``"first"`` runs the
  first step of each batch kind through the contract guard (never while a CUDA
  graph is captured), then the plain pair; ``"always"`` guards every step;
  ``"never"`` none;
* **page ids** (docs/errors.md §2.6): by the indexer's own kernels where its
  backend reports bad ids (no work of mm3's), else once per batch
  (:mod:`mm3.contract.page_ids`);
* **argument checks, once per shape class**: the bound backend checks shapes,
  dtypes and devices (:mod:`mm3.contract.checks`); those depend only on the
  *shape class* of a call (:func:`call_class`), so a plain call of a class
  already checked goes straight to the plugin's hook
  (``Backend.index_topk_unchecked`` / ``attention_forward_unchecked``).

Example:
    >>> import torch, mm3
    >>> from mm3.runtime.config import Settings
    >>> from mm3.testing.factories import make_case
    >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=16, backend="cpu_ref",
    ...                             settings=Settings(check_contracts="first"))
    >>> case = make_case(p, decodes=[40], prefills=[(5, 20)], dtype="float32")
    >>> target, c, b = layer.op_target, case.caches, case.batch
    >>> out = torch.zeros_like(case.q)
    >>> for _ in range(2):     # a guarded first step of its kind, then a plain one
    ...     guarded = target.run_index_topk(case.index_q, c, b, layer.topk_buffer, graph=False)
    ...     target.run_attention(case.q, c, layer.topk_buffer, b, out, graph=False, guarded=guarded)
    ...     print(guarded)
    True
    False
    >>> sorted(target.checked), len(target.accepted)
    (['mixed'], 2)
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.errors import InputError
from mm3.contract.page_ids import PageIdFlag, check_page_ids

if TYPE_CHECKING:
    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.backend import Backend

__all__ = ["OpTarget", "call_class", "remember", "MAX_CLASSES"]

_TARGETS: "weakref.WeakValueDictionary[int, OpTarget]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)
_LOCK = threading.Lock()

#: shape classes remembered per target before the memory starts over (prefill steps of every
#: token count are each a class; the checks of a forgotten class simply run again)
MAX_CLASSES = 4096


def remember(seen: set[Any], key: Any) -> None:
    """Add ``key`` to the memo ``seen``, which starts over at :data:`MAX_CLASSES` entries."""
    if len(seen) >= MAX_CLASSES:
        seen.clear()
    seen.add(key)


def on_host(batch: BatchMetadata) -> bool:
    """Whether ``batch``'s block table lives in host memory (its page ids are then checked there)."""
    return batch.block_table.device.type == "cpu"


def call_class(x: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata, topk: TopkBuffer,
               out: Optional[torch.Tensor] = None) -> tuple[Any, ...]:
    """The shape class of one hook call: everything its argument checks read, and nothing else.

    ``x`` is ``index_q`` or ``q``. Shapes, dtypes and devices of the per-call
    tensors, the top-k buffer's layout and strides, ``out``'s strides (its rows
    must not overlap); the cache's and batch's facts come from their cached
    :attr:`~mm3.PagedKVCache.shape_class` / :attr:`~mm3.BatchMetadata.shape_class`.
    Raises ``AttributeError`` for arguments of the wrong type (the checks then name them).
    """
    s = topk.storage
    return (x.shape, x.dtype, x.device, caches.shape_class, batch.shape_class, topk.layout, s.shape, s.stride(),
            s.device, None if out is None else (out.shape, out.stride(), out.dtype, out.device))


@dataclass(eq=False)
class OpTarget:
    """What a step runs on: the bound backends, the guard's policy, the page-id flag, the checked classes.

    Registered under :attr:`handle` when built; ``torch.ops.mm3.*`` look it up by
    that int. It lives as long as its owner (the layer) holds it.

    Args:
        indexer, attention: the pair of a checked step (guarded unless ``mode`` is ``"never"``).
        params: the layer's parameters.
        topk_layout / attention_topk_layout: the layouts of the buffer the indexer writes and
            the attention reads.
        plain: the unguarded pair of ``"first"`` mode's later steps (default: the pair above).
        mode: ``check_contracts`` (``"first"``, ``"always"``, ``"never"``), or ``"plain"``:
            no policy and no page-id check (what a compiled graph's ops run, host-free).
        page_ids: the owner's device-side page-id flag (``None``: no page-id checks).
    """

    indexer: "Backend"
    attention: "Backend"
    params: "SparseAttentionParams"
    topk_layout: str             # the layout of the buffer the indexer writes
    attention_topk_layout: str   # the layout of the buffer the attention reads
    plain: Optional[tuple["Backend", "Backend"]] = None
    mode: str = "plain"
    page_ids: Optional[PageIdFlag] = None
    handle: int = field(init=False)
    #: batch kinds whose step passed the guard ("first" mode)
    checked: set[str] = field(default_factory=set)
    #: shape classes (:func:`call_class`, per op) whose argument checks passed
    accepted: set[Any] = field(default_factory=set)
    #: (shape, strides, dtype, layout) of top-k storage the ops were given that passed its checks
    _topk_ok: set[Any] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.plain is None:
            self.plain = (self.indexer, self.attention)
        # a pair that is not guarded may skip the checks of a class it ran already
        self._trusting = self.mode in ("never", "plain") or self.plain[0] is not self.indexer
        # page ids (mm3.contract.page_ids): the indexer's kernels may report bad ones themselves, and
        # an attention of a backend that declares it clamps every id it loads
        self._indexer_reports = self.indexer.capabilities.reports_bad_page_ids
        self._attention_clamps = self.attention.capabilities.reports_bad_page_ids
        with _LOCK:
            self.handle = next(_NEXT)
            _TARGETS[self.handle] = self

    @staticmethod
    def lookup(handle: int) -> "OpTarget":
        target = _TARGETS.get(handle)
        if target is None:
            raise InputError(f"mm3 op handle {handle} names no live layer; pass layer.op_target.handle of a "
                             f"SparseAttention that is still alive")
        return target

    # -- the custom ops' arguments -------------------------------------------------------------
    def topk_rows(self, storage: torch.Tensor, layout: str, num_tokens: int) -> TopkBuffer:
        """``TopkBuffer._wrap(storage, layout).rows(0, num_tokens)``, its checks run once per storage
        shape, strides, dtype and layout (what they read)."""
        key = (storage.shape, storage.stride(), storage.dtype, layout)
        if key in self._topk_ok:
            return TopkBuffer._checked_before(storage, layout).rows(0, num_tokens)
        buf = TopkBuffer._wrap(storage, layout)
        remember(self._topk_ok, key)
        return buf.rows(0, num_tokens)

    # -- the policy ---------------------------------------------------------------------------
    def _guarded(self, batch: BatchMetadata, graph: bool) -> bool:
        """Whether this step runs the checked pair (``"first"``: a batch kind's first eager step)."""
        if graph or self.mode in ("plain", "never"):
            return False
        return self.mode == "always" or batch.shape_class[0] not in self.checked

    def _index_page_ids(self, batch: BatchMetadata, caches: PagedKVCache, graph: bool,
                        guarded: bool) -> Optional[torch.Tensor]:
        """The page-id work of a step's first hook (:mod:`mm3.contract.page_ids`): raise what an
        earlier step found, then check this step's table the cheapest way its indexer allows (a
        guarded step, which waits for the device anyway, on the host at once). Returns the word to
        pass to an indexer that reports bad ids itself."""
        flag = self.page_ids
        if flag is None:
            return None
        if not graph:
            flag.raise_pending()
        if guarded:
            check_page_ids(batch, caches.num_pages)
        if self._indexer_reports:
            flag.num_pages = caches.num_pages
            return flag.word
        if on_host(batch):
            check_page_ids(batch, caches.num_pages)     # host memory: no device to wait for
        else:
            flag.record(batch, caches.num_pages, always=graph)
        return None

    def _attention_page_ids(self, batch: BatchMetadata, caches: PagedKVCache, graph: bool,
                            guarded: bool) -> None:
        """An attention that may read an id as an address gets the table checked (once per batch:
        after its indexer's check this is a dict lookup)."""
        flag = self.page_ids
        if flag is None or self._attention_clamps:
            return
        if on_host(batch) or guarded:
            check_page_ids(batch, caches.num_pages)
        else:
            flag.record(batch, caches.num_pages, always=graph)

    # -- the two ops --------------------------------------------------------------------------
    def run_index_topk(self, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata, topk: TopkBuffer,
                       *, graph: bool, trusted: bool = False) -> bool:
        """The indexer into ``topk.rows(0, T)``; ``trusted``: the caller checked this call's class already.
        Returns whether the step is guarded (pass it to :meth:`run_attention` of the same step)."""
        rows = topk if topk.num_tokens == batch.num_tokens else topk.rows(0, batch.num_tokens)
        guarded = self._guarded(batch, graph)
        faults = self._index_page_ids(batch, caches, graph, guarded)
        args = (index_q, caches, batch, self.params, rows, faults)
        be = self.indexer if guarded else self.plain[0]  # type: ignore[index]
        key = None if guarded else False if trusted else self._unknown("index_topk", (index_q, caches, batch, rows))
        if guarded or key is not False:
            be.index_topk(*args)                         # checked, then the hook
            if key:
                remember(self.accepted, key)
        else:
            fn, n, kw = be.index_call                    # the hook itself: this class was checked
            try:
                fn(*args[:n], **{kw: faults}) if kw else fn(*args[:n])
            except Exception as e:
                be.reraise(e, "index_topk")
        if faults is not None and not graph:
            self.page_ids.after_step()  # type: ignore[union-attr]
        return guarded

    def run_attention(self, q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                      out: torch.Tensor, *, graph: bool, trusted: bool = False, guarded: Optional[bool] = None) -> None:
        """The attention of rows ``[0, T)`` of ``topk`` into ``out[:T]``; a guarded step that
        passes marks its batch kind checked (``"first"`` mode). ``guarded``: what
        :meth:`run_index_topk` returned for this step (same batch and caches); None: decided here."""
        T = batch.num_tokens
        rows = topk if topk.num_tokens == T else topk.rows(0, T)
        o = out if out.shape[0] == T else out[:T]
        args = (q, caches, rows, batch, self.params, o)
        if guarded is None:
            guarded = self._guarded(batch, graph)
        self._attention_page_ids(batch, caches, graph, guarded)
        be = self.attention if guarded else self.plain[1]  # type: ignore[index]
        key = None if guarded else False if trusted else self._unknown("attention", (q, caches, batch, rows, o))
        if guarded or key is not False:
            be.attention_forward(*args)
            if key:
                remember(self.accepted, key)
            if guarded and self.mode == "first":
                self.checked.add(batch.shape_class[0])
        else:
            fn, n, _ = be.attention_call
            try:
                fn(*args[:n])
            except Exception as e:
                be.reraise(e, "attention_forward")

    def _unknown(self, op: str, class_args: tuple[Any, ...]) -> Any:
        """``False`` when this plain call's shape class passed its checks before (call the hook
        directly), else the key to remember once the checked call passes (``None``: nothing to
        remember: a guarded pair checks every call, or the arguments are of the wrong type)."""
        if not self._trusting:
            return None
        try:
            key = (op, call_class(*class_args))
        except AttributeError:   # arguments of the wrong type: the checked call names them
            return None
        return False if key in self.accepted else key
