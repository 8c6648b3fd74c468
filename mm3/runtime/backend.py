"""A bound backend: one plugin's hooks, resolved once, and its checked op methods.

pluggy is used to declare and validate the contract, not to dispatch: a
:class:`Backend` holds the plugin's own hookimpl functions, resolved once by
the registry, so hooks of different backends can never mix and a step pays
no ``pm.hook`` cost (``benchmarks/dispatch.py`` measures both). Its op
methods (:meth:`Backend.index_topk`...) run a call through the one boundary,
on a target of this backend for both ops (:mod:`mm3.runtime.step`): the
arguments, the limits its capabilities declare, its probe, the contents; then
the plugin, which checks only what is its own.
"""

from __future__ import annotations

import inspect
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from mm3.contract import hookspecs
from mm3.contract.buffers import TopkBuffer
from mm3.contract.capabilities import BackendCapabilities, Probe
from mm3.contract.contents import FaultFlag
from mm3.contract.errors import BackendUnavailableError, InputError, MM3Error, PluginError
from mm3.contract.hookspecs import Op
from mm3.debug.guard import capturing
from mm3.runtime.discovery import PluginSource, call_hookimpl, exc_line
from mm3.runtime.step import OpTarget

if TYPE_CHECKING:
    import pluggy

    from mm3.contract.batch import BatchMetadata
    from mm3.contract.buffers import PagedKVCache
    from mm3.contract.params import SparseAttentionParams

__all__ = ["Backend", "DeviceLike", "spec_args"]

DeviceLike = Union[str, torch.device]


def spec_args(op: Op) -> tuple[str, ...]:
    """The arguments of ``op``'s hook spec, in order (:mod:`mm3.contract.hookspecs`).

    Example:
        >>> spec_args(Op.ATTENTION)
        ('q', 'caches', 'topk', 'batch', 'params', 'out')
    """
    return tuple(inspect.signature(getattr(hookspecs, op.hook)).parameters)


class Backend:
    """A validated backend with its own hook implementations bound for direct calls.

    Obtained from :meth:`Registry.get` / :meth:`Registry.backends`; not built by
    hand. Op methods admit the call at the step's boundary (:mod:`mm3.runtime.step`),
    then call the plugin's own function (no pluggy dispatch); :meth:`invoke` is that call.

    Example:
        >>> import mm3
        >>> from mm3.testing.factories import make_case
        >>> from mm3.runtime.registry import default_registry
        >>> be = default_registry().get("cpu_ref")
        >>> be.capabilities.topk_layout, be.source.distribution
        ('head_major', 'mm3')
        >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
        ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
        >>> case = make_case(p, decodes=[40], prefills=[(5, 20)], dtype="float32")
        >>> buf = be.alloc_topk_buffer(64, 2, 4, "cpu")
        >>> be.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, case.batch.num_tokens))
        >>> be.index_topk(case.q, case.caches, case.batch, p, buf)   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mm3.contract.errors.InputError: cpu_ref.index_topk: index_q has shape (6, 4, 16); needs [>= 6, 2, 16] ...
    """

    def __init__(self, plugin: object, capabilities: BackendCapabilities, source: PluginSource,
                 impls: dict[str, "pluggy.HookImpl"]) -> None:
        self.plugin = plugin
        self.capabilities = capabilities
        self.source = source
        self._impls = dict(impls)
        self._probe_cache: dict[str, Probe] = {}
        self._ops = {op: impls[op.hook] for op in Op if op in capabilities.ops and op.hook in impls}
        self._where = {op: f"{capabilities.name}.{op.hook}" for op in Op}
        #: the plugin's op hooks, each called with its spec's arguments in order (what a step runs:
        #: :mod:`mm3.runtime.step`); the plugin's own function wherever it takes them so
        self.calls: dict[str, Callable[..., Any]] = {op.value: self._positional(op) for op in Op}
        #: the plugin's ``check_contents(batch, num_pages, word)``, called positionally; ``None``: it has none
        self.check_contents: Optional[Callable[..., None]] = None if "check_contents" not in impls else \
            _positional(impls["check_contents"], ("batch", "num_pages", "word"))
        self._targets: dict[tuple[object, ...], OpTarget] = {}

    # -- facts ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.capabilities.name

    @property
    def priority(self) -> int:
        return self.capabilities.priority

    @property
    def hooks(self) -> frozenset[str]:
        """Names of the hooks this plugin implements."""
        return frozenset(self._impls)

    def provides(self, op: str) -> bool:
        """True when the backend declares ``op`` ("index_topk" | "attention" | "index_scores") and implements it."""
        try:
            known = Op(op)
        except ValueError:
            raise InputError(f"unknown op {op!r}; ops are {sorted(Op)}") from None
        return known in self.capabilities.ops and known.hook in self._impls

    # -- probe ----------------------------------------------------------------------
    def probe(self, device: DeviceLike) -> Probe:
        """Can this backend run on ``device``? Cached per device string.

        A probe that raises or returns something other than a :class:`Probe`
        yields ``Probe.no(...)`` naming the problem; it never propagates.
        """
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        key = str(dev)
        cached = self._probe_cache.get(key)
        if cached is not None:
            return cached
        fn = self._impls.get("backend_probe")
        if fn is None:
            result = Probe.yes("no backend_probe hook; assumed available")
        else:
            try:
                got = call_hookimpl(fn, device=dev)
            except Exception as e:  # a probe must not take selection down
                result = Probe.no(f"probe raised {type(e).__name__}: {e}")
            else:
                if isinstance(got, Probe):
                    result = got
                else:
                    result = Probe.no(f"backend_probe returned {type(got).__name__} {got!r}, "
                                      f"expected mm3.plugin.Probe (return Probe.yes() or Probe.no(reason))")
        # A racing thread may probe twice; both results are equal and the write is atomic.
        self._probe_cache[key] = result
        return result

    # -- ops ----------------------------------------------------------------------------
    def alloc_topk_buffer(self, num_tokens: int, num_heads: int, topk: int,
                          device: DeviceLike) -> TopkBuffer:
        """A persistent top-k buffer in this backend's declared ``topk_layout``.

        Uses the plugin's ``alloc_topk_buffer`` hook when it has one, else
        ``TopkBuffer.allocate(..., layout=capabilities.topk_layout)``.
        """
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        fn = self._impls.get("alloc_topk_buffer")
        if fn is None:
            return TopkBuffer.allocate(num_tokens, num_heads, topk,
                                       layout=self.capabilities.topk_layout, device=dev)
        try:
            buf = self._call("alloc_topk_buffer", fn, num_tokens=num_tokens, num_heads=num_heads, topk=topk,
                             device=dev)
        except InputError as e:  # e.g. a TopkBuffer whose memory contradicts its label
            raise PluginError(f"backend {self.name!r} ({self.source}): alloc_topk_buffer built an invalid "
                              f"top-k buffer: {e.__cause__ or e}") from e
        if not isinstance(buf, TopkBuffer):
            raise PluginError(
                f"backend {self.name!r} ({self.source}): alloc_topk_buffer returned "
                f"{type(buf).__name__}, expected mm3.TopkBuffer; wrap the tensor with "
                f"TopkBuffer(view) (the logical [H, T, K] view of its memory) or drop the hook to use the default allocation")
        buf = buf._as(self.capabilities.topk_layout)   # one head: the memory is in both orders
        if buf.layout != self.capabilities.topk_layout:
            raise PluginError(
                f"backend {self.name!r} ({self.source}): alloc_topk_buffer returned a {buf.layout} "
                f"buffer but capabilities declare topk_layout={self.capabilities.topk_layout!r}; "
                f"make them agree")
        if (buf.num_heads, buf.num_tokens, buf.topk) != (num_heads, num_tokens, topk):
            raise PluginError(
                f"backend {self.name!r} ({self.source}): alloc_topk_buffer returned "
                f"[H={buf.num_heads}, T={buf.num_tokens}, K={buf.topk}], asked for "
                f"[H={num_heads}, T={num_tokens}, K={topk}]")
        return buf

    def _positional(self, op: Op) -> Callable[..., Any]:
        """A call of the plugin's ``op`` hook with its spec's arguments in order, positionally."""
        fn = self._ops.get(op)
        if fn is None:
            return lambda *args: self._op(op)    # raises, naming what the backend declares
        return _positional(fn, spec_args(op))

    def _op(self, op: Op) -> "pluggy.HookImpl":
        fn = self._ops.get(op)
        if fn is None:
            raise BackendUnavailableError(
                f"backend {self.name!r} does not provide {op.value!r} (its capabilities declare ops "
                f"{sorted(self.capabilities.ops)}, hooks {sorted(self._impls)}); select another "
                f"backend for this op, e.g. indexer_backend=... / MM3_INDEXER_BACKEND")
        return fn

    def _target(self, params: "SparseAttentionParams", device: torch.device) -> OpTarget:
        """The target of this backend's own op methods: this backend for both ops, ``params``."""
        key = (params, device)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = OpTarget(self, self, params, mode="never", flag=FaultFlag(device),
                                                   scorer=self if self.provides("index_scores") else None)
        return target

    def _run(self, op: Op, caches: "PagedKVCache", batch: "BatchMetadata", params: "SparseAttentionParams",
             topk: Optional[TopkBuffer], x: "torch.Tensor", out: Optional["torch.Tensor"],
             page_faults: Optional["torch.Tensor"]) -> None:
        self._op(op)
        where = self._where[op]
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{where}: {'q' if op is Op.ATTENTION else 'index_q'} must be a torch.Tensor, got "
                             f"{type(x).__name__}")
        target = self._target(params, x.device)
        graph = capturing(x)
        tensors = dict(q=x, out=out) if op is Op.ATTENTION else dict(index_q=x, out=out)
        # with no word of the caller's, the hook gets the target's: a judging index hook judges into it
        plan, faults = target.admit_call(where, (op,), caches=caches, batch=batch, topk=topk, graph=graph,
                                         hands_word=page_faults is None, **tensors)  # type: ignore[arg-type]
        if plan.convert_to or plan.index_via:
            raise InputError(f"{where}: needs a dense {self.capabilities.topk_layout} top-k buffer (it declares "
                             f"topk_requires_contiguous), got {topk!r}; convert it first: "
                             f"buf.to_layout({self.capabilities.topk_layout!r}) (SparseAttention does this for you)")
        if plan.sort_read:     # a direct call hands the hook exactly what it was given
            raise InputError(f"{where}: needs each row's ids ascending, -1 last (it declares "
                             f"topk_order_required='ascending'); sort them first: "
                             f"mm3.contract.topk_order.sort_ascending_(buf) (SparseAttention does this for you)")
        if op is Op.ATTENTION:
            self.invoke(op, (x, caches, topk, batch, params, out))
            return
        if not self.capabilities.reports_bad_page_ids:
            faults = None
        elif page_faults is not None:
            faults = page_faults
        rows = out[:, :batch.num_tokens] if op is Op.INDEX_SCORES else topk  # type: ignore[index]
        self.invoke(op, (x, caches, batch, params, rows, faults))

    def index_topk(self, index_q: "torch.Tensor", caches: "PagedKVCache", batch: "BatchMetadata",
                   params: "SparseAttentionParams", out: TopkBuffer,
                   page_faults: "Optional[torch.Tensor]" = None) -> None:
        """The indexer (docs/spec.md §3) on rows ``[0, T)`` of ``out``, through the step's boundary
        (:mod:`mm3.runtime.step`), then the plugin's hook.

        ``page_faults`` reaches a backend that declares ``reports_bad_page_ids`` (default: the word of this
        backend's own fault flag, raised at its next call); one that declares ``judges_contents`` lowers it
        for the batch's contents too (given no word, this call then judges them there alone).
        """
        self._run(Op.INDEX_TOPK, caches, batch, params, out, index_q, None, page_faults)

    def attention_forward(self, q: "torch.Tensor", caches: "PagedKVCache", topk: TopkBuffer,
                          batch: "BatchMetadata", params: "SparseAttentionParams",
                          out: "torch.Tensor") -> None:
        """Sparse attention (docs/spec.md §4) into ``out[:T]``, through the step's boundary, then the hook."""
        self._run(Op.ATTENTION, caches, batch, params, topk, q, out, None)

    def index_scores(self, index_q: "torch.Tensor", caches: "PagedKVCache", batch: "BatchMetadata",
                     params: "SparseAttentionParams", out: "torch.Tensor",
                     page_faults: "Optional[torch.Tensor]" = None) -> None:
        """The block scores (docs/spec.md §3.6) into every element of ``out`` (float32 ``[Hidx, T, N]``, any
        strides), through the step's boundary, then the hook. ``page_faults`` as for :meth:`index_topk`."""
        self._run(Op.INDEX_SCORES, caches, batch, params, None, index_q, out, page_faults)

    def check_page_ids(self) -> None:
        """Wait for the device and raise :class:`~mm3.contract.errors.InputError` if a call of this backend's
        op methods met bad batch contents on the device (they surface at the next call by themselves)."""
        for target in list(self._targets.values()):
            target.flag.check()

    def invoke(self, op: Op, args: "tuple[Any, ...]") -> None:
        """The plugin's ``op`` hook on ``args`` (the hook's spec order), no checks: what a step runs once the
        boundary admitted the call (:mod:`mm3.runtime.step`). What the hook raises is named by :meth:`reraise`."""
        try:
            self.calls[op.value](*args)
        except Exception as e:
            self.reraise(e, op.hook)

    def _call(self, hook: str, fn: "pluggy.HookImpl", **kwargs: Any) -> Any:
        """The plugin's ``hook``; what it raises is named by :meth:`reraise`."""
        try:
            return call_hookimpl(fn, **kwargs)
        except Exception as e:
            self.reraise(e, hook)

    def reraise(self, e: Exception, hook: str) -> None:
        """Raise what the plugin's ``hook`` raised, naming this backend and the hook (docs/errors.md §6).

        An mm3 error keeps its class (an ``InputError`` stays one) and gains a ``"name.hook: "``
        prefix unless its message names both already; running out of memory keeps its class and
        gains a note (engines catch it to shrink the step); anything else becomes a
        :class:`PluginError` raised from it. Either way the exception carries ``backend`` and
        ``hook`` attributes.
        """
        if isinstance(e, MM3Error):
            if self.name in str(e) and hook in str(e):
                raise _named(e, self.name, hook)
            named = type(e)(f"{self.name}.{hook}: {e}")
            named.__dict__.update(e.__dict__)
            raise _named(named, self.name, hook) from e
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            _note(e, f"raised by backend {self.name!r} ({self.source}) in {hook}")
            raise e
        raise _named(PluginError(
            f"backend {self.name!r} ({self.source}) failed in {hook}: {exc_line(e)}. The step has no "
            f"result; its rows of the top-k buffer and of out are undefined until the next step "
            f"rewrites them (the layer stays usable)"), self.name, hook) from e

    def __repr__(self) -> str:
        c = self.capabilities
        return (f"Backend({c.name!r}, priority={c.priority}, ops={sorted(c.ops)}, "
                f"topk_layout={c.topk_layout!r}, source={self.source!s})")



def _positional(fn: "pluggy.HookImpl", spec: tuple[str, ...]) -> Callable[..., Any]:
    """``fn`` called with ``spec``'s arguments in order: the plugin's own function where it takes exactly
    those, positionally (no wrapper: a step calls it), else a call by name (pluggy lets a hookimpl take
    any subset of its spec's arguments, in any order)."""
    params = list(inspect.signature(fn.function).parameters.values())
    f = fn.function
    if [p.name for p in params] == list(spec) and all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params):
        return f
    wanted = [n for n in fn.kwargnames if n in spec]
    if wanted or not set(fn.argnames) <= set(spec):
        return lambda *args: call_hookimpl(fn, **dict(zip(spec, args)))
    # the subset it names, picked by position (a step calls it: no dict of the arguments per call)
    at = [spec.index(n) for n in fn.argnames]
    if not at:
        return lambda *args: f()
    if len(at) == 1:
        (i,) = at
        return lambda *args: f(args[i])
    pick = itemgetter(*at)
    return lambda *args: f(*pick(args))


def _named(exc: MM3Error, backend: str, hook: str) -> MM3Error:
    """``exc`` with the ``backend`` and ``hook`` attributes a :class:`~mm3.ContractViolation` has too."""
    exc.backend = backend  # type: ignore[attr-defined]
    exc.hook = hook  # type: ignore[attr-defined]
    return exc


def _note(exc: BaseException, note: str) -> None:
    """Add a note to ``exc`` (shown under its traceback); Python 3.10 has no notes, so nothing there."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
