"""The scales of an fp8 K/V cache (docs/spec.md §1): checked once, kept as one ``[Hkv]`` view each.

An fp8 (``float8_e4m3fn``) K or V cache stores ``value / scale``; a reader
dequantizes with ``value = float(stored) * scale[h]``, ``h`` the KV head. A
scale is per tensor (a Python number, or a float32 tensor of shape ``[]`` or
``[1]``, as vLLM's ``k_scale``/``v_scale``) or per KV head (a float32 tensor
``[Hkv]``). Either way :func:`kv_head_scale` returns an ``[Hkv]`` float32
tensor that *shares memory* with a tensor it was given (a per-tensor scale is
an ``expand`` view): an engine that recalibrates its scales in place keeps
every later step, and a captured CUDA graph, reading the new values.

Example:
    >>> import torch
    >>> kv_head_scale("k_scale", 0.5, num_kv_heads=2, device=torch.device("cpu"))
    tensor([0.5000, 0.5000])
    >>> kv_head_scale("k_scale", torch.tensor([1.0, -1.0]), num_kv_heads=2, device=torch.device("cpu"))
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: k_scale must be finite and > 0 for every KV head (value = stored * scale), got [1.0, -1.0]
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from mm3.contract.errors import InputError

__all__ = ["FP8_KV_DTYPE", "ScaleLike", "kv_head_scale", "check_kv_dtype"]

FP8_KV_DTYPE = torch.float8_e4m3fn
"""The one fp8 storage type of a K/V cache (e4m3: vLLM's ``fp8``/``fp8_e4m3`` KV-cache dtype)."""

ScaleLike = Union[float, torch.Tensor]


def kv_head_scale(name: str, scale: object, *, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """``scale`` as an ``[num_kv_heads]`` float32 tensor on ``device``; :class:`InputError` if it is bad.

    Reads the values once (a device synchronisation when they live on a GPU):
    build a :class:`~mm3.contract.buffers.PagedKVCache` once per layer, not
    inside a captured graph.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise InputError(f"{name} must be a positive number or a float32 tensor of shape [], [1] or "
                         f"[{num_kv_heads}] (per KV head), got {type(scale).__name__}")
    if not isinstance(scale, torch.Tensor):
        t = torch.full((num_kv_heads,), float(scale), dtype=torch.float32, device=device)
    else:
        if scale.dtype != torch.float32:
            raise InputError(f"{name} is {scale.dtype}; scales are float32 (pass {name}.float())")
        if scale.device != device:
            raise InputError(f"{name} is on {scale.device} but the K/V caches are on {device}; move it "
                             f"({name}.to(device))")
        if scale.dim() == 0 or tuple(scale.shape) == (1,):
            t = scale.reshape(1).expand(num_kv_heads)
        elif tuple(scale.shape) == (num_kv_heads,):
            t = scale
        else:
            raise InputError(f"{name} has shape {tuple(scale.shape)}; use [] or [1] (one scale per tensor) "
                             f"or [{num_kv_heads}] (one per KV head)")
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise InputError(f"{name} must be finite and > 0 for every KV head (value = stored * scale), got "
                         f"{t.tolist()}")
    return t


def check_kv_dtype(dtype: torch.dtype, k_scale: Optional[object], v_scale: Optional[object]) -> bool:
    """True when K/V are scaled fp8; :class:`InputError` for scales without fp8 or fp8 without scales."""
    fp8 = dtype == FP8_KV_DTYPE
    if dtype.is_floating_point and dtype.itemsize == 1 and not fp8:
        raise InputError(f"K/V cache dtype {dtype} unsupported; fp8 K/V caches are {FP8_KV_DTYPE}")
    given = [n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None]
    if fp8 and len(given) != 2:
        raise InputError(f"{FP8_KV_DTYPE} K/V caches need k_scale and v_scale (value = stored * scale; "
                         f"pass 1.0 for unscaled values)")
    if not fp8 and given:
        raise InputError(f"{' and '.join(given)} given for a {dtype} K/V cache; scales belong to "
                         f"{FP8_KV_DTYPE} caches only: drop them, or store K/V in fp8")
    return fp8
