"""Choose the indexer and attention backends for a request, and say why.

:func:`select` is a pure function of the requirements, the registry's
backends (their capabilities and probes) and the requested names. It returns a
:class:`Selection` whose trace holds one entry per candidate per op, accepted
or rejected with every reason, so a surprising choice can always be explained.

Rules (docs/configuration.md):

* ``backend`` governs the attention. A *named* backend that cannot serve
  raises :class:`~mm3.contract.errors.BackendUnavailableError` with its reasons; with
  ``allow_fallback=True`` selection falls back to ``"auto"`` instead and the
  trace says so. An unknown name always raises
  :class:`~mm3.contract.errors.UnknownBackendError` (a typo is not a reason to fall back).
* ``"auto"`` takes the highest-priority backend that is available on the
  device and capable (ties broken by name).
* The indexer is ``indexer_backend`` when given (same rules); otherwise the
  attention backend itself when it provides ``index_topk`` and is capable;
  otherwise ``"auto"`` for ``index_topk``.
* Nothing fits -> :class:`~mm3.contract.errors.NoBackendError` listing the request and
  each candidate's reasons.
* Block scores (the optional ``index_scores`` op), only when ``requirements.ops``
  asks for them: the indexer's own, when it provides them and is capable;
  otherwise none (:attr:`Selection.scorer` is ``None``, and the trace says why:
  a caller then scores the blocks itself). Never another backend: scores
  from the indexer's arithmetic select what its ``index_topk`` selects.
* When the attention backend needs a contiguous top-k buffer in a layout other
  than the one the indexer writes, :attr:`Selection.topk_conversion` says the
  core converts the buffer each step.

Example:
    >>> import torch
    >>> from mm3.contract.params import SparseAttentionParams
    >>> req = requirements_for(SparseAttentionParams.minimax_m3(tp_size=8),
    ...                        torch.bfloat16, torch.bfloat16, "cpu")
    >>> from mm3.runtime.registry import Registry
    >>> from mm3.testing.mock import MockBackend
    >>> reg = Registry([MockBackend("fast", priority=5, available=False, probe_reason="no GPU"),
    ...                 MockBackend("ref")], entry_points=False)
    >>> sel = select(req, reg, device="cpu")
    >>> sel.attention.name, sel.indexer.name
    ('ref', 'ref')
    >>> print(sel.explain().splitlines()[2])
        fast  rejected: unavailable on cpu: no GPU [auto]
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional, Union

from pydantic import ValidationError

from mm3.contract.buffers import dtype_name
from mm3.contract.capabilities import Probe, Requirements
from mm3.contract.hookspecs import STEP_OPS, Op
from mm3.contract.errors import BackendUnavailableError, InputError, NoBackendError, describe_validation_error

if TYPE_CHECKING:
    import torch

    from mm3.contract.buffers import TopkBuffer
    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.backend import Backend
    from mm3.runtime.registry import Registry

__all__ = ["TraceEntry", "Selection", "select", "requirements_for", "describe_requirements",
           "topk_conversion_target"]

logger = logging.getLogger("mm3")

DeviceLike = Union[str, "torch.device"]


@dataclass(frozen=True)
class TraceEntry:
    """One candidate considered for one op (the attention, or the indexer's ``index_topk``).

    ``reasons`` lists every reason the backend was rejected (empty when
    accepted); ``probe`` is its probe answer on the device; ``chosen`` marks the
    winner; ``note`` says how it came to be considered (named, auto, fallback...).
    """

    backend: str
    op: Op
    accepted: bool
    reasons: tuple[str, ...]
    probe: Probe
    priority: int
    chosen: bool = False
    note: str = ""


@dataclass(frozen=True)
class Selection:
    """The chosen backends for one request, with the trace that led there.

    Example:
        >>> from mm3.runtime.registry import Registry
        >>> from mm3.testing.helpers import default_params
        >>> from mm3.testing.mock import MockBackend
        >>> reg = Registry([MockBackend("idx", ops={"index_topk"}, topk_layout="head_major"),
        ...                 MockBackend("att", ops={"attention"}, topk_layout="token_major",
        ...                             topk_requires_contiguous=True)], entry_points=False)
        >>> sel = select(requirements_for(default_params(), "float32", "bfloat16", "cpu"), reg,
        ...              device="cpu")
        >>> sel.indexer.name, sel.attention.name, sel.converts_topk
        ('idx', 'att', True)
    """

    indexer: "Backend"
    attention: "Backend"
    requirements: Requirements
    device: str
    #: the layout the core converts the top-k buffer to before each attention call, or None
    topk_convert_to: Optional[str] = None
    #: the layout and density of the buffer the indexer writes (what the conversion was judged on)
    topk_written: tuple[str, bool] = ("head_major", True)
    trace: list[TraceEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the backend of ``index_scores`` (asked for in ``requirements.ops``); ``None``: none provides it
    scorer: Optional["Backend"] = None

    @property
    def converts_topk(self) -> bool:
        """True when the core copies the top-k buffer into the attention's layout each step."""
        return self.topk_convert_to is not None

    @property
    def topk_conversion(self) -> Optional[str]:
        """The trace's sentence for :attr:`topk_convert_to` (None when there is no conversion)."""
        if self.topk_convert_to is None:
            return None
        layout, dense = self.topk_written
        written = layout if dense else f"non-dense {layout}"
        return (f"indexer {self.indexer.name!r} writes a {written} top-k buffer but attention "
                f"{self.attention.name!r} requires a contiguous {self.topk_convert_to} one, so the core "
                f"copies the step's rows into {self.topk_convert_to} layout before each attention call")

    def for_buffer(self, topk: "TopkBuffer") -> "Selection":
        """This selection with the conversion judged on the indexer's actual buffer."""
        return replace(self, topk_convert_to=topk_conversion_target(self.attention, topk.layout, topk.is_dense()),
                       topk_written=(topk.layout, topk.is_dense()))

    def entries(self, op: str) -> list[TraceEntry]:
        """Trace entries of one op (``"attention"`` or ``"index_topk"``), in the order considered."""
        return [e for e in self.trace if e.op == op]

    def summary(self) -> str:
        """One line: ``indexer=cuda attention=cuda on cuda:0``."""
        conv = " (top-k converted per step)" if self.topk_conversion else ""
        return f"indexer={self.indexer.name} attention={self.attention.name} on {self.device}{conv}"

    def explain(self) -> str:
        """A readable multi-line trace; ``*`` marks the chosen backend of each op."""
        lines = [f"mm3 backend selection on {self.device}: {describe_requirements(self.requirements)}"]
        for op in (Op.ATTENTION, Op.INDEX_TOPK, Op.INDEX_SCORES):
            entries = self.entries(op)
            if op == Op.INDEX_SCORES and not entries:
                continue
            lines.append(f"{op}:")
            width = max((len(e.backend) for e in entries), default=0)
            for e in entries:
                mark = "*" if e.chosen else " "
                note = f" [{e.note}]" if e.note else ""
                if e.chosen:
                    status = f"chosen (priority {e.priority}; {e.probe.reason or 'available'})"
                elif e.accepted:
                    status = f"capable, not chosen (priority {e.priority})"
                else:
                    status = "rejected: " + "; ".join(e.reasons)
                lines.append(f"  {mark} {e.backend:<{width}}  {status}{note}")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.topk_conversion:
            lines.append(f"top-k conversion: {self.topk_conversion}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def describe_requirements(req: Requirements) -> str:
    """A compact human description of a request, for messages and traces."""
    return (f"device type {req.device_type}, dtype {req.dtype}, index cache {req.index_cache_dtype}, "
            f"head_dim {req.head_dim}, index_head_dim {req.index_head_dim}, block_size "
            f"{req.block_size}, topk {req.topk}, GQA group {req.gqa_group}, decode query len "
            f"{req.decode_query_len}"
            + (f", KV cache {req.kv_cache_dtype}" if req.kv_cache_dtype not in (None, req.dtype) else "")
            + (f", {req.query_dtype} queries" if req.query_dtype else "")
            + (" with scales per token slot" if req.kv_slot_scales else "")
            + (", CUDA graph" if req.cuda_graph else ""))


def requirements_for(params: "SparseAttentionParams", q_dtype: Union["torch.dtype", str],
                     index_dtype: Union["torch.dtype", str], device: DeviceLike,
                     decode_query_len: int = 1, cuda_graph: bool = False,
                     kv_dtype: Union["torch.dtype", str, None] = None,
                     kv_slot_scales: bool = False, query_dtype: Optional[str] = None,
                     addressing: str = "pages") -> Requirements:
    """The :class:`Requirements` of running ``params`` with these dtypes on ``device``.

    ``kv_dtype``: the K/V cache dtype when it is not ``q_dtype`` (``float8_e4m3fn`` or
    ``float8_e5m2``, scaled);
    ``kv_slot_scales``: its scales are per KV head and token slot (docs/spec.md §1);
    ``kv_dtype`` / ``index_dtype`` may name a quantized format (``"float8_e4m3fn_unscaled"``, ``"nvfp4"``)
    and ``query_dtype="float8_e4m3fn"`` asks for fp8 queries (``q_dtype`` is then the output's dtype);
    ``addressing="slots"``: batches of token slots (docs/spec.md §2), which only a backend declaring them reads.

    Example:
        >>> import torch
        >>> from mm3.contract.params import SparseAttentionParams
        >>> r = requirements_for(SparseAttentionParams.minimax_m3(tp_size=8),
        ...                      torch.bfloat16, torch.float8_e4m3fn, "cpu")
        >>> r.device_type, r.index_cache_dtype, r.gqa_group
        ('cpu', 'float8_e4m3fn', 8)
    """
    import torch

    dev = device if isinstance(device, torch.device) else torch.device(device)
    dt = q_dtype if isinstance(q_dtype, str) else dtype_name(q_dtype)
    idt = index_dtype if isinstance(index_dtype, str) else dtype_name(index_dtype)
    kvt = kv_dtype if kv_dtype is None or isinstance(kv_dtype, str) else dtype_name(kv_dtype)
    try:
        return Requirements(device_type=dev.type, ops=STEP_OPS, dtype=dt, index_cache_dtype=idt,
                            kv_cache_dtype=None if kvt == dt else kvt,
                            head_dim=params.head_dim, index_head_dim=params.index_head_dim,
                            block_size=params.block_size, topk=params.topk,
                            gqa_group=params.gqa_group, decode_query_len=decode_query_len,
                            cuda_graph=cuda_graph, kv_slot_scales=kv_slot_scales, query_dtype=query_dtype,
                            addressing=addressing)
    except ValidationError as e:
        raise InputError(f"unsupported request: {describe_validation_error(e)}; attention runs in bfloat16/float16/float32 "
                         f"(queries also float8_e4m3fn), the K/V cache in that dtype, float8_e4m3fn/float8_e5m2, "
                         f"float8_e4m3fn_unscaled or nvfp4, the index cache in bfloat16/float16/float32/float8_e4m3fn/"
                         f"nvfp4") from None


def _evaluate(be: "Backend", op: Op, req: Requirements, device: DeviceLike,
              note: str, auto: bool = False) -> TraceEntry:
    probe = be.probe(device)
    reasons: list[str] = []
    if not probe.available:
        reasons.append(f"unavailable on {device}: {probe.reason}")
    elif auto and not probe.auto:
        reasons.append(f"available on {device} only when named ({probe.reason}); auto passes it over")
    reasons.extend(be.capabilities.unmet(req.for_ops(op)))
    return TraceEntry(be.name, op, not reasons, tuple(reasons), probe, be.priority, note=note)


def _auto(op: Op, req: Requirements, registry: "Registry", device: DeviceLike,
          trace: list[TraceEntry], note: str, skip: Optional[str] = None) -> Optional["Backend"]:
    """Evaluate every backend (priority order) for ``op``; return the first accepted."""
    chosen: Optional[Backend] = None
    for be in registry.backends():
        if be.name == skip:
            continue
        entry = _evaluate(be, op, req, device, note, auto=True)
        if entry.accepted and chosen is None:
            chosen = be
            entry = _mark(entry)
        trace.append(entry)
    return chosen


def _mark(entry: TraceEntry) -> TraceEntry:
    return TraceEntry(entry.backend, entry.op, entry.accepted, entry.reasons, entry.probe,
                      entry.priority, chosen=True, note=entry.note)


def _no_backend(op: Op, req: Requirements, registry: "Registry", device: DeviceLike,
                trace: list[TraceEntry]) -> NoBackendError:
    lines = [f"no backend can serve the {op} op on {device} for {describe_requirements(req)}."]
    rejected = [e for e in trace if e.op == op and not e.accepted]
    if rejected:
        lines.append("Candidates:")
        lines += [f"  {e.backend}: {'; '.join(e.reasons)}" for e in rejected]
    else:
        lines.append("No backends are registered.")
    problems = registry.problems()
    if problems:
        lines.append("Excluded plugins:")
        lines += [f"  {p}" for p in problems]
    lines.append("Install or enable a backend that supports this request (see `mm3 backends`), "
                 "or change the dtype/shape.")
    return NoBackendError("\n".join(lines))


def _pick(op: Op, name: Optional[str], req: Requirements, registry: "Registry",
          device: DeviceLike, allow_fallback: bool, trace: list[TraceEntry],
          notes: list[str], setting: str) -> "Backend":
    if name is None or name == "auto":
        chosen = _auto(op, req, registry, device, trace, note="auto")
        if chosen is None:
            raise _no_backend(op, req, registry, device, trace)
        return chosen
    # UnknownBackendError / PluginError (duplicate) propagate; a name from Settings knows its source
    be = registry.get(name, origin=f"{setting}, from {getattr(name, 'source', 'argument')}")
    entry = _evaluate(be, op, req, device, note=f"named by {setting}")
    if entry.accepted:
        trace.append(_mark(entry))
        return be
    trace.append(entry)
    if not allow_fallback:
        raise BackendUnavailableError(
            f"backend {name!r} (named by {setting}) cannot serve the {op} op on {device}: "
            f"{'; '.join(entry.reasons)}. Choose another backend ({setting}=auto picks one that "
            f"can), or set allow_fallback=True / MM3_ALLOW_FALLBACK=1 to fall back automatically.")
    notes.append(f"{setting}={name!r} cannot serve the {op} op ({'; '.join(entry.reasons)}); "
                 f"falling back to auto because allow_fallback is set")
    chosen = _auto(op, req, registry, device, trace, note="fallback", skip=name)
    if chosen is None:
        raise _no_backend(op, req, registry, device, trace)
    return chosen


def topk_conversion_target(attention: "Backend", layout: str, dense: bool) -> Optional[str]:
    """The layout the core copies the indexer's top-k buffer (``layout``, ``dense``) into before
    each attention call: ``None`` when the attention accepts it as it is
    (:meth:`BackendCapabilities.accepts_topk`), else the attention's own layout."""
    att = attention.capabilities
    return None if att.accepts_topk(layout, dense) else att.topk_layout


_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_once(sel: Selection) -> None:
    # Every layer of a model selects; the same choice is logged once per process.
    msg = f"mm3: {sel.summary()} for {describe_requirements(sel.requirements)}"
    with _logged_lock:
        if msg in _logged:
            return
        _logged.add(msg)
    logger.info(msg)


def select(requirements: Requirements, registry: "Registry", *, backend: str = "auto",
           indexer_backend: Optional[str] = None, allow_fallback: bool = False,
           device: DeviceLike) -> Selection:
    """Choose the indexer and attention backends for ``requirements`` on ``device``.

    ``index_topk`` and ``attention`` are always chosen, each checked on its own; ``index_scores``
    when ``requirements.ops`` holds it. See the module docstring for the rules.

    Raises:
        UnknownBackendError: a named backend does not exist.
        PluginError: a named backend is declared by several plugins.
        BackendUnavailableError: a named backend cannot serve (and no ``allow_fallback``).
        NoBackendError: no backend fits an op.

    Example:
        >>> from mm3.runtime.registry import Registry
        >>> from mm3.testing.helpers import default_params
        >>> from mm3.testing.mock import MockBackend
        >>> reg = Registry([MockBackend("ref")], entry_points=False)
        >>> req = requirements_for(default_params(), "float32", "bfloat16", "cpu")
        >>> print(select(req, reg, backend="ref", device="cpu").summary())
        indexer=ref attention=ref on cpu
    """
    device_str = str(device)
    trace: list[TraceEntry] = []
    notes: list[str] = []
    attention = _pick(Op.ATTENTION, backend, requirements, registry, device_str, allow_fallback,
                      trace, notes, setting="backend")
    if indexer_backend is not None and indexer_backend != "auto":
        indexer = _pick(Op.INDEX_TOPK, indexer_backend, requirements, registry, device_str,
                        allow_fallback, trace, notes, setting="indexer_backend")
    elif indexer_backend is None and attention.provides("index_topk"):
        entry = _evaluate(attention, Op.INDEX_TOPK, requirements, device_str,
                          note="same backend as attention")
        if entry.accepted:
            trace.append(_mark(entry))
            indexer = attention
        else:
            trace.append(entry)
            notes.append(f"attention backend {attention.name!r} cannot serve as indexer "
                         f"({'; '.join(entry.reasons)}); indexer chosen by auto")
            chosen = _auto(Op.INDEX_TOPK, requirements, registry, device_str, trace, note="auto",
                           skip=attention.name)
            if chosen is None:
                raise _no_backend(Op.INDEX_TOPK, requirements, registry, device_str, trace)
            indexer = chosen
    else:
        if indexer_backend is None:
            notes.append(f"attention backend {attention.name!r} does not provide index_topk; "
                         f"indexer chosen by auto")
        indexer = _pick(Op.INDEX_TOPK, "auto", requirements, registry, device_str, allow_fallback,
                        trace, notes, setting="indexer_backend")
    scorer = _scorer(indexer, requirements, device_str, trace, notes) if Op.INDEX_SCORES in requirements.ops \
        else None
    # Before a buffer exists, assume the indexer allocates a dense one in its declared layout;
    # SparseAttention replaces this with the verdict on the buffer it got (Selection.for_buffer).
    written = indexer.capabilities.topk_layout
    conversion = topk_conversion_target(attention, written, dense=True)
    sel = Selection(indexer=indexer, attention=attention, requirements=requirements,
                    device=device_str, topk_convert_to=conversion, topk_written=(written, True), trace=trace,
                    notes=notes, scorer=scorer)
    _log_once(sel)
    return sel


def _scorer(indexer: "Backend", req: Requirements, device: str, trace: list[TraceEntry],
            notes: list[str]) -> Optional["Backend"]:
    """The indexer, if it can write the block scores (``index_scores``) for ``req``; else ``None``, and why."""
    entry = _evaluate(indexer, Op.INDEX_SCORES, req, device, note="the indexer's own")
    if entry.accepted:
        trace.append(_mark(entry))
        return indexer
    trace.append(entry)
    notes.append(f"no backend writes index_scores here (indexer {indexer.name!r}: {'; '.join(entry.reasons)}): "
                 f"block scores are the caller's to compute (mm3.integrations.vllm: mm3's torch scorer, "
                 f"mm3.integrations.block_scores)")
    return None
