"""The composed op: indexer -> top-k buffer -> attention.

``SparseAttention`` selects its backends once, allocates one persistent top-k
buffer through the indexer backend (sized for the largest step, so its address
is stable for CUDA graphs) and, per step, calls the two bound backend
functions on ``rows(0, T)`` of that buffer. When the attention backend needs
the buffer in another layout, the core converts it and the selection trace
says so; nothing ever guesses a layout from a shape.

Example:
    >>> import torch, mm3
    >>> from mm3.testing.factories import make_case
    >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32,
    ...     num_index_heads=2, index_head_dim=32, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[70, 40], prefills=[(9, 30)], dtype="float32")
    >>> layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=64, backend="cpu_ref")
    >>> out = layer(case.q, case.index_q, case.caches, case.batch)
    >>> out.shape
    torch.Size([11, 4, 32])
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.runtime.config import Settings, default_settings
from mm3.contract.errors import InputError
from mm3.contract.page_ids import PageIdFlag
from mm3.debug.guard import capturing, guard_backend
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.backend import Backend
from mm3.runtime.ops import batch_args
from mm3.runtime.step import OpTarget, remember
from mm3.runtime.registry import Registry, default_registry
from mm3.runtime.scope import current_scope
from mm3.runtime.selection import Selection, requirements_for, select
from mm3.contract.checks import check_layer_args, check_step_inputs

__all__ = ["SparseAttention"]

DeviceLike = Union[str, torch.device]


@dataclass
class _Bound:
    """One resolved choice: the backends, their bound calls and the persistent buffer.

    ``indexer``/``attention`` are guarded unless ``check_contracts`` is
    ``"never"``; ``target`` runs every step (eager, compiled, the custom ops) on
    them or on the unguarded pair by the guard's policy (:mod:`mm3.runtime.step`).
    """

    selection: Selection
    indexer: Backend
    attention: Backend
    topk: TopkBuffer
    convert_to: Optional[str]  # layout the attention needs, when a per-step copy is required
    target: OpTarget           # what torch.ops.mm3.* dispatch to for this choice
    #: layer-level shape classes whose inputs passed every check of the step
    inputs_ok: set[Any] = field(default_factory=set)
    _rows: dict[int, TopkBuffer] = field(default_factory=dict)

    @property
    def checked(self) -> set[str]:
        """Batch kinds already run through the guard (``"first"`` mode)."""
        return self.target.checked

    def rows(self, T: int) -> TopkBuffer:
        """``topk.rows(0, T)``, built once per token count."""
        got = self._rows.get(T)
        if got is None:
            got = self._rows[T] = self.topk.rows(0, T)
        return got


class SparseAttention:
    """MiniMax-M3 block-sparse attention for one layer, on the selected backends.

    Args:
        params: shapes and selection policy (:meth:`SparseAttentionParams.minimax_m3`).
        device: where inputs live; selection probes backends on it.
        dtype: attention dtype of ``q``, ``index_q`` and the KV cache.
        index_dtype: dtype of the index cache (bf16, or float8_e4m3fn).
        kv_dtype: dtype of the K/V caches when it is not ``dtype``: ``torch.float8_e4m3fn`` or
            ``torch.float8_e5m2`` (scaled fp8, see :class:`~mm3.contract.buffers.PagedKVCache`).
            ``None``: ``dtype``.
        max_num_tokens: the largest step (tokens) this layer will see; sizes the
            persistent top-k buffer.
        max_decode_query_len: 1 + draft tokens for speculative decoding.
        backend / indexer_backend: backend names, or ``None`` to follow
            ``use_backend`` scopes, then settings (``MM3_BACKEND``...), then "auto".
        settings: explicit :class:`~mm3.runtime.config.Settings` (default: the process's,
            :func:`~mm3.runtime.config.default_settings`).
        registry: the backend registry (default: the process-wide one).
        cuda_graph: require backends that are safe to capture in CUDA graphs.

    Example (a mixed step: two decodes, then a prefill chunk with context; ``out`` persists):
        >>> import torch, mm3
        >>> from mm3.testing.factories import make_case
        >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32,
        ...     num_index_heads=2, index_head_dim=32, block_size=16, topk=4)
        >>> layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=64)
        >>> case = make_case(p, decodes=[70, 40], prefills=[(9, 30)], dtype="float32")
        >>> out = torch.empty(64, 4, 32)
        >>> with torch.inference_mode():
        ...     layer(case.q, case.index_q, case.caches, case.batch, out=out).shape
        torch.Size([11, 4, 32])
        >>> layer.selection.attention.name
        'cpu_ref'
    """

    def __init__(self, params: SparseAttentionParams, *, device: DeviceLike = "cpu",
                 dtype: torch.dtype = torch.bfloat16, index_dtype: torch.dtype = torch.bfloat16,
                 max_num_tokens: int = 8192, max_decode_query_len: int = 1,
                 backend: Optional[str] = None, indexer_backend: Optional[str] = None,
                 settings: Optional[Settings] = None, registry: Optional[Registry] = None,
                 cuda_graph: bool = False, kv_dtype: Optional[torch.dtype] = None) -> None:
        if not isinstance(params, SparseAttentionParams):
            raise InputError(f"params must be SparseAttentionParams, got {type(params).__name__}")
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise InputError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
        for name, value in (("dtype", dtype), ("index_dtype", index_dtype), ("kv_dtype", kv_dtype)):
            if value is not None and not isinstance(value, torch.dtype):
                raise InputError(f"{name} must be a torch.dtype (e.g. torch.{value} if {value!r} is a dtype "
                                 f"name), got {type(value).__name__} {value!r}")
        self.params = params
        self.device = check_layer_args(device, max_decode_query_len)
        self.dtype = dtype
        self.index_dtype = index_dtype
        self.kv_dtype = kv_dtype if kv_dtype is not None else dtype
        self.max_num_tokens = max_num_tokens
        self.max_decode_query_len = max_decode_query_len
        self.settings = settings if settings is not None else default_settings()
        self.registry = registry if registry is not None else default_registry()
        self._explicit = (backend, indexer_backend) if backend is not None or indexer_backend is not None else None
        self.requirements = requirements_for(params, dtype, index_dtype, self.device,
                                             decode_query_len=max_decode_query_len, cuda_graph=cuda_graph,
                                             kv_dtype=self.kv_dtype)
        self._bound: dict[tuple[str, Optional[str]], _Bound] = {}
        self._lock = threading.Lock()
        self._page_ids = PageIdFlag(self.device)
        self._resolve()  # select now so configuration errors surface at construction

    # -- selection -------------------------------------------------------------------
    def _names(self) -> tuple[str, Optional[str]]:
        if self._explicit is not None:
            return (self._explicit[0] or self.settings.backend, self._explicit[1])
        scope = current_scope()
        if scope is not None:
            return (scope.backend, scope.indexer_backend)
        return (self.settings.backend, self.settings.indexer_backend)

    def _resolve(self) -> _Bound:
        key = self._names()
        bound = self._bound.get(key)
        if bound is not None:
            return bound
        with self._lock:
            bound = self._bound.get(key)
            if bound is None:
                bound = self._bind(*key)
                self._bound[key] = bound
        return bound

    def _bind(self, backend: str, indexer_backend: Optional[str]) -> _Bound:
        sel = select(self.requirements, self.registry, backend=backend, indexer_backend=indexer_backend,
                     allow_fallback=self.settings.allow_fallback, device=self.device)
        idx, att = fast = (sel.indexer, sel.attention)
        if self.settings.check_contracts != "never":
            idx, att = guard_backend(idx), guard_backend(att)
        p = self.params
        # Backend.alloc_topk_buffer already checks type, layout and shape against the declaration.
        buf = idx.alloc_topk_buffer(self.max_num_tokens, p.num_index_heads, p.topk, self.device)
        # What runs is what the trace says: both come from the selection's verdict on this buffer.
        sel = sel.for_buffer(buf)
        convert_to = sel.topk_convert_to
        mode = self.settings.check_contracts
        target = OpTarget(idx, att, p, buf.layout, convert_to or buf.layout, plain=fast if mode == "first" else None,
                          mode=mode, page_ids=self._page_ids)
        return _Bound(sel, idx, att, buf, convert_to, target)

    @property
    def selection(self) -> Selection:
        """The current choice (honours an active ``use_backend`` scope)."""
        return self._resolve().selection

    @property
    def op_target(self) -> OpTarget:
        """What ``torch.ops.mm3.index_topk`` / ``attention`` dispatch to for the current choice
        (pass its ``handle``; :mod:`mm3.runtime.ops`)."""
        return self._resolve().target

    @property
    def topk_buffer(self) -> TopkBuffer:
        """The persistent top-k buffer of the current indexer backend (all ``max_num_tokens`` rows)."""
        return self._resolve().topk

    def topk_for_attention(self, topk: TopkBuffer) -> TopkBuffer:
        """``topk`` as the current attention backend reads it: converted to its layout when it
        requires a dense buffer in that layout, else ``topk`` itself (what ``forward`` does)."""
        return self._for_attention(self._resolve(), topk)

    @staticmethod
    def _for_attention(b: _Bound, topk: TopkBuffer) -> TopkBuffer:
        return topk if b.convert_to is None else topk.to_layout(b.convert_to, contiguous=True)

    def explain(self) -> str:
        """The selection trace, readable: every candidate with its reasons."""
        return self._resolve().selection.explain()

    # -- the step -------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, index_q: torch.Tensor, caches: PagedKVCache,
                batch: BatchMetadata, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the indexer then the attention for one step; returns ``out[:T]``.

        ``out`` (optional) may have more rows than the step; only ``[0, T)`` is written.
        """
        b = self._resolve()
        if torch.compiler.is_compiling():  # one opaque node per op: nothing below is traced
            self._check_inputs(b, q, index_q, caches, batch, out)
            T = batch.num_tokens
            out = torch.empty_like(q) if out is None else out
            # the ops run the layer's own target: the same policy, guard and page-id checks as eager steps
            args, c, handle = batch_args(batch), caches, b.target.handle
            torch.ops.mm3.index_topk(index_q, c.k, c.v, c.index, b.topk.storage, *args, handle, c.k_scale,
                                     c.v_scale)
            topk = self._for_attention(b, b.topk.rows(0, T))
            torch.ops.mm3.attention(q, c.k, c.v, c.index, topk.storage, *args, handle, out, c.k_scale, c.v_scale)
            return out[:T]
        # Every check of a step reads shapes, dtypes and devices only: a step of a class that
        # passed them all (these inputs, and the backends' own) skips them.
        try:
            key: Any = (caches.shape_class, batch.shape_class, q.shape, q.dtype, q.device, index_q.shape,
                        index_q.dtype, index_q.device, None if out is None else
                        (out.shape, out.stride(), out.dtype, out.device))
        except AttributeError:   # not a cache, a batch or tensors: the checks say which
            key = None
        trusted = key is not None and key in b.inputs_ok
        if not trusted:
            self._check_inputs(b, q, index_q, caches, batch, out)
        T = batch.num_tokens
        if out is None:
            out = torch.empty_like(q)
        o = out if out.shape[0] == T else out[:T]
        # the guard's policy ("first": a batch kind's first step is guarded, never while a CUDA
        # graph is captured) and the page-id check are the target's, as for the custom ops
        graph = capturing(q)
        topk = b.rows(T)
        # the attention reuses the indexer's decision: the same step, batch and caches (its own
        # page-id check would find the table the indexer's just checked or recorded)
        guarded = b.target.run_index_topk(index_q, caches, batch, topk, graph=graph, trusted=trusted)
        b.target.run_attention(q, caches, self._for_attention(b, topk), batch, o, graph=graph, trusted=trusted,
                               guarded=guarded)
        if not trusted and key is not None:
            remember(b.inputs_ok, key)
        return o

    def _check_inputs(self, b: _Bound, q: torch.Tensor, index_q: torch.Tensor, caches: PagedKVCache,
                      batch: BatchMetadata, out: Optional[torch.Tensor]) -> None:
        check_step_inputs(self.params, q, index_q, caches, batch, out, dtype=self.dtype,
                          index_dtype=self.index_dtype, kv_dtype=self.kv_dtype, device=self.device,
                          capacity=b.topk.num_tokens, max_decode_query_len=self.max_decode_query_len)

    def check_page_ids(self) -> None:
        """Wait for the device and raise :class:`~mm3.contract.errors.InputError` if a step of this
        layer used a block-table entry that is not a page of its cache (the steps surface it
        themselves one step later; call this after the last step you care about)."""
        self._page_ids.check()

    __call__ = forward

    def __repr__(self) -> str:
        try:
            b = self._resolve()
            chosen = f"indexer={b.indexer.name!r}, attention={b.attention.name!r}"
        except Exception as e:  # repr must never raise
            chosen = f"unresolved: {e}"
        return f"SparseAttention({chosen}, heads={self.params.num_heads}/{self.params.num_kv_heads}, " \
               f"dtype={self.dtype}, device={self.device})"
