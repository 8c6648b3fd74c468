"""The boundary of a step: every entry point's inputs admitted by one call, then the hooks run.

A layer's step, a custom op (:mod:`mm3.runtime.ops`), a vLLM drop-in call
(:mod:`mm3.integrations.vllm`) and a bound backend's own op method
(:class:`~mm3.runtime.backend.Backend`) all reach a plugin's hook the same way:

1. :func:`describe` reads the call's facts (:class:`~mm3.contract.facts.StepFacts`:
   shapes, dtypes, devices, the batch's host ints, the backends) from the
   tensors as they are now;
2. :func:`admit` looks the value up in the one memo of classes that passed, and
   on a miss runs every argument rule (:func:`mm3.contract.checks.check`) and
   keeps its :class:`~mm3.contract.checks.Plan` under the value;
3. the contents (lengths, positions, page ids; :mod:`mm3.contract.contents`) are
   judged every step: on the host for a batch in host memory and at the first
   step of a class, else on the device with no synchronisation (by the
   indexer's own kernels where its backend reports bad page ids);
4. the hook runs, through the contract guard (:mod:`mm3.debug.guard`) when the
   policy (``Settings.check_contracts``) says so: ``"first"`` guards the first
   eager call of each op and batch kind, ``"always"`` every eager call,
   ``"never"`` none; a call inside CUDA-graph capture is never guarded.

An :class:`OpTarget` is the bound pair a layer (or a drop-in choice) runs on;
``torch.ops.mm3.*`` find it by its :attr:`~OpTarget.handle`.

Example:
    >>> import torch, mm3
    >>> from mm3.runtime.config import Settings
    >>> from mm3.testing.factories import make_case
    >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=16, backend="cpu_ref",
    ...                             settings=Settings(check_contracts="first"))
    >>> case = make_case(p, decodes=[40], prefills=[(5, 20)], dtype="float32")
    >>> out = layer(case.q, case.index_q, case.caches, case.batch)
    >>> sorted(layer.op_target.guarded)     # the first step of its kind ran through the guard
    [('attention', 'mixed'), ('index_topk', 'mixed')]
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
from mm3.contract.checks import Plan, check
from mm3.contract.contents import FaultFlag, check_on_host
from mm3.contract.errors import InputError
from mm3.contract.facts import LAYER_NAMES, ArgNames, LayerFacts, StepFacts
from mm3.contract.hookspecs import Op
from mm3.debug import guard

if TYPE_CHECKING:
    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.backend import Backend

__all__ = ["OpTarget", "describe", "admit", "BOTH", "MAX_CLASSES"]

#: classes remembered before the memo starts over (every prefill token count is a class; the
#: rules of a forgotten class simply run again)
MAX_CLASSES = 4096
BOTH = (Op.INDEX_TOPK, Op.ATTENTION)

_ADMITTED: dict[StepFacts, Plan] = {}
_LOCK = threading.Lock()


def _tensor(name: str, t: object) -> tuple[Any, ...]:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return (t.shape, t.dtype, t.device)


def _wrong_types(entry: str, names: ArgNames, caches: object, batch: object, topk: object) -> InputError:
    if not isinstance(caches, PagedKVCache):
        return InputError(f"{entry}: caches must be an mm3.PagedKVCache, got {type(caches).__name__}; wrap your "
                          f"tensors: PagedKVCache(k=..., v=..., index=...)")
    if not isinstance(batch, BatchMetadata):
        return InputError(f"{entry}: batch must be an mm3.BatchMetadata (BatchMetadata.build(...) or from_device), got "
                          f"{type(batch).__name__}")
    return InputError(f"{entry}: {names.topk} must be an mm3.TopkBuffer, got {type(topk).__name__}; allocate it "
                      f"with TopkBuffer.allocate(...) or wrap the logical [H, T, K] view of your memory: "
                      f"TopkBuffer(view)")


def describe(entry: str, ops: tuple[str, ...], params: "SparseAttentionParams", indexer: Optional["Backend"],
             attention: Optional["Backend"], *, caches: PagedKVCache, batch: BatchMetadata,
             topk: Optional[TopkBuffer] = None,
             index_q: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, layer: Optional[LayerFacts] = None,
             names: ArgNames = LAYER_NAMES) -> StepFacts:
    """The facts of one call (:class:`~mm3.contract.facts.StepFacts`), read from its inputs as they are now.

    Reads shapes, dtypes, devices and two tensors' strides; no contents, no synchronisation.
    ``indexer``: the backend of the call's index op (``index_topk`` or ``index_scores``);
    ``out``: the attention's output, or the block scores of ``index_scores``.
    Raises :class:`InputError` naming an argument of the wrong type.
    """
    # plain tuples in the order of the facts' fields (view() names them): this runs every step
    try:
        k, v, ix, ks, vs = caches.k, caches.v, caches.index, caches.k_scale, caches.v_scale
        c = ((k.shape, k.dtype, k.device), (v.shape, v.dtype, v.device), (ix.shape, ix.dtype, ix.device),
             None if ks is None else (ks.shape, ks.dtype, ks.device),
             None if vs is None else (vs.shape, vs.dtype, vs.device))
        qsl, sl, bt, tr, pos = (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.token_to_request,
                                batch.token_positions)
        ctx = batch.__dict__.get("context_lens")   # derived lazily for some batches: read only if there
        b = (batch.num_decodes, batch.decode_query_len, batch.block_size, batch.num_decode_tokens,
             batch.max_prefill_query_len, (qsl.shape, qsl.dtype, qsl.device), (sl.shape, sl.dtype, sl.device),
             (bt.shape, bt.dtype, bt.device), (tr.shape, tr.dtype, tr.device), (pos.shape, pos.dtype, pos.device),
             None if ctx is None else (ctx.shape, ctx.dtype, ctx.device))
        if topk is None and Op.INDEX_SCORES in ops:     # block scores: a call without a top-k buffer
            layout, tk = None, None
        else:
            s = topk.storage  # type: ignore[union-attr]
            layout, tk = topk.layout, (s.shape, s.dtype, s.device, s.stride())  # type: ignore[union-attr]
    except AttributeError:
        raise _wrong_types(entry, names, caches, batch, topk) from None
    index, attend = Op.INDEX_TOPK in ops or Op.INDEX_SCORES in ops, Op.ATTENTION in ops
    return StepFacts(entry, names, ops, params, indexer, attention, layer,
                     _tensor(names.index_q, index_q) if index else None, _tensor(names.q, q) if attend else None,
                     (*_tensor(names.out, out), out.stride()) if attend or Op.INDEX_SCORES in ops else None,  # type: ignore[union-attr]
                     layout, tk, c, b)  # type: ignore[arg-type]


def admit(facts: StepFacts) -> tuple[Plan, bool]:
    """``(plan, new)``: the :class:`~mm3.contract.checks.Plan` of ``facts``' class, from the memo or from
    the rules (``new``: they ran now, and passed). Raises :class:`InputError` for a call that breaks one."""
    plan = _ADMITTED.get(facts)
    if plan is not None:
        return plan, False
    plan = check(facts)
    with _LOCK:
        if len(_ADMITTED) >= MAX_CLASSES:
            _ADMITTED.clear()
        _ADMITTED[facts] = plan
    return plan, True


def forget() -> None:
    """Empty the memo of admitted classes (every later call runs the rules again)."""
    with _LOCK:
        _ADMITTED.clear()


def on_host(batch: BatchMetadata) -> bool:
    """Whether ``batch``'s block table lives in host memory (its contents are then checked there, every step)."""
    return batch.block_table.device.type == "cpu"


_TARGETS: "weakref.WeakValueDictionary[int, OpTarget]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


@dataclass(eq=False)
class OpTarget:
    """The bound pair a step runs on, its guard policy and its fault flag.

    Registered under :attr:`handle` when built; ``torch.ops.mm3.*`` look it up by
    that int. It lives as long as its owner (a layer, or a drop-in choice) holds it.

    Args:
        indexer, attention: the bound backends.
        params: the owner's parameters.
        scorer: the bound backend of ``index_scores`` (``None``: none provides it; a caller then scores
            the blocks itself, its call admitted by :meth:`admit_call`).
        topk: the owner's persistent top-k buffer (``None``: callers always pass their own).
        mode: ``check_contracts``: ``"first"``, ``"always"`` or ``"never"`` (see the module's docstring).
        flag: where device-side checks report (one per owner).
        layer: the owning layer's promises (:class:`~mm3.contract.facts.LayerFacts`): every call on this
            target is held to them, whichever entry point makes it (``None``: a target without a layer).
    """

    indexer: "Backend"
    attention: "Backend"
    params: "SparseAttentionParams"
    topk: Optional[TopkBuffer] = None
    mode: str = "first"
    flag: FaultFlag = field(default_factory=lambda: FaultFlag("cpu"))
    layer: Optional[LayerFacts] = None
    scorer: Optional["Backend"] = None
    handle: int = field(init=False)
    #: (op, batch kind) pairs whose first eager call passed the guard ("first" mode)
    guarded: set[tuple[str, str]] = field(default_factory=set)
    #: rows(0, T) views of the owner's buffer by T (a slice costs more host time than the lookup)
    _rows: dict[int, TopkBuffer] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # whether each op's backend checks the page ids it loads (an op none provides checks nothing)
        self._reports = self.indexer.capabilities.reports_bad_page_ids
        self._clamps = self.attention.capabilities.reports_bad_page_ids
        self._scorer_reports = self.scorer is not None and self.scorer.capabilities.reports_bad_page_ids
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

    def topk_of(self, t: torch.Tensor, what: str) -> TopkBuffer:
        """The top-k buffer a custom op was given: the owner's own buffer when ``t`` is its storage (same
        address, shape and strides), else ``t`` read as the logical ``[H, T, K]`` view of the caller's memory
        (its strides say the layout). ``what`` names the argument in errors."""
        own = self.topk
        if own is not None and isinstance(t, torch.Tensor):
            s = own.storage
            if t.data_ptr() == s.data_ptr() and t.shape == s.shape and t.stride() == s.stride():
                return own
        try:
            return TopkBuffer(t)
        except InputError as e:
            raise InputError(f"{what}: {e}; pass the layer's own top-k storage (layer.topk_buffer.storage) or "
                             f"the logical [H, T, K] view of your memory") from None

    # -- the policy ---------------------------------------------------------------------------
    def _guard(self, op: str, kind: str, graph: bool) -> bool:
        if graph or self.mode == "never":
            return False
        return self.mode == "always" or (op, kind) not in self.guarded

    def _contents(self, f: StepFacts, caches: PagedKVCache, batch: BatchMetadata, new: bool,
                  graph: bool) -> Optional[torch.Tensor]:
        """Judge the step's contents the cheapest way that still sees them every step; returns the word to
        pass a reporting index op."""
        flag = self.flag
        if not graph:
            flag.raise_pending()
        flag.about(f.entry, f.names, caches.num_pages, batch)
        # the op whose backend reads every used block-table entry: the index op, first in a call of two
        reader = f.ops[0]
        reports = self._clamps if reader == Op.ATTENTION else \
            self._scorer_reports if reader == Op.INDEX_SCORES else self._reports
        if on_host(batch) or (new and not graph):
            check_on_host(batch, caches.num_pages, entry=f.entry, names=f.names,
                          scales=(caches.k_scale, caches.v_scale) if new else ())
        elif not reports:
            flag.record(batch, caches.num_pages, graph=graph)
        return flag.word if reader != Op.ATTENTION and reports else None

    # -- the step -------------------------------------------------------------------------------
    def admit_call(self, entry: str, ops: tuple[str, ...], *, caches: PagedKVCache, batch: BatchMetadata,
                   topk: Optional[TopkBuffer] = None, index_q: Optional[torch.Tensor] = None,
                   q: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, graph: bool = False,
                   names: ArgNames = LAYER_NAMES) -> tuple[Plan, Optional[torch.Tensor]]:
        """Admit a call on this target and judge its contents, as :meth:`run` does before the hooks:
        ``(plan, page_faults)``. A caller that does an op's work itself (``index_scores`` where no
        bound backend provides it) calls this, then works."""
        return self._admit(entry, ops, caches, batch, topk, index_q, q, out, graph, names)

    def _admit(self, entry: str, ops: tuple[str, ...], caches: PagedKVCache, batch: BatchMetadata,
               topk: Optional[TopkBuffer], index_q: Optional[torch.Tensor], q: Optional[torch.Tensor],
               out: Optional[torch.Tensor], graph: bool, names: ArgNames) -> tuple[Plan, Optional[torch.Tensor]]:
        index = self.scorer if Op.INDEX_SCORES in ops else self.indexer if Op.INDEX_TOPK in ops else None
        f = describe(entry, ops, self.params, index, self.attention if Op.ATTENTION in ops else None,
                     caches=caches, batch=batch, topk=topk, index_q=index_q, q=q, out=out, layer=self.layer,
                     names=names)
        plan, new = admit(f)
        return plan, self._contents(f, caches, batch, new, graph)

    def run(self, entry: str, ops: tuple[str, ...], *, caches: PagedKVCache, batch: BatchMetadata,
            topk: Optional[TopkBuffer] = None, index_q: Optional[torch.Tensor] = None,
            q: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, graph: bool = False,
            names: ArgNames = LAYER_NAMES) -> None:
        """Admit the call, check its contents, run its hooks (``ops``: both, or one) on rows ``[0, T)``.

        ``index_scores`` (alone): ``out`` is the caller's ``[H, >= T, N]`` scores, of which rows ``[0, T)``
        are written; its backend must exist (:attr:`scorer`)."""
        plan, faults = self._admit(entry, ops, caches, batch, topk, index_q, q, out, graph, names)
        T = batch.num_tokens
        if Op.INDEX_SCORES in ops:
            if self.scorer is None:
                raise InputError(f"{entry}: no bound backend provides index_scores; score the blocks without "
                                 f"one (OpTarget.admit_call, then mm3.integrations.block_scores)")
            rows = out if out.shape[1] == T else out[:, :T]  # type: ignore[union-attr]
            self._call(self.scorer, Op.INDEX_SCORES, (index_q, caches, batch, self.params, rows, faults), plan.kind,
                       graph)
            if faults is not None and not graph:
                self.flag.after_step()
            return
        assert topk is not None
        if topk.num_tokens == T:
            rows = topk
        elif topk is self.topk:
            rows = self._rows.get(T) or self._rows.setdefault(T, topk.rows(0, T))
        else:
            rows = topk.rows(0, T)
        if Op.INDEX_TOPK in ops:
            write = rows if plan.index_via is None else \
                TopkBuffer.allocate(T, rows.num_heads, rows.topk, plan.index_via, rows.device)
            self._call(self.indexer, Op.INDEX_TOPK, (index_q, caches, batch, self.params, write, faults), plan.kind,
                       graph)
            if write is not rows:
                rows.copy_(write)
        if Op.ATTENTION in ops:
            read = rows if plan.convert_to is None else rows.to_layout(plan.convert_to)
            o = out if out.shape[0] == T else out[:T]  # type: ignore[union-attr]
            self._call(self.attention, Op.ATTENTION, (q, caches, read, batch, self.params, o), plan.kind, graph)
        if faults is not None and not graph:
            self.flag.after_step()

    def _call(self, be: "Backend", op: Op, args: tuple[Any, ...], kind: str, graph: bool) -> None:
        """The hook of ``op`` on ``args`` (the hook spec's order, :mod:`mm3.contract.hookspecs`), through the
        guard when the policy says so."""
        if self._guard(op, kind, graph):
            guard.checked_call(be, op, args)
            if self.mode == "first":
                self.guarded.add((op.value, kind))
        else:
            be.invoke(op, args)
