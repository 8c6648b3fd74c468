"""The scales of an fp8 K/V cache (docs/spec.md §1): checked once, kept as views of what was given.

An fp8 K or V cache (:data:`FP8_KV_DTYPES`: ``float8_e4m3fn`` or ``float8_e5m2``,
vLLM's ``fp8_e4m3`` and ``fp8_e5m2`` KV-cache dtypes) stores ``value / scale``; a
reader widens the stored value exactly and dequantizes with
``value = float(stored) * scale``. Three granularities:

* **per tensor**: a Python number, or a float32 tensor of shape ``[]`` or
  ``[1]`` (vLLM's ``k_scale``/``v_scale`` of a layer);
* **per KV head**: a float32 tensor ``[Hkv]``;
* **per (KV head, token slot)**: a float32 tensor ``[Hkv, num_pages * block_size]``
  (vLLM's per-token layout ``[num_kv_heads, num_slots]``): the scale of the
  token in slot ``s`` of page ``p`` is ``scale[h, p * block_size + s]``, whatever
  the page layout (NHD or HND).

The first two become one ``[Hkv]`` float32 tensor (:func:`kv_scale`; a per-tensor
scale is an ``expand`` view), the third stays ``[Hkv, num_slots]``. Either way the
result *shares memory* with a tensor it was given: an engine that recalibrates
its scales in place, or writes a slot's scale with the slot's K/V, keeps every
later step and a captured CUDA graph reading the new values.

Per-tensor and per-head scales are calibration constants: their values are
checked once (finite, positive). Per-slot scales are cache contents, written
with the K/V of their slot and read only where those are: like K/V, their
values are not checked.

Example:
    >>> import torch
    >>> kv_scale("k_scale", 0.5, num_kv_heads=2, num_slots=32, device=torch.device("cpu"))
    tensor([0.5000, 0.5000])
    >>> kv_scale("k_scale", torch.ones(2, 32), num_kv_heads=2, num_slots=32, device=torch.device("cpu")).shape
    torch.Size([2, 32])
    >>> kv_scale("k_scale", torch.tensor([1.0, -1.0]), num_kv_heads=2, num_slots=32, device=torch.device("cpu"))
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: k_scale must be finite and > 0 for every KV head (value = stored * scale), got [1.0, -1.0]
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from mm3.contract.errors import InputError

__all__ = ["FP8_KV_DTYPES", "ScaleLike", "kv_scale", "kv_scale_view", "check_kv_dtype", "cache_scales",
           "is_slot_scale", "dequantize"]

FP8_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The fp8 storage types of a K/V cache: e4m3 (vLLM's ``fp8``/``fp8_e4m3``: 3 mantissa bits, finite
up to 448) and e5m2 (vLLM's ``fp8_e5m2``: 2 mantissa bits, finite up to 57344, with infinities).
Both widen exactly to fp16, bf16 and fp32; a backend declares which it reads
(``BackendCapabilities.kv_cache_dtypes``). The fnuz variants are not K/V cache types."""

_FP8_NAMES = " or ".join(str(d) for d in FP8_KV_DTYPES)

ScaleLike = Union[float, torch.Tensor]


def is_slot_scale(scale: Optional[ScaleLike]) -> bool:
    """True for a per-(KV head, slot) scale as a cache holds it (``[Hkv, num_slots]``)."""
    return isinstance(scale, torch.Tensor) and scale.dim() == 2


def kv_scale_view(name: str, scale: object, *, num_kv_heads: int, num_slots: int,
                  device: torch.device) -> torch.Tensor:
    """``scale`` as ``[num_kv_heads]`` or ``[num_kv_heads, num_slots]`` float32 on ``device``, values not read.

    Type, dtype, device and shape are checked (:class:`InputError` naming ``name``);
    a number becomes a new tensor, a tensor stays (a view of) itself. No device
    synchronisation: what :func:`kv_scale` adds is the value check.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise InputError(f"{name} must be a positive number or a float32 tensor of shape [], [1], "
                         f"[{num_kv_heads}] (per KV head) or [{num_kv_heads}, {num_slots}] (per KV head and "
                         f"slot), got {type(scale).__name__}")
    if not isinstance(scale, torch.Tensor):
        return torch.full((num_kv_heads,), float(scale), dtype=torch.float32, device=device)
    if scale.dtype != torch.float32:
        raise InputError(f"{name} is {scale.dtype}; scales are float32 (pass {name}.float())")
    if scale.device != device:
        raise InputError(f"{name} is on {scale.device} but the K/V caches are on {device}; move it "
                         f"({name}.to(device))")
    shape = tuple(scale.shape)
    if shape in ((), (1,)):
        return scale.reshape(1).expand(num_kv_heads)
    if shape in ((num_kv_heads,), (num_kv_heads, num_slots)):
        return scale
    raise InputError(f"{name} has shape {shape}; use [] or [1] (one scale per tensor), [{num_kv_heads}] "
                     f"(one per KV head) or [{num_kv_heads}, {num_slots}] (one per KV head and token slot: "
                     f"num_pages * block_size slots, slot = page * block_size + offset)")


def kv_scale(name: str, scale: object, *, num_kv_heads: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """:func:`kv_scale_view`, then the values of a per-tensor or per-head scale checked (finite, > 0).

    Reads those values once (a device synchronisation when they live on a GPU):
    build a :class:`~mm3.contract.buffers.PagedKVCache` once per layer, not
    inside a captured graph. Per-slot scales are cache contents and are not read.
    """
    t = kv_scale_view(name, scale, num_kv_heads=num_kv_heads, num_slots=num_slots, device=device)
    if t.dim() == 1 and not bool((torch.isfinite(t) & (t > 0)).all()):
        raise InputError(f"{name} must be finite and > 0 for every KV head (value = stored * scale), got "
                         f"{t.tolist()}")
    return t


def dequantize(values: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``values`` (logical ``[num_pages, block_size, Hkv, D]``) times their scale, in ``values``' dtype.

    ``scale`` is a cache's ``[Hkv]`` or ``[Hkv, num_pages * block_size]`` scale, or
    ``None`` (returned as is). For references and tests: a full pass over the cache.
    """
    if scale is None:
        return values
    P, B, H, _ = values.shape
    if is_slot_scale(scale):
        return values * scale.to(values.dtype).view(H, P, B).permute(1, 2, 0).unsqueeze(-1)
    return values * scale.to(values.dtype).view(1, 1, H, 1)


def check_kv_dtype(dtype: torch.dtype, k_scale: Optional[object], v_scale: Optional[object]) -> bool:
    """True when K/V are scaled fp8 (:data:`FP8_KV_DTYPES`); :class:`InputError` for another 1-byte
    float, scales without fp8 or fp8 without scales."""
    fp8 = dtype in FP8_KV_DTYPES
    if dtype.is_floating_point and dtype.itemsize == 1 and not fp8:
        raise InputError(f"K/V cache dtype {dtype} unsupported; fp8 K/V caches are {_FP8_NAMES}")
    given = [n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None]
    if fp8 and len(given) != 2:
        raise InputError(f"{dtype} K/V caches need k_scale and v_scale (value = stored * scale; "
                         f"pass 1.0 for unscaled values)")
    if not fp8 and given:
        raise InputError(f"{' and '.join(given)} given for a {dtype} K/V cache; scales belong to fp8 "
                         f"({_FP8_NAMES}) caches only: drop them, or store K/V in fp8")
    return fp8


def cache_scales(k: torch.Tensor, k_scale: Optional[object],
                 v_scale: Optional[object]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The ``(k_scale, v_scale)`` a cache whose K is ``k`` (``[num_pages, block_size, Hkv, D]``) keeps.

    ``(None, None)`` for a cache that is not fp8, else both checked by :func:`kv_scale`;
    :class:`InputError` for scales on another dtype, fp8 without scales, or one scale per
    slot and the other not.
    """
    if not check_kv_dtype(k.dtype, k_scale, v_scale):
        return None, None
    P, B, H = k.shape[:3]
    ks, vs = (kv_scale(name, s, num_kv_heads=H, num_slots=P * B, device=k.device)
              for name, s in (("k_scale", k_scale), ("v_scale", v_scale)))
    if is_slot_scale(ks) != is_slot_scale(vs):
        raise InputError(f"k_scale {tuple(ks.shape)} and v_scale {tuple(vs.shape)}: scales per token slot "
                         f"([Hkv, num_slots]) must be given for both K and V, or for neither")
    return ks, vs
