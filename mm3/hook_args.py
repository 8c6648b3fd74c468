"""The argument checks every backend's ``index_topk`` / ``attention_forward`` needs, in one place.

A hook can be called directly (``backend.index_topk(...)``), not only through
:class:`mm3.SparseAttention`, so each backend must check its arguments
itself. What is the same for every backend is checked here: argument types,
the block size and KV-head count that caches, batch and params must agree on,
one device for every input, per-token tensors with at least the step's rows,
and a top-k buffer of the right shape and capacity. A backend adds only what
is its own (dtypes, tile sizes, layouts, where it can run).

Shapes only, never tensor contents: no device synchronisation, so the check
costs microseconds and stays on inside CUDA graphs.

Example (a plugin's indexer hook)::

    from mm3.hook_args import check_hook_args

    def index_topk(index_q, caches, batch, params, out):
        T = check_hook_args("mybackend.index_topk", caches, batch, params, topk=out, rows={
            "index_q": (index_q, (params.num_index_heads, params.index_head_dim),
                        "= [num_tokens, num_index_heads, index_head_dim]")})
        ...
"""

from __future__ import annotations

from typing import Mapping

import torch

from mm3.batch import BatchMetadata
from mm3.buffers import PagedKVCache, TopkBuffer
from mm3.errors import InputError
from mm3.params import SparseAttentionParams

__all__ = ["check_hook_args", "RowSpec"]

#: ``(tensor, trailing shape, hint)``: the tensor must be ``[>= num_tokens, *trailing shape]``
RowSpec = tuple[torch.Tensor, tuple[int, ...], str]


def check_hook_args(where: str, caches: PagedKVCache, batch: BatchMetadata, params: SparseAttentionParams, *,
                    topk: TopkBuffer, rows: Mapping[str, RowSpec]) -> int:
    """Raise :class:`~mm3.errors.InputError` (prefixed with ``where``) for the first argument that does not fit.

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
                   f"backend.alloc_topk_buffer(...) or wrap a tensor: TopkBuffer(tensor, layout)")
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
