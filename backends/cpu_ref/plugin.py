"""The ``cpu_ref`` plugin: mm3's reference backend and fallback everywhere.

Plain vectorized PyTorch, so it runs on any device torch supports (it is
tested on CPU tensors and meant to work unchanged on GPU tensors). It declares
head-major top-k buffers but reads and writes any layout through
``TopkBuffer.head_major()``. Priority 0: every faster backend that can serve
a request is picked before it.

Example:
    >>> from mm3.testing.helpers import RegistryFactory
    >>> import mm3_backends.cpu_ref.plugin as cpu_ref
    >>> be = RegistryFactory()(cpu_ref).get("cpu_ref")
    >>> be.capabilities.topk_layout, be.probe("cpu").available
    ('head_major', True)
"""

from __future__ import annotations

import torch

from mm3.plugin import (BackendCapabilities, BatchMetadata, PagedKVCache, Probe, SparseAttentionParams,
                        TopkBuffer, hookimpl)

from .attention import attention_forward as _attention
from .indexer import index_scores as _index_scores
from .indexer import index_topk as _index_topk

__all__ = ["CAPABILITIES", "backend_capabilities", "backend_probe", "alloc_topk_buffer",
           "index_topk", "attention_forward", "index_scores"]

CAPABILITIES = BackendCapabilities(
    name="cpu_ref",
    description="reference: vectorized PyTorch, fp32 accumulation, any device (slow but exact)",
    priority=0,
    device_types=frozenset({"cpu", "cuda"}),
    ops=frozenset({"index_topk", "attention", "index_scores"}),
    topk_layout="head_major",
    topk_requires_contiguous=False,
    kv_cache_layout="NHD",
    dtypes=frozenset({"bfloat16", "float16", "float32"}),
    index_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "float8_e4m3fn", "nvfp4"}),
    kv_cache_dtypes=frozenset({"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2",
                               "float8_e4m3fn_unscaled", "nvfp4"}),
    query_dtypes=frozenset({"float8_e4m3fn"}),
    kv_slot_scales=True,
    addressings=frozenset({"pages", "slots"}),
    max_decode_query_len=16,
    cuda_graph_safe=False,
)


@hookimpl
def backend_capabilities() -> BackendCapabilities:
    return CAPABILITIES


@hookimpl
def backend_probe(device: torch.device) -> Probe:
    if device.type not in CAPABILITIES.device_types:
        return Probe.no(f"cpu_ref runs on {sorted(CAPABILITIES.device_types)} tensors, not {device.type!r}")
    return Probe.yes("plain PyTorch: always available")


@hookimpl
def alloc_topk_buffer(num_tokens: int, num_heads: int, topk: int, device: torch.device) -> TopkBuffer:
    return TopkBuffer.allocate(num_tokens, num_heads, topk, layout=CAPABILITIES.topk_layout, device=device)


@hookimpl
def index_topk(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
               params: SparseAttentionParams, out: TopkBuffer) -> None:
    _index_topk(index_q, caches, batch, params, out)


@hookimpl
def attention_forward(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                      params: SparseAttentionParams, out: torch.Tensor) -> None:
    _attention(q, caches, topk, batch, params, out)


@hookimpl
def index_scores(index_q: torch.Tensor, caches: PagedKVCache, batch: BatchMetadata,
                 params: SparseAttentionParams, out: torch.Tensor) -> None:
    _index_scores(index_q, caches, batch, params, out)
