"""The argument checks of a step: shapes, dtypes and devices, never tensor contents.

Two callers, two sets of checks:

* :func:`check_layer_args` and :func:`check_step_inputs` are the layer's:
  what :class:`~mm3.SparseAttention` promises about its construction and each
  step's inputs;
* :func:`check_index_args` / :func:`check_attention_args`,
  :func:`check_declared` and :func:`check_topk_accepted` are every check of
  one hook call, run once by the bound backend (:class:`~mm3.runtime.backend.Backend`) before
  the plugin's hook: :func:`check_hook_args` (what every backend needs:
  argument types, the block size and KV-head count that caches, batch and
  params must agree on, one device for every input, per-token tensors with
  at least the step's rows, a top-k buffer of the right shape and capacity),
  the op's own shapes and dtypes, then the limits the backend's capabilities
  declare. A plugin checks only what is its own.

Everything here reads shapes, dtypes and devices only: no device
synchronisation, so it stays on in production (and inside CUDA graphs).
Checks that need the data (block ids in range) run where the batch is built
(:meth:`mm3.BatchMetadata.build` with ``num_pages``).

Example:
    >>> import mm3
    >>> from mm3.testing.factories import make_case
    >>> p = mm3.SparseAttentionParams(num_heads=2, num_kv_heads=1, head_dim=16,
    ...     num_index_heads=1, index_head_dim=16, block_size=16, topk=4)
    >>> case = make_case(p, decodes=[40], dtype="float32")
    >>> check_index_args("mine.index_topk", case.index_q, case.caches, case.batch, p,
    ...                  mm3.TopkBuffer.allocate(1, 1, 4))
    1
    >>> caps = BackendCapabilities(name="mine", ops={"index_topk"}, device_types={"cpu"},
    ...     topk_layout="head_major", block_sizes={128})
    >>> check_declared("mine.index_topk", caps, "index_topk", device_type="cpu", dtype=case.q.dtype,
    ...                index_dtype=case.caches.index_dtype, params=p, decode_query_len=1)
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: mine.index_topk: block_size 16 not in [128]: outside what backend 'mine' declares; choose another backend or change the input
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.buffers import PagedKVCache, TopkBuffer, dtype_name
from mm3.contract.capabilities import BackendCapabilities, Requirements
from mm3.contract.errors import InputError
from mm3.contract.hookspecs import Op
from mm3.contract.params import SparseAttentionParams

__all__ = ["check_step_inputs", "check_layer_args", "check_hook_args", "check_index_args",
           "check_attention_args", "check_declared", "check_topk_accepted", "RowSpec"]

#: ``(tensor, trailing shape, hint)``: the tensor must be ``[>= num_tokens, *trailing shape]``
RowSpec = tuple[torch.Tensor, tuple[int, ...], str]


def check_layer_args(device: object, max_decode_query_len: object) -> torch.device:
    """Check a layer's construction arguments; returns ``torch.device(device)``.

    The device must parse and be usable in this process (a zero-size
    allocation on it succeeds): otherwise torch's own assertion would surface
    from deep inside the first buffer allocation.
    """
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as e:
        raise InputError(f"device {device!r} is not a torch device: {e}") from None
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, TypeError) as e:
        raise InputError(f"device {str(dev)!r} cannot be used in this process ({type(e).__name__}: {e}); "
                         f"pick a device this PyTorch build and machine provide") from None
    if not isinstance(max_decode_query_len, int) or isinstance(max_decode_query_len, bool) \
            or max_decode_query_len < 1:
        raise InputError(f"max_decode_query_len must be an int >= 1 (1, or 1 + draft tokens), got "
                         f"{max_decode_query_len!r}")
    return dev


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (e.g. an ``expand``-ed tensor).

    Sufficient test: with axes sorted by stride, each stride must step over
    the whole extent of the smaller ones.
    """
    extent = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < extent:
            return True
        extent = stride * size
    return False


def _shape(name: str, t: object, expected: tuple[int, ...], hint: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != expected:
        raise InputError(f"{name} has shape {tuple(t.shape)}, expected {expected} {hint}")


def check_step_inputs(params: SparseAttentionParams, q: torch.Tensor, index_q: torch.Tensor,
                      caches: PagedKVCache, batch: BatchMetadata, out: Optional[torch.Tensor], *,
                      dtype: torch.dtype, index_dtype: torch.dtype, device: torch.device,
                      capacity: int, max_decode_query_len: int,
                      kv_dtype: Optional[torch.dtype] = None) -> None:
    """Raise :class:`InputError` naming the first input that does not fit the layer.

    Only the layer's own promises: ``q`` and ``index_q`` of exactly the step's
    tokens, the dtypes and device the layer was built for, its capacity and
    decode query length, a usable ``out``. What every hook call needs (caches,
    batch and params agreeing, the backend's declared limits) the bound
    backend checks when each hook is called (:func:`check_index_args`,
    :func:`check_attention_args`).
    """
    if not isinstance(caches, PagedKVCache):
        raise InputError(f"caches must be an mm3.PagedKVCache, got {type(caches).__name__}; wrap your "
                         f"tensors: PagedKVCache(k=..., v=..., index=...)")
    if not isinstance(batch, BatchMetadata):
        raise InputError(f"batch must be an mm3.BatchMetadata (BatchMetadata.build(...)), "
                         f"got {type(batch).__name__}")
    if caches.slot_scaled:
        # selection knows nothing of them here: a backend that reads [Hkv] scales would misread them
        raise InputError("caches hold K/V scales per token slot ([Hkv, num_slots]), which SparseAttention does "
                         "not select backends for: call the bound backend of one that declares kv_slot_scales "
                         "(mm3 backends), or use mm3.integrations.vllm, whose selection requires them")
    T = batch.num_tokens
    p = params
    _shape("q", q, (T, p.num_heads, p.head_dim), "= [num_tokens, num_heads, head_dim]")
    _shape("index_q", index_q, (T, p.num_index_heads, p.index_head_dim),
           "= [num_tokens, num_index_heads, index_head_dim]")
    for name, t, want in (("q", q, dtype), ("index_q", index_q, dtype),
                          ("k/v cache", caches.k, kv_dtype or dtype), ("index cache", caches.index, index_dtype)):
        if t.dtype != want:
            raise InputError(f"{name} is {t.dtype} but this layer was built for {want}; cast it, or "
                             f"build the layer with the matching dtype/kv_dtype/index_dtype")
    for name, t in (("q", q), ("index_q", index_q), ("caches", caches.k), ("batch", batch.seq_lens)):
        if t.device.type != device.type or (device.index is not None and t.device != device):
            raise InputError(f"{name} is on {t.device} but the layer runs on {device}; move it with .to()")
    if T > capacity:
        raise InputError(f"step has {T} tokens but the top-k buffer holds {capacity}; build the layer "
                         f"with max_num_tokens >= {T}")
    if batch.num_decodes and batch.decode_query_len > max_decode_query_len:
        raise InputError(f"decode query length {batch.decode_query_len} exceeds the layer's "
                         f"max_decode_query_len {max_decode_query_len}; if the first "
                         f"num_decodes={batch.num_decodes} requests are decodes with draft tokens, build "
                         f"the layer with a larger one; if one of them is a prefill, the batch is not "
                         f"decode-first: put every decode before the first prefill (is_decode= checks "
                         f"the order)")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise InputError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dim() != 3 or out.shape[0] < T or tuple(out.shape[1:]) != (p.num_heads, p.head_dim):
            raise InputError(f"out has shape {tuple(out.shape)}; needs [>= {T}, {p.num_heads}, "
                             f"{p.head_dim}]")
        if out.dtype != dtype or out.device != q.device:
            raise InputError(f"out is {out.dtype} on {out.device}; needs {dtype} on {q.device}")
        if _overlaps_itself(out[:T]):
            raise InputError(f"out has strides {tuple(out.stride())} for shape {tuple(out.shape)}: several "
                             f"of its elements share memory (an expand()-ed or as_strided tensor), so "
                             f"writes would collide; pass a tensor with its own memory per element")


def check_hook_args(where: str, caches: PagedKVCache, batch: BatchMetadata, params: SparseAttentionParams, *,
                    topk: TopkBuffer, rows: Mapping[str, RowSpec]) -> int:
    """Raise :class:`~mm3.contract.errors.InputError` (prefixed with ``where``) for the first argument that does not fit.

    ``rows`` names the hook's per-token tensors (``q``, ``out``, ``index_q``)
    with the trailing shape each must have. Returns the step's token count.
    """
    def fail(msg: str) -> InputError:
        return InputError(f"{where}: {msg}")

    if not isinstance(caches, PagedKVCache):
        raise fail(f"caches must be an mm3.PagedKVCache, got {type(caches).__name__}; wrap the tensors: "
                   f"PagedKVCache(k=..., v=..., index=...)")
    if not isinstance(batch, BatchMetadata):
        raise fail(f"batch must be an mm3.BatchMetadata (BatchMetadata.build(...)), got {type(batch).__name__}")
    if not isinstance(topk, TopkBuffer):
        raise fail(f"the top-k buffer must be an mm3.TopkBuffer, got {type(topk).__name__}; allocate it with "
                   f"backend.alloc_topk_buffer(...) or wrap the logical [H, T, K] view of your memory: TopkBuffer(view)")
    if not caches.block_size == batch.block_size == params.block_size:
        raise fail(f"block sizes disagree: cache pages hold {caches.block_size} tokens, batch.block_size="
                   f"{batch.block_size}, params.block_size={params.block_size}; the sparse block is the KV "
                   f"page, make them equal")
    if caches.num_kv_heads != params.num_kv_heads:
        raise fail(f"caches have {caches.num_kv_heads} KV heads, params.num_kv_heads is {params.num_kv_heads}")
    dev = caches.device
    T = batch.num_tokens
    for name, (t, tail, hint) in rows.items():
        if not isinstance(t, torch.Tensor):
            raise fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 + len(tail) or tuple(t.shape[1:]) != tuple(tail) or t.shape[0] < T:
            raise fail(f"{name} has shape {tuple(t.shape)}, expected [{T}, {', '.join(map(str, tail))}] {hint}")
    placed = {name: spec[0] for name, spec in rows.items()}
    placed.update({"batch.block_table": batch.block_table, "batch.query_start_loc": batch.query_start_loc,
                   "batch.token_positions": batch.token_positions, "the top-k buffer": topk.storage})
    for name, t in placed.items():
        if t.device != dev:
            raise fail(f"{name} is on {t.device} but the caches are on {dev}; move every input of the step "
                       f"to one device (tensor.to(device), batch.to(device))")
    if (topk.num_heads, topk.topk) != (params.num_kv_heads, params.topk):
        raise fail(f"the top-k buffer is [H={topk.num_heads}, K={topk.topk}] but params need "
                   f"[H={params.num_kv_heads}, K={params.topk}] (num_kv_heads, topk)")
    if topk.num_tokens < T:
        raise fail(f"the top-k buffer holds {topk.num_tokens} rows but the step has {T} tokens; pass "
                   f"buffer.rows(0, T) of a buffer sized for the most tokens per step")
    return T


def check_index_args(where: str, index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                     params: SparseAttentionParams, out: TopkBuffer) -> int:
    """The arguments of one ``index_topk`` call; returns the step's tokens.

    :func:`check_hook_args`, then the index keys' size. The bound backend runs
    it, and :func:`check_declared` with its capabilities, before the hook.
    """
    T = check_hook_args(where, caches, batch, params, topk=out, rows={
        "index_q": (index_q, (params.num_index_heads, params.index_head_dim),
                    "= [num_tokens, num_index_heads, index_head_dim]")})
    if caches.index_head_dim != params.index_head_dim:
        raise InputError(f"{where}: index cache keys have dim {caches.index_head_dim}, params.index_head_dim "
                         f"is {params.index_head_dim}")
    return T


def check_attention_args(where: str, q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer,
                         batch: BatchMetadata, params: SparseAttentionParams, out: torch.Tensor) -> int:
    """The arguments of one ``attention_forward`` call; returns the step's tokens.

    :func:`check_hook_args`, the KV heads' size, then one dtype for ``q``, the
    KV cache and ``out``. The bound backend runs it, and :func:`check_declared`
    with its capabilities, before the hook.
    """
    hint = "= [num_tokens, num_heads, head_dim]"
    shape = (params.num_heads, params.head_dim)
    T = check_hook_args(where, caches, batch, params, topk=topk, rows={"q": (q, shape, hint),
                                                                       "out": (out, shape, hint)})
    if caches.head_dim != params.head_dim:
        raise InputError(f"{where}: KV cache heads have dim {caches.head_dim}, params.head_dim is "
                         f"{params.head_dim}")
    if caches.dtype != q.dtype and not caches.kv_scaled:
        raise InputError(f"{where}: KV cache dtype {caches.dtype} differs from q's {q.dtype}; cast one of them, "
                         f"or store K/V in fp8 (float8_e4m3fn, float8_e5m2) with k_scale/v_scale")
    if out.dtype != q.dtype:
        raise InputError(f"{where}: out dtype {out.dtype} differs from q's {q.dtype}; the output is in q's dtype")
    return T


def check_declared(where: str, caps: BackendCapabilities, op: Op, *, device_type: str, dtype: torch.dtype,
                   index_dtype: torch.dtype, params: SparseAttentionParams, decode_query_len: int,
                   kv_dtype: Optional[torch.dtype] = None, kv_slot_scales: bool = False) -> None:
    """Raise :class:`InputError` when a call lies outside what ``caps`` declares for ``op``.

    ``kv_slot_scales``: the caches' scales are per token slot (``PagedKVCache.slot_scaled``).

    The rule is the one selection applies to a request
    (:meth:`~mm3.contract.capabilities.BackendCapabilities.unmet`); the limits
    are written once, in the capabilities.
    """
    # model_construct: these values come from tensors, not users; a dtype no backend
    # declares must reach unmet() and be named there, not fail validation here.
    req = Requirements.model_construct(
        device_type=device_type, ops=frozenset({op}), dtype=dtype_name(dtype),
        index_cache_dtype=dtype_name(index_dtype), kv_cache_dtype=dtype_name(kv_dtype or dtype),
        head_dim=params.head_dim,
        index_head_dim=params.index_head_dim, block_size=params.block_size, topk=params.topk,
        gqa_group=params.gqa_group, decode_query_len=decode_query_len, kv_slot_scales=kv_slot_scales)
    reasons = caps.unmet(req)
    if reasons:
        raise InputError(f"{where}: {'; '.join(reasons)}: outside what backend {caps.name!r} declares; "
                         f"choose another backend or change the input")


def check_topk_accepted(where: str, caps: BackendCapabilities, topk: TopkBuffer) -> None:
    """Raise :class:`InputError` unless a backend declaring ``caps`` can use ``topk`` as it is."""
    if not caps.accepts_topk(topk.layout, topk.is_dense()):
        raise InputError(f"{where}: needs a dense {caps.topk_layout} top-k buffer (it declares "
                         f"topk_requires_contiguous), got {topk!r}; convert it first: "
                         f"buf.to_layout({caps.topk_layout!r}) (SparseAttention does this for you)")
