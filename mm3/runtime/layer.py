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
from dataclasses import dataclass
from typing import Optional, Union

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.runtime.config import Settings, default_settings
from mm3.contract.errors import InputError
from mm3.contract.checks import check_layer_args
from mm3.contract.contents import FaultFlag
from mm3.contract.facts import LayerFacts
from mm3.debug.guard import capturing, check_topk_allocation, fill_sentinel
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.backend import Backend
from mm3.runtime.ops import batch_args
from mm3.runtime.step import BOTH, OpTarget
from mm3.runtime.registry import Registry, default_registry
from mm3.runtime.scope import current_scope
from mm3.runtime.selection import Selection, requirements_for, select

__all__ = ["SparseAttention"]

_ENTRY = "SparseAttention.forward"

DeviceLike = Union[str, torch.device]


@dataclass
class _Bound:
    """One resolved choice: the selection, the bound backends, the persistent buffer and the target
    every step runs on (eager, compiled, the custom ops: :mod:`mm3.runtime.step`)."""

    selection: Selection
    indexer: Backend
    attention: Backend
    topk: TopkBuffer
    convert_to: Optional[str]  # layout the attention needs, when a per-step copy is required
    target: OpTarget           # what torch.ops.mm3.* dispatch to for this choice


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
        >>> layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=64, backend="cpu_ref")
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
        self._flag = FaultFlag(self.device)
        self._facts = LayerFacts(dtype, index_dtype, self.kv_dtype, self.device, max_num_tokens,
                                 max_decode_query_len)
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
        idx, att = sel.indexer, sel.attention
        p = self.params
        # Backend.alloc_topk_buffer already checks type, layout and shape against the declaration.
        buf = idx.alloc_topk_buffer(self.max_num_tokens, p.num_index_heads, p.topk, self.device)
        mode = self.settings.check_contracts
        if mode != "never":   # the guard checks what the hook returned, then marks it to see stray writes
            check_topk_allocation(buf, layout=idx.capabilities.topk_layout, num_tokens=self.max_num_tokens,
                                  num_heads=p.num_index_heads, topk=p.topk, device=self.device, backend=idx)
            fill_sentinel(buf)
        # What runs is what the trace says: both come from the selection's verdict on this buffer.
        sel = sel.for_buffer(buf)
        target = OpTarget(idx, att, p, topk=buf, mode=mode, flag=self._flag, layer=self._facts)
        return _Bound(sel, idx, att, buf, sel.topk_convert_to, target)

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
        if out is None and isinstance(q, torch.Tensor):
            out = torch.empty_like(q)
        if torch.compiler.is_compiling():  # one opaque node per op: nothing below is traced
            # each op admits its call at run time, held to this layer's promises (its target carries them)
            args, c, handle = batch_args(batch), caches, b.target.handle
            torch.ops.mm3.index_topk(index_q, c.k, c.v, c.index, b.topk.storage, *args, handle, c.k_scale,
                                     c.v_scale)
            torch.ops.mm3.attention(q, c.k, c.v, c.index, b.topk.storage, *args, handle, out, c.k_scale, c.v_scale)
            return out[:batch.num_tokens]  # type: ignore[index]
        b.target.run(_ENTRY, BOTH, caches=caches, batch=batch, topk=b.topk, index_q=index_q, q=q, out=out,
                     graph=isinstance(q, torch.Tensor) and capturing(q))
        T = batch.num_tokens
        return out if out.shape[0] == T else out[:T]  # type: ignore[union-attr]

    def check_page_ids(self) -> None:
        """Wait for the device and raise :class:`~mm3.contract.errors.InputError` if a step of this layer
        met bad batch contents on the device: a block-table entry that is not a page of its cache, or
        lengths and positions that contradict each other (:mod:`mm3.contract.contents`; the steps surface
        it themselves one step later: call this after the last step you care about, or after replaying
        CUDA graphs)."""
        self._flag.check()

    __call__ = forward

    def __repr__(self) -> str:
        try:
            b = self._resolve()
            chosen = f"indexer={b.indexer.name!r}, attention={b.attention.name!r}"
        except Exception as e:  # repr must never raise
            chosen = f"unresolved: {e}"
        return f"SparseAttention({chosen}, heads={self.params.num_heads}/{self.params.num_kv_heads}, " \
               f"dtype={self.dtype}, device={self.device})"
