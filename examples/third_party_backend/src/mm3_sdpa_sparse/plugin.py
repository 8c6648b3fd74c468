"""The ``torch_sdpa_sparse`` mm3 plugin: this module is the entry point's target.

mm3 imports it through the ``mm3.backends`` entry point in ``pyproject.toml``
and registers it with pluggy; the functions marked ``@hookimpl`` are the
backend. It provides only the attention: the indexer comes from another
backend (``cpu_ref``, ``cuda``...) and mm3 hands us its top-k buffer, converted
to dense token-major when that backend writes another layout.

Example:
    >>> from mm3.runtime.registry import Registry
    >>> import mm3_sdpa_sparse.plugin as plugin
    >>> be = Registry(plugins=[plugin], entry_points=False).get("torch_sdpa_sparse")
    >>> sorted(be.capabilities.ops), be.capabilities.topk_layout, be.probe("cpu").available
    (['attention'], 'token_major', True)
"""

from __future__ import annotations

import torch

from mm3.plugin import (BackendCapabilities, BatchMetadata, PagedKVCache, Probe, SparseAttentionParams,
                        TopkBuffer, hookimpl)

from .attention import attention_forward as _attention

__all__ = ["CAPABILITIES", "backend_capabilities", "backend_probe", "attention_forward"]

CAPABILITIES = BackendCapabilities(
    name="torch_sdpa_sparse",
    description="attention only: gathered blocks + torch scaled_dot_product_attention (fp32 accumulation)",
    # Above the reference (0): on 2 CPU cores it ran MiniMax-M3 TP8 mixed steps 1.2-3x faster
    # than cpu_ref's attention (see attention.py). Below the Triton GPU backends (100).
    priority=10,
    device_types=frozenset({"cpu", "cuda", "xpu"}),
    ops=frozenset({"attention"}),
    topk_layout="token_major",
    # attention_forward reads topk.storage as [T, H, K]: it needs that exact memory map.
    topk_requires_contiguous=True,
    kv_cache_layout="NHD",
    dtypes=frozenset({"bfloat16", "float16", "float32"}),
    # One code path for every token, so any number of draft tokens works.
    max_decode_query_len=64,
    cuda_graph_safe=False,
)


@hookimpl
def backend_capabilities() -> BackendCapabilities:
    """Static and cheap: mm3 calls it at discovery, before any device is touched."""
    return CAPABILITIES


@hookimpl
def backend_probe(device: torch.device) -> Probe:
    """Available wherever PyTorch itself can run on the device."""
    if device.type not in CAPABILITIES.device_types:
        return Probe.no(f"torch_sdpa_sparse runs on {sorted(CAPABILITIES.device_types)} tensors, "
                        f"not {device.type!r}")
    if device.type != "cpu":
        # is_available() asks the driver how many devices exist; it creates no context.
        accel = getattr(torch, device.type, None)
        if accel is None or not accel.is_available():
            return Probe.no(f"PyTorch sees no {device.type} device")
    return Probe.yes(f"torch {torch.__version__.split('+')[0]} scaled_dot_product_attention")


@hookimpl
def attention_forward(q: torch.Tensor, caches: PagedKVCache, topk: TopkBuffer, batch: BatchMetadata,
                      params: SparseAttentionParams, out: torch.Tensor) -> None:
    """docs/spec.md §4 for the step's tokens; see :func:`mm3_sdpa_sparse.attention.attention_forward`."""
    _attention(q, caches, topk, batch, params, out)
