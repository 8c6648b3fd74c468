"""The boundary of a step: a bound target's plan, the step's counts against it, its contents, its hooks.

Every entry point — a layer's step, a custom op (:mod:`mm3.runtime.ops`), a
vLLM drop-in call (:mod:`mm3.integrations.vllm`), a bound backend's own op
method — reaches a plugin's hook through :meth:`OpTarget.run`:

1. **The plan.** What engine traffic does not change — dtypes, devices, head
   and cache shapes, layouts, the backends, the layer's promises — is judged
   once per target and kept: :func:`mm3.contract.checks.check` runs every rule
   on the call's :class:`~mm3.contract.facts.StepFacts` (:func:`describe`) and
   returns a :class:`~mm3.contract.checks.Plan`, kept under those facts. A
   call whose facts match reads its plan back; a new token count, new
   requests or decodes do not make a new plan.
2. **The counts.** Every call compares its ints with the plan: tokens against
   the capacity and the rows of each tensor, the decodes' query length against
   the declared limits, the batch's own shape verdict. A call that fails them
   runs every rule, which names what is wrong.
3. **The contents** (lengths, positions, page ids; :mod:`mm3.contract.contents`),
   judged without waiting for a device after a target's first step:

   * a batch in host memory: on the host, every call;
   * a target's first eager step (or every eager step with
     ``Settings.check_contents_with_sync``): on the host, one synchronisation;
   * otherwise on the device, every call, into the target's :class:`~mm3.contract.contents.FaultFlag`:
     by the index op's hook itself, handed the word, where its backend declares ``judges_contents``
     (the Triton plugins: a step of decodes in their score launch, any other in one launch of its own);
     else by the reading backend's ``check_contents`` hook (one launch) where it has one; else by
     :meth:`~mm3.contract.contents.FaultFlag.record` (torch operations; page ids left to the kernels
     of a backend that reports them, ``reports_bad_page_ids``). Nothing is remembered about a batch
     object: an engine edits its tensors in place. A fault raises at the target's next eager step,
     or at ``check_page_ids()``.
4. **The hooks**, through the contract guard (:mod:`mm3.debug.guard`) where
   ``Settings.check_contracts`` says: ``"first"`` guards the first eager call of
   each op and batch kind, ``"always"`` every eager call, ``"never"`` none; a
   call inside CUDA-graph capture is never guarded. Between them, what the plan
   says of the top-k rows: the written rows sorted ascending (for the entry
   point or the attention, :mod:`mm3.contract.topk_order`), a copy in the
   attention's layout, or a sorted copy of rows a caller handed in.

An :class:`OpTarget` is what a layer, a drop-in choice or a backend binds
(:mod:`mm3.runtime.binding`); ``torch.ops.mm3.*`` find it by its handle.

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
    >>> len(layer.op_target.plans)          # one plan, for every later step of these dtypes and shapes
    1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.checks import Plan, check
from mm3.contract.contents import NO_FAULT, FaultFlag, check_on_host
from mm3.contract.errors import InputError
from mm3.contract.facts import LAYER_NAMES, ArgNames, BatchFacts, LayerFacts, StepFacts, TensorFacts, tensor_facts
from mm3.contract.hookspecs import Op
from mm3.contract.topk_order import sort_ascending_, sorted_ascending
from mm3.debug import guard
from mm3.debug.guard import capturing

if TYPE_CHECKING:
    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.backend import Backend

__all__ = ["OpTarget", "describe", "on_host", "BOTH", "MAX_PLANS"]

BOTH = (Op.INDEX_TOPK, Op.ATTENTION)
#: plans one target keeps before it starts over (a plan is per dtype, device and shape of the inputs
#: an engine keeps from step to step: a handful; a forgotten one is judged again)
MAX_PLANS = 64
_INDEX, _ATTENTION, _SCORES = Op.INDEX_TOPK, Op.ATTENTION, Op.INDEX_SCORES
# (name, hook) of each op as plain strings: an enum member's value and hash run Python code every call
_INDEX_HOOK, _ATTENTION_HOOK, _SCORES_HOOK = ((str.__str__(op), op.hook) for op in (_INDEX, _ATTENTION, _SCORES))
_INDEX_NAME, _ATTENTION_NAME, _SCORES_NAME = _INDEX_HOOK[0], _ATTENTION_HOOK[0], _SCORES_HOOK[0]
#: the kinds each op has passed the guard on, in "always" mode: none, so every call is guarded
_NONE_PASSED: dict[str, frozenset[str]] = {_INDEX_NAME: frozenset(), _ATTENTION_NAME: frozenset(),
                                           _SCORES_NAME: frozenset()}


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


def _tensor(entry: str, name: str, t: object, stride: bool = False) -> TensorFacts:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{entry}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return tensor_facts(t, stride)  # type: ignore[return-value]


def describe(entry: str, ops: tuple[str, ...], params: "SparseAttentionParams", indexer: Optional["Backend"],
             attention: Optional["Backend"], *, caches: PagedKVCache, batch: BatchMetadata,
             topk: Optional[TopkBuffer] = None,
             index_q: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, layer: Optional[LayerFacts] = None,
             names: ArgNames = LAYER_NAMES, order: Optional[str] = None) -> StepFacts:
    """The facts of one call (:class:`~mm3.contract.facts.StepFacts`), read from its inputs as they are now.

    Reads shapes, dtypes, devices and two tensors' strides; no contents, no synchronisation.
    ``indexer``: the backend of the call's index op (``index_topk`` or ``index_scores``);
    ``out``: the attention's output, or the block scores of ``index_scores``; ``order``: the order of the
    top-k rows at the entry point (``"ascending"`` or ``None``: :attr:`~mm3.contract.facts.StepFacts.topk_order`).
    Raises :class:`InputError` naming an argument of the wrong type.
    """
    try:
        cf = caches.facts
        d = batch.__dict__
        bf = BatchFacts(batch.num_decodes, batch.decode_query_len, batch.block_size, batch.num_decode_tokens,
                        batch.max_prefill_query_len,
                        *(tensor_facts(d.get(f)) for f in ("query_start_loc", "seq_lens", "block_table",
                                                             "token_to_request", "token_positions",
                                                             "context_lens")),
                        *(tensor_facts(t) for t in (d.get("slots") or (None, None))))
        if topk is None and _SCORES in ops:     # block scores: a call without a top-k buffer
            layout, tk = None, None
        else:
            s = topk.storage  # type: ignore[union-attr]
            layout, tk = topk.layout, TensorFacts(s.shape, s.dtype, s.device, s.stride())  # type: ignore[union-attr]
    except AttributeError:
        raise _wrong_types(entry, names, caches, batch, topk) from None
    index, attend = _INDEX in ops or _SCORES in ops, _ATTENTION in ops
    return StepFacts(entry, names, ops, params, indexer, attention, layer,
                     _tensor(entry, names.index_q, index_q) if index else None,
                     _tensor(entry, names.q, q) if attend else None,
                     _tensor(entry, names.out, out, stride=True) if attend or _SCORES in ops else None,
                     layout, tk, cf, bf, order)


def on_host(batch: BatchMetadata) -> bool:
    """Whether ``batch``'s block table lives in host memory (its contents are then checked there, every call)."""
    return batch.facts.host


@dataclass(eq=False)
class OpTarget:
    """The bound pair a step runs on, its plans, guard policy and fault flag.

    Built by :mod:`mm3.runtime.binding` (a layer, a drop-in choice, a bound backend's own op methods);
    ``torch.ops.mm3.*`` find it by :attr:`handle` (:mod:`mm3.runtime.ops`).

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
        sync_contents: judge a device batch's contents on the host at every eager step (a synchronisation
            each: for debugging, ``Settings.check_contents_with_sync``).
    """

    indexer: "Backend"
    attention: "Backend"
    params: "SparseAttentionParams"
    topk: Optional[TopkBuffer] = None
    mode: str = "first"
    flag: FaultFlag = field(default_factory=lambda: FaultFlag("cpu"))
    layer: Optional[LayerFacts] = None
    scorer: Optional["Backend"] = None
    sync_contents: bool = False
    #: the handle ``torch.ops.mm3.*`` name this target by (0: not registered; :func:`mm3.runtime.ops.register`)
    handle: int = 0
    #: the plans judged so far, by the facts that engine traffic does not change
    plans: dict[tuple[Any, ...], Plan] = field(default_factory=dict, repr=False)
    #: rows(0, T) views of the owner's buffer by T (a slice costs more host time than the lookup)
    _rows: dict[int, TopkBuffer] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # for the op that reads a call's block table first: (its backend, which checks the page ids it loads,
        # and whose own check of a batch's contents is one launch, or None)
        scorer = self.scorer
        self._index_reader = (self.indexer, self.indexer.capabilities.reports_bad_page_ids,
                              self.indexer.check_contents)
        self._attention_reader = (self.attention, self.attention.capabilities.reports_bad_page_ids,
                                  self.attention.check_contents)
        self._scores_reader = (None, False, None) if scorer is None else \
            (scorer, scorer.capabilities.reports_bad_page_ids, scorer.check_contents)
        self._never, self._always = self.mode == "never", self.mode == "always"
        #: the course (:meth:`_course`: its facts, plan and what follows from them) of the last call of each
        #: entry point (most calls repeat them; a step of the custom ops calls two entry points in turn, so
        #: one slot for both would miss every call)
        self._last: dict[str, tuple[Any, ...]] = {}
        #: the batch kinds whose first eager call of each op passed the guard ("first" mode)
        self._passed: dict[str, set[str]] = {_INDEX_HOOK[0]: set(), _ATTENTION_HOOK[0]: set(), _SCORES_HOOK[0]: set()}
        #: the first eager step has not run yet: its contents are read on the host, once
        self._first = True

    @property
    def guarded(self) -> set[tuple[str, str]]:
        """The (op, batch kind) pairs whose first eager call passed the guard ("first" mode)."""
        return {(op, kind) for op, kinds in self._passed.items() for kind in kinds}

    def topk_of(self, t: torch.Tensor, entry: str) -> TopkBuffer:
        """The top-k buffer a custom op was given: the owner's own buffer when ``t`` is its storage (itself, or
        the same address, dtype, shape and strides), else ``t`` read as the logical ``[H, T, K]`` view of the
        caller's memory (its strides say the layout). ``entry`` names the op in errors (its argument is ``topk``)."""
        own = self.topk
        if own is not None and isinstance(t, torch.Tensor):
            s = own.storage
            if t is s or (t.data_ptr() == s.data_ptr() and t.dtype == s.dtype and t.shape == s.shape
                          and t.stride() == s.stride()):
                return own
        try:
            return TopkBuffer(t)
        except InputError as e:
            raise InputError(f"{entry}: topk: {e}; pass the layer's own top-k storage (layer.topk_buffer.storage) or "
                             f"the logical [H, T, K] view of your memory") from None

    # -- admission (the cold half: a call whose facts no kept plan matches, or whose counts break one) --
    def _judge(self, entry: str, ops: tuple[str, ...], caches: PagedKVCache, batch: BatchMetadata,
               topk: Optional[TopkBuffer], index_q: Optional[torch.Tensor], q: Optional[torch.Tensor],
               out: Optional[torch.Tensor], names: ArgNames, order: Optional[str]) -> Plan:
        """Every rule on the call's facts: raises :class:`InputError` naming the broken one, or returns the plan."""
        index = self.scorer if _SCORES in ops else self.indexer if _INDEX in ops else None
        return check(describe(entry, ops, self.params, index, self.attention if _ATTENTION in ops else None,
                              caches=caches, batch=batch, topk=topk, index_q=index_q, q=q, out=out,
                              layer=self.layer, names=names, order=order))

    def _planned(self, key: Optional[tuple[Any, ...]], entry: str, ops: tuple[str, ...], caches: PagedKVCache,
                 batch: BatchMetadata, topk: Optional[TopkBuffer], index_q: Optional[torch.Tensor],
                 q: Optional[torch.Tensor], out: Optional[torch.Tensor], names: ArgNames,
                 order: Optional[str]) -> tuple[Any, ...]:
        """The plan kept under ``key`` (judged now if none is) and what follows from it
        (:meth:`_course`), remembered as ``entry``'s last; ``key`` ``None``: an argument of the wrong type,
        which every rule names."""
        if key is None:
            return self._course(None, self._judge(entry, ops, caches, batch, topk, index_q, q, out, names, order),
                                ops, caches, batch)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._judge(entry, ops, caches, batch, topk, index_q, q, out, names, order)
            if len(self.plans) >= MAX_PLANS:
                self.plans.clear()
            self.plans[key] = plan
        course = self._last[entry] = self._course(key, plan, ops, caches, batch)
        return course

    def _course(self, key: Optional[tuple[Any, ...]], plan: Plan, ops: tuple[str, ...], caches: PagedKVCache,
                batch: BatchMetadata) -> tuple[Any, ...]:
        """What a call of these facts does, worked out with its plan (each a function of ``key``): whether its
        contents are judged on the host, the pages of its caches, the backend that reads its block table first
        (with whether it reports bad page ids and its own contents check), whether the index op gets the
        fault word, whether the index op judges the contents there itself, its ops, and whether the top-k rows go
        from index op to attention untouched."""
        reader = ops[0]
        be, reports, checker = self._attention_reader if reader is _ATTENTION else self._scores_reader \
            if reader is _SCORES else self._index_reader
        plain = plan.index_via is None and not plan.sort_written and plan.convert_to is None and not plan.sort_read
        # (judges_contents implies reports_bad_page_ids: BackendCapabilities refuses one without the other)
        judged = reader is _INDEX and be.capabilities.judges_contents
        return (key, plan, on_host(batch), caches.k.shape[0], be, reports, checker, judged,
                reports and reader is not _ATTENTION, _INDEX in ops, _ATTENTION in ops, _SCORES in ops, plain)

    def _contents_on_host(self, entry: str, caches: PagedKVCache, batch: BatchMetadata, graph: bool,
                          names: ArgNames, num_pages: int) -> None:
        """A batch in host memory (every call), or a target's first eager step (its one synchronisation)."""
        first = self._first or self.sync_contents
        check_on_host(batch, num_pages, entry=entry, names=names,
                      scales=(caches.k_scale, caches.v_scale) if first else ())
        if not graph:
            self._first = False

    def admit_call(self, entry: str, ops: tuple[str, ...], *, caches: PagedKVCache, batch: BatchMetadata,
                   topk: Optional[TopkBuffer] = None, index_q: Optional[torch.Tensor] = None,
                   q: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, graph: bool = False,
                   names: ArgNames = LAYER_NAMES, order: Optional[str] = None,
                   hands_word: bool = False) -> tuple[Plan, Optional[torch.Tensor]]:
        """Admit a call on this target and judge its contents, as :meth:`run` does before the hooks:
        ``(plan, page_faults)``. A caller that does an op's work itself (``index_scores`` where no
        bound backend provides it) calls this, then works. ``hands_word``: the caller hands the index
        hook the ``page_faults`` returned, so a backend that ``judges_contents`` judges them there (no
        ``check_contents`` call now)."""
        return self.run(entry, ops, caches, batch, topk, index_q, q, out, graph=graph, names=names, order=order,
                        hooks=False, hands_word=hands_word)

    # -- the step -------------------------------------------------------------------------------
    @staticmethod
    def capturing(x: object) -> bool:
        """Whether ``x``'s stream is being captured in a CUDA graph (what ``run`` asks when not told)."""
        return isinstance(x, torch.Tensor) and x.is_cuda and capturing(x)

    def run(self, entry: str, ops: tuple[str, ...], caches: PagedKVCache, batch: BatchMetadata,
            topk: Optional[TopkBuffer] = None, index_q: Optional[torch.Tensor] = None,
            q: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None, *, graph: Optional[bool] = None,
            names: ArgNames = LAYER_NAMES, order: Optional[str] = None,
            hooks: bool = True, hands_word: bool = False) -> tuple[Plan, Optional[torch.Tensor]]:
        """Admit the call, judge its contents, run its hooks (``ops``: both, or one) on rows ``[0, T)``;
        returns ``(plan, page_faults)`` (the word passed a reporting index op, else ``None``).

        ``index_scores`` (alone): ``out`` is the caller's ``[H, >= T, N]`` scores, of which rows ``[0, T)``
        are written; its backend must exist (:attr:`scorer`). ``hands_word``: see :meth:`admit_call`.
        ``graph``: the call is being captured in a CUDA graph (``None``: :meth:`capturing` of the queries
        says). ``order``: the order the entry point
        needs of the rows its index op writes and promises of the rows it hands an attention
        (``"ascending"``, or ``None``: any); the plan says what to sort. ``hooks=False``: admit and judge
        the contents only (:meth:`admit_call`).

        One function, the steps in the module docstring's order, written out rather than split into
        helpers: each Python call costs a step about 0.1 us, and a steady step makes none but the hooks'.
        """
        # 1. the plan: the facts engine traffic does not change (a row-per-token tensor's rows are a count)
        try:
            bs = batch.facts
            T = bs.num_tokens
            # each tensor's dtype, device and sizes but its rows (unpacked: slicing a torch.Size costs more);
            # a tensor of other dims fails to unpack, and every rule names it
            si = sq = so = None
            fi = fq = fo = None
            if index_q is not None:
                _, i1, i2 = si = index_q.shape
                fi = (index_q.dtype, index_q.device, i1, i2)
            if q is not None:
                _, q1, q2 = sq = q.shape
                fq = (q.dtype, q.device, q1, q2)
            if out is not None:
                o0, o1, o2 = so = out.shape
                fo = (out.dtype, out.device, o1 if ops[0] is not _SCORES else o0, o2, out.stride())
            key: Optional[tuple[Any, ...]] = (entry, names, ops, order, bs.key, caches.facts,
                                              None if topk is None else topk.facts, T > 1, fi, fq, fo)
        except (AttributeError, ValueError, TypeError):   # an argument of the wrong type or dims: the rules name it
            key = None
        course = self._last.get(entry)
        if course is None or key != course[0]:   # the last call's facts (most calls): item by item, no hashing
            course = self._planned(key, entry, ops, caches, batch, topk, index_q, q, out, names, order)
        _, plan, host, num_pages, be, reports, checker, judged, word, index, attend, scores, plain = course
        # 2. the counts (Plan says which): O(1) int comparisons
        nd = bs.num_decodes
        exact = plan.exact_rows
        if not (bs.consistent and T <= plan.max_tokens and (not nd or bs.decode_query_len <= plan.max_decode_query_len)
                and (si is None or (si[0] == T if exact else si[0] >= T))
                and (sq is None or (sq[0] == T if exact else sq[0] >= T))
                and (so is None or so[1 if scores else 0] >= T)
                and (topk is None or T <= topk.num_tokens <= plan.max_topk_rows)):
            # some count breaks a rule (which one, every rule says), or a plan of other counts holds (this call's)
            plan = self._judge(entry, ops, caches, batch, topk, index_q, q, out, names, order)
            plain = self._course(key, plan, ops, caches, batch)[-1]
        if graph is None:
            graph = self.capturing(q if q is not None else index_q)
        # 3. the contents, the cheapest way that still sees them
        flag = self.flag
        if not graph and flag.host_word[0] != NO_FAULT:
            flag.raise_pending()
        flag.context = (entry, names, num_pages, bs)   # no tensor kept past the step
        if host or (not graph and (self._first or self.sync_contents)):
            self._contents_on_host(entry, caches, batch, graph, names, num_pages)
        elif judged and (hooks or hands_word):
            pass    # the index op's hook judges them into the word it is handed, in its own launches
        elif checker is not None:      # what the tensors hold now, every call: an engine edits them in place
            try:
                checker(batch, num_pages, flag.word)
            except Exception as e:     # named as any hook's failure is
                be.reraise(e, "check_contents")
        else:
            # a backend's reporting covers the page ids its kernels load; token slots are judged here
            flag.record(batch, num_pages, graph=graph, pages=not reports or batch.slots is not None)
        faults = flag.word if word else None
        if not hooks:
            return plan, faults
        # 4. the hooks: a call is guarded unless captured, "never", or (in "first") its op passed on its kind
        kind = bs.kind
        passed = None if graph or self._never else _NONE_PASSED if self._always else self._passed
        if scores:
            if self.scorer is None:
                raise InputError(f"{entry}: no bound backend provides index_scores; score the blocks without "
                                 f"one (OpTarget.admit_call, then mm3.integrations.block_scores)")
            rows = out if so[1] == T else out[:, :T]  # type: ignore[index,union-attr]
            self._call(self.scorer, _SCORES_HOOK, (index_q, caches, batch, self.params, rows, faults),
                       kind if passed is not None and kind not in passed[_SCORES_NAME] else None)
        else:
            assert topk is not None
            if topk.num_tokens == T:
                sel = topk
            elif topk is self.topk:
                sel = self._rows.get(T) or self._rows.setdefault(T, topk.rows(0, T))
            else:
                sel = topk.rows(0, T)
            if index:
                write = sel if plain or plan.index_via is None else \
                    TopkBuffer.allocate(T, sel.num_heads, sel.topk, plan.index_via, sel.device)
                args = (index_q, caches, batch, self.params, write, faults)
                if passed is not None and kind not in passed[_INDEX_NAME]:
                    self._call(self.indexer, _INDEX_HOOK, args, kind)
                else:
                    try:
                        self.indexer.calls[_INDEX_NAME](*args)
                    except Exception as e:
                        self.indexer.reraise(e, _INDEX_HOOK[1])
                if not plain:
                    if write is not sel:
                        sel.copy_(write)
                    if plan.sort_written:
                        sort_ascending_(sel)
            if attend:
                read = sel if plain or plan.convert_to is None else sel.to_layout(plan.convert_to)
                if not plain and plan.sort_read:  # the caller's rows stay as given: a converted copy is sorted
                    read = sorted_ascending(read) if read is sel else sort_ascending_(read)
                args = (q, caches, read, batch, self.params, out if so[0] == T else out[:T])  # type: ignore[index]
                if passed is not None and kind not in passed[_ATTENTION_NAME]:
                    self._call(self.attention, _ATTENTION_HOOK, args, kind)
                else:
                    try:
                        self.attention.calls[_ATTENTION_NAME](*args)
                    except Exception as e:
                        self.attention.reraise(e, _ATTENTION_HOOK[1])
        if faults is not None and not graph and not flag.shared:
            flag.after_step()
        return plan, faults

    def _call(self, be: "Backend", op: tuple[str, str], args: tuple[Any, ...], guard_kind: Optional[str]) -> None:
        """The hook of ``op`` (its name and hook) on ``args`` (the hook spec's order,
        :mod:`mm3.contract.hookspecs`); through the guard when ``guard_kind`` names the call's batch kind
        (which then counts as passed, unless ``"always"``)."""
        name = op[0]
        if guard_kind is not None:
            guard.checked_call(be, name, args)
            if not self._always:
                self._passed[name].add(guard_kind)
            return
        try:
            be.calls[name](*args)
        except Exception as e:
            be.reraise(e, op[1])
