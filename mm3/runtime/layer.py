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
from typing import Optional, Union

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer
from mm3.contract.checks import check_layer_args
from mm3.contract.contents import FaultFlag
from mm3.contract.errors import InputError
from mm3.contract.facts import LayerFacts
from mm3.contract.params import SparseAttentionParams
from mm3.runtime.binding import Binding, bind
from mm3.runtime.config import Settings, default_settings
from mm3.runtime.ops import batch_args
from mm3.runtime.registry import Registry, default_registry
from mm3.runtime.scope import SCOPE
from mm3.runtime.selection import Selection, requirements_for
from mm3.runtime.step import BOTH, OpTarget

__all__ = ["SparseAttention"]

#: torch.compile's question, read once (two attribute lookups a step need not make)
_compiling = torch.compiler.is_dynamo_compiling
_ENTRY = "SparseAttention.forward"

DeviceLike = Union[str, torch.device]


class SparseAttention:
    """MiniMax-M3 block-sparse attention for one layer, on the selected backends.

    Args:
        params: shapes and selection policy (:meth:`SparseAttentionParams.minimax_m3`).
        device: where inputs live; selection probes backends on it.
        dtype: attention dtype of ``q``, ``index_q`` and the KV cache.
        index_dtype: dtype of the index cache (bf16, or float8_e4m3fn).
        kv_dtype: dtype of the K/V caches when it is not ``dtype``: ``torch.float8_e4m3fn`` or
            ``torch.float8_e5m2`` (scaled fp8, see :class:`~mm3.contract.buffers.PagedKVCache`), or a
            quantized format's name: ``"float8_e4m3fn_unscaled"`` or ``"nvfp4"`` (docs/spec.md §1).
            ``None``: ``dtype``. ``index_dtype`` may be ``"nvfp4"`` too.
        q_dtype: the queries' dtype when it is not ``dtype``: ``torch.float8_e4m3fn`` (fp8 queries,
            no scale; ``index_q`` and the output stay in ``dtype``).
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
                 cuda_graph: bool = False, kv_dtype: Union[torch.dtype, str, None] = None,
                 q_dtype: Optional[torch.dtype] = None) -> None:
        if not isinstance(params, SparseAttentionParams):
            raise InputError(f"params must be SparseAttentionParams, got {type(params).__name__}")
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise InputError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
        formats = {"kv_dtype": ("float8_e4m3fn_unscaled", "nvfp4"), "index_dtype": ("nvfp4",)}
        for name, value in (("dtype", dtype), ("index_dtype", index_dtype), ("kv_dtype", kv_dtype),
                            ("q_dtype", q_dtype)):
            if value is not None and not isinstance(value, torch.dtype) and value not in formats.get(name, ()):
                named = f", or one of the format names {list(formats[name])}" if name in formats else ""
                raise InputError(f"{name} must be a torch.dtype (e.g. torch.{value} if {value!r} is a dtype "
                                 f"name){named}, got {type(value).__name__} {value!r}")
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
        if q_dtype not in (None, dtype, torch.float8_e4m3fn):
            raise InputError(f"q_dtype must be torch.float8_e4m3fn (fp8 queries) or dtype, got {q_dtype}")
        self.q_dtype = q_dtype if q_dtype is not None else dtype
        fp8_q = self.q_dtype == torch.float8_e4m3fn and dtype != torch.float8_e4m3fn
        self.requirements = requirements_for(params, dtype, index_dtype, self.device,
                                             decode_query_len=max_decode_query_len, cuda_graph=cuda_graph,
                                             kv_dtype=self.kv_dtype, query_dtype="float8_e4m3fn" if fp8_q else None)
        self._bound: dict[tuple[str, Optional[str]], Binding] = {}
        #: the binding of the names that hold outside any use_backend scope (a step's one read)
        self._default: Optional[Binding] = None
        self._lock = threading.Lock()
        self._flag = FaultFlag(self.device)
        fmt = [d if isinstance(d, str) else "" for d in (self.kv_dtype, index_dtype)]
        self._facts = LayerFacts(dtype, index_dtype if not fmt[1] else torch.uint8,  # type: ignore[arg-type]
                                 self.kv_dtype if not fmt[0] else torch.uint8, self.device,  # type: ignore[arg-type]
                                 max_num_tokens, max_decode_query_len, fmt[0], fmt[1], q_dtype if fp8_q else None)
        self._resolve()  # select now so configuration errors surface at construction

    # -- selection -------------------------------------------------------------------
    def _names(self) -> tuple[str, Optional[str]]:
        if self._explicit is not None:
            return (self._explicit[0] or self.settings.backend, self._explicit[1])
        scope = SCOPE.get()
        if scope is not None:
            return (scope.backend, scope.indexer_backend)
        return (self.settings.backend, self.settings.indexer_backend)

    def _resolve(self) -> Binding:
        """The binding of the names in force: bound once per names (a step reads it back)."""
        if self._explicit is not None or SCOPE.get() is None:
            b = self._default
            if b is not None:
                return b
        key = self._names()
        bound = self._bound.get(key)
        if bound is None:
            with self._lock:
                bound = self._bound.get(key)
                if bound is None:
                    bound = self._bound[key] = bind(self.params, self.requirements, key, self.device,
                                                    self.settings, self.registry, layer=self._facts,
                                                    flag=self._flag)
        if self._explicit is not None or SCOPE.get() is None:
            self._default = bound
        return bound

    @property
    def selection(self) -> Selection:
        """The current choice (honours an active ``use_backend`` scope)."""
        return self._resolve().selection

    @property
    def op_target(self) -> OpTarget:
        """What ``torch.ops.mm3.*`` dispatch to for the current choice
        (pass its ``handle``; :mod:`mm3.runtime.ops`)."""
        return self._resolve().target

    @property
    def topk_buffer(self) -> TopkBuffer:
        """The persistent top-k buffer of the current indexer backend (all ``max_num_tokens`` rows)."""
        return self._resolve().target.topk  # type: ignore[return-value]

    def topk_for_attention(self, topk: TopkBuffer) -> TopkBuffer:
        """``topk`` as the current attention backend reads it: converted to its layout when it
        requires a dense buffer in that layout, else ``topk`` itself (what ``forward`` does)."""
        return self._for_attention(self._resolve(), topk)

    @staticmethod
    def _for_attention(b: Binding, topk: TopkBuffer) -> TopkBuffer:
        to = b.selection.topk_convert_to
        return topk if to is None else topk.to_layout(to, contiguous=True)

    def explain(self) -> str:
        """The selection trace, readable: every candidate with its reasons."""
        return self._resolve().selection.explain()

    # -- the step -------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, index_q: torch.Tensor, caches: PagedKVCache,
                batch: BatchMetadata, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the indexer then the attention for one step; returns ``out[:T]``.

        ``out`` (optional) may have more rows than the step; only ``[0, T)`` is written.
        """
        target = self._resolve().target
        if out is None and isinstance(q, torch.Tensor):
            out = torch.empty_like(q, dtype=self.dtype)   # fp8 queries: the output is in the layer's dtype
        if _compiling():  # one opaque node for the step: nothing below is traced
            # the op admits its call at run time, held to this layer's promises (its target carries them)
            args, c, handle, st = batch_args(batch), caches, target.handle, target.topk.storage  # type: ignore[union-attr]
            blocks = (c.k_block_scale, c.v_block_scale, c.index_block_scale)     # NVFP4's, else None
            torch.ops.mm3.sparse_attention(q, index_q, c.k, c.v, c.index, st, *args, handle, out, c.k_scale,
                                           c.v_scale, *blocks)
            return out[:batch.num_tokens]  # type: ignore[index]
        target.run(_ENTRY, BOTH, caches, batch, target.topk, index_q, q, out)
        T = batch.facts.num_tokens     # run admitted the batch: a BatchMetadata
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
            t = self._resolve().target
            chosen = f"indexer={t.indexer.name!r}, attention={t.attention.name!r}"
        except Exception as e:  # repr must never raise
            chosen = f"unresolved: {e}"
        return f"SparseAttention({chosen}, heads={self.params.num_heads}/{self.params.num_kv_heads}, " \
               f"dtype={self.dtype}, device={self.device})"
