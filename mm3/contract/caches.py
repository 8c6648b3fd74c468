"""The paged key, value and index-key caches of one layer, and what they hold (docs/spec.md §1-2).

:mod:`mm3.contract.buffers` exports :class:`PagedKVCache` too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union, cast

import torch

from mm3.contract.capabilities import KVCacheLayout
from mm3.contract.errors import InputError
from mm3.contract.facts import CacheFacts, cache_facts
from mm3.contract.kv_scales import FP8_KV_DTYPES, ScaleLike, cache_scales, dequantize, is_slot_scale
from mm3.contract.quant import (
    FP8_UNSCALED, NVFP4, NVFP4_GROUP, check_nvfp4, dequantize_nvfp4, index_format_of, logical_dim, resolve_kv_format,
)

__all__ = ["PagedKVCache"]


@dataclass(frozen=True)
class PagedKVCache:
    """The paged key, value and index-key caches of one layer.

    Logical shapes: ``k``/``v`` = ``[num_pages, block_size, Hkv, D]`` and
    ``index`` = ``[num_pages, block_size, Di]``. The storage may be any strided
    view of that shape; :meth:`allocate` with ``layout="HND"`` stores each page
    heads-first and returns the permuted (logical) view. Kernels index through
    the tensors' strides, so both layouts work without copies.

    K and V may be stored in fp8, ``float8_e4m3fn`` or ``float8_e5m2``, with ``k_scale`` and
    ``v_scale`` (docs/spec.md §1): ``value = float(stored) * scale``. A scale
    is per tensor (a number, or a float32 tensor ``[]``/``[1]``), per KV head
    (``[Hkv]``) or per KV head and token slot (``[Hkv, num_pages * block_size]``,
    :attr:`slot_scaled`); after construction the first two are ``[Hkv]`` float32
    views of what was given (:mod:`~mm3.contract.kv_scales`), and building the
    cache reads their values once to check them.

    Two more formats (:mod:`~mm3.contract.quant`) are named by :attr:`kv_format`: e4m3 K/V without
    a scale (``kv_format="float8_e4m3fn_unscaled"``, said when built: an fp8 cache without scales
    is otherwise an error), and NVFP4 (``k``/``v`` uint8 ``[num_pages, block_size, Hkv, D/2]``
    with ``k_block_scale``/``v_block_scale`` e4m3 ``[num_pages, block_size, Hkv, D/16]``). An
    NVFP4 index cache is uint8 ``[num_pages, block_size, Di/2]`` with ``index_block_scale``
    ``[num_pages, block_size, Di/16]``. :attr:`head_dim` and :attr:`index_head_dim` are the
    logical dims; building the cache reads the block scales once (finite, >= 0).

    Example:
        >>> c = PagedKVCache.allocate(num_pages=4, block_size=16, num_kv_heads=2,
        ...                           head_dim=8, index_head_dim=8, layout="HND")
        >>> c.k.shape, c.kv_layout
        (torch.Size([4, 16, 2, 8]), 'HND')
        >>> f8 = PagedKVCache.allocate(4, 16, 2, 8, 8, dtype=torch.float8_e4m3fn, k_scale=0.25,
        ...                            v_scale=torch.tensor([0.5, 2.0]))
        >>> f8.kv_scaled, f8.k_scale.tolist(), f8.v_scale.tolist()
        (True, [0.25, 0.25], [0.5, 2.0])
        >>> q4 = PagedKVCache.allocate(4, 16, 2, 32, 32, kv_format="nvfp4", index_format="nvfp4")
        >>> q4.kv_format, q4.k.shape, q4.k_block_scale.shape, q4.head_dim, q4.index_format
        ('nvfp4', torch.Size([4, 16, 2, 16]), torch.Size([4, 16, 2, 2]), 32, 'nvfp4')
    """

    k: torch.Tensor
    v: torch.Tensor
    index: torch.Tensor
    k_scale: Optional[ScaleLike] = None
    v_scale: Optional[ScaleLike] = None
    #: what K/V hold (mm3.contract.quant.KV_FORMATS); ``None`` when built: read from the tensors
    kv_format: Optional[str] = field(default=None, kw_only=True)
    #: NVFP4's e4m3 scales, one per 16 head-dim elements (``None`` for every other format)
    k_block_scale: Optional[torch.Tensor] = field(default=None, kw_only=True)
    v_block_scale: Optional[torch.Tensor] = field(default=None, kw_only=True)
    index_block_scale: Optional[torch.Tensor] = field(default=None, kw_only=True)
    #: the five tensors' shapes, dtypes and devices, worked out when built: what a step reads
    facts: CacheFacts = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("k", "v"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise InputError(f"{name} cache must be a 4-D tensor [num_pages, block_size, Hkv, D], "
                                 f"got {getattr(t, 'shape', type(t).__name__)}")
        if self.k.shape != self.v.shape:
            raise InputError(f"k cache {tuple(self.k.shape)} and v cache {tuple(self.v.shape)} differ in shape")
        if self.k.dtype != self.v.dtype:
            raise InputError(f"k cache ({self.k.dtype}) and v cache ({self.v.dtype}) differ in dtype")
        if not isinstance(self.index, torch.Tensor) or self.index.dim() != 3:
            raise InputError("index cache must be a 3-D tensor [num_pages, block_size, Di], got "
                             f"{getattr(self.index, 'shape', type(self.index).__name__)}")
        if tuple(self.index.shape[:2]) != tuple(self.k.shape[:2]):
            raise InputError(f"index cache pages/block {tuple(self.index.shape[:2])} do not match the "
                             f"KV cache's {tuple(self.k.shape[:2])}")
        devs = {self.k.device, self.v.device, self.index.device}
        if len(devs) != 1:
            raise InputError(f"caches live on different devices: {sorted(map(str, devs))}")
        if self.index.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8):
            raise InputError(f"index cache dtype {self.index.dtype} unsupported; use bfloat16, float8_e4m3fn or "
                             f"NVFP4 (uint8 with index_block_scale) (float16/float32 accepted by the reference)")
        if self.index.dtype == torch.uint8:
            check_nvfp4("index cache", self.index, self.index_block_scale, "index_block_scale")
        elif self.index_block_scale is not None:
            raise InputError(f"index_block_scale given for a {self.index.dtype} index cache; it belongs to an "
                             f"NVFP4 (uint8) index cache only")
        fmt = resolve_kv_format(self.k, self.kv_format, (self.k_scale, self.v_scale),
                                (self.k_block_scale, self.v_block_scale))
        ks, vs = cache_scales(self.k, self.k_scale, self.v_scale) if fmt not in (NVFP4, FP8_UNSCALED) else (None, None)
        for name, value in (("k_scale", ks), ("v_scale", vs), ("kv_format", fmt), ("facts", cache_facts(
                self.k, self.v, self.index, ks, vs, self.k_block_scale, self.v_block_scale, self.index_block_scale))):
            object.__setattr__(self, name, value)

    @classmethod
    def rewrap(cls, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
               k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None, *,
               k_block_scale: Optional[torch.Tensor] = None, v_block_scale: Optional[torch.Tensor] = None,
               index_block_scale: Optional[torch.Tensor] = None) -> "PagedKVCache":
        """The cache again from the tensors of one already built and checked: no checks, no device read.

        For boundaries that can pass tensors only (``torch.ops.mm3.*``): the
        scales are the ``[Hkv]`` views a checked cache holds, so reading their
        values again (a device synchronisation, refused inside a captured
        graph) would only repeat the check made when the cache was built.

        Example:
            >>> c = PagedKVCache.allocate(4, 16, 2, 8, 8, dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0)
            >>> r = PagedKVCache.rewrap(c.k, c.v, c.index, c.k_scale, c.v_scale)
            >>> r.kv_scaled, r.k_scale.data_ptr() == c.k_scale.data_ptr()
            (True, True)
        """
        cache = object.__new__(cls)
        facts = cache_facts(k, v, index, k_scale, v_scale, k_block_scale, v_block_scale, index_block_scale)
        # the fields set directly, item by item (frozen: no __setattr__): the custom ops and drop-ins rewrap
        # their caches every call
        d = cache.__dict__
        d["k"] = k
        d["v"] = v
        d["index"] = index
        d["k_scale"] = k_scale
        d["v_scale"] = v_scale
        d["k_block_scale"] = k_block_scale
        d["v_block_scale"] = v_block_scale
        d["index_block_scale"] = index_block_scale
        d["kv_format"] = facts.kv_format
        d["facts"] = facts
        return cache

    @classmethod
    def allocate(cls, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
                 index_head_dim: int, dtype: torch.dtype = torch.bfloat16,
                 index_dtype: torch.dtype = torch.bfloat16, layout: str = "NHD",
                 device: Union[str, torch.device, None] = None, k_scale: Optional[ScaleLike] = None,
                 v_scale: Optional[ScaleLike] = None, *, kv_format: Optional[str] = None,
                 index_format: Optional[str] = None) -> "PagedKVCache":
        """Uninitialised caches (``torch.empty``) in the given page layout.

        An fp8 ``dtype`` takes ``k_scale``/``v_scale`` (default 1.0 each). ``kv_format``:
        ``"float8_e4m3fn_unscaled"`` (e4m3 K/V, no scales) or ``"nvfp4"`` (packed K/V and their
        block scales, which start at zero); ``index_format="nvfp4"``: an NVFP4 index cache. The
        dims are the logical ones (multiples of 16 for NVFP4).
        """
        if layout not in ("NHD", "HND"):
            raise InputError(f"unknown KV cache layout {layout!r}; use 'NHD' or 'HND'")
        for name, fmt, dim in (("head_dim", kv_format, head_dim), ("index_head_dim", index_format, index_head_dim)):
            if fmt == NVFP4 and (not isinstance(dim, int) or dim % NVFP4_GROUP):
                raise InputError(f"{name} {dim!r}: NVFP4 needs a multiple of {NVFP4_GROUP} (two values per byte, "
                                 f"one e4m3 scale per {NVFP4_GROUP})")
        if kv_format in (NVFP4, FP8_UNSCALED):
            dtype = torch.uint8 if kv_format == NVFP4 else torch.float8_e4m3fn

        def kv(dim: int, dt: torch.dtype) -> torch.Tensor:
            if layout == "NHD":
                return torch.empty(num_pages, block_size, num_kv_heads, dim, dtype=dt, device=device)
            return torch.empty(num_pages, num_kv_heads, block_size, dim, dtype=dt, device=device).transpose(1, 2)

        def block_scale(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*t.shape[:-1], t.shape[-1] * 2 // NVFP4_GROUP, dtype=torch.float8_e4m3fn, device=device)

        Di = index_head_dim // 2 if index_format == NVFP4 else index_head_dim
        index = torch.empty(num_pages, block_size, Di, dtype=torch.uint8 if index_format == NVFP4 else index_dtype,
                            device=device)
        iscale = block_scale(index) if index_format == NVFP4 else None
        if kv_format == NVFP4:
            k, v = kv(head_dim // 2, dtype), kv(head_dim // 2, dtype)
            return cls(k, v, index, kv_format=NVFP4, k_block_scale=kv(head_dim // NVFP4_GROUP, torch.float8_e4m3fn).zero_(),
                       v_block_scale=kv(head_dim // NVFP4_GROUP, torch.float8_e4m3fn).zero_(), index_block_scale=iscale)
        if dtype in FP8_KV_DTYPES and kv_format != FP8_UNSCALED:
            k_scale = 1.0 if k_scale is None else k_scale
            v_scale = 1.0 if v_scale is None else v_scale
        return cls(kv(head_dim, dtype), kv(head_dim, dtype), index, k_scale, v_scale, kv_format=kv_format,
                   index_block_scale=iscale)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        """The logical head dim (NVFP4 stores ``head_dim / 2`` bytes per head)."""
        return logical_dim(self.k.shape[3], self.kv_format)  # type: ignore[arg-type]

    @property
    def index_head_dim(self) -> int:
        return logical_dim(self.index.shape[2], self.index_format)

    @property
    def index_format(self) -> str:
        """What the index cache holds: its dtype's name, or ``"nvfp4"``."""
        return index_format_of(self.index.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def kv_scaled(self) -> bool:
        """True for fp8 K/V with scales (``k_scale``/``v_scale`` are then float32 tensors)."""
        return self.k_scale is not None

    @property
    def slot_scaled(self) -> bool:
        """True when the scales are per KV head and token slot (``[Hkv, num_pages * block_size]``)."""
        return is_slot_scale(self.k_scale)

    @property
    def index_dtype(self) -> torch.dtype:
        return self.index.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def kv_layout(self) -> KVCacheLayout:
        """``"HND"`` when a page stores heads outermost (stride of H > stride of B), else ``"NHD"``."""
        return "HND" if self.k.stride(2) > self.k.stride(1) else "NHD"

    def to_layout(self, layout: Literal["NHD", "HND"]) -> "PagedKVCache":
        """A copy of the caches with pages stored in ``layout`` (same logical contents)."""
        quant = self.kv_format if self.kv_format in (NVFP4, FP8_UNSCALED) else None
        out = PagedKVCache.allocate(self.num_pages, self.block_size, self.num_kv_heads, self.head_dim,
                                    self.index_head_dim, self.dtype, self.index_dtype, layout, self.device,
                                    self.k_scale, self.v_scale, kv_format=quant,
                                    index_format=NVFP4 if self.index_format == NVFP4 else None)
        for name in ("k", "v", "index", "k_block_scale", "v_block_scale", "index_block_scale"):
            if getattr(self, name) is not None:
                getattr(out, name).copy_(getattr(self, name))
        return out

    def to(self, device: Union[str, torch.device]) -> "PagedKVCache":
        """These caches (and scales) on ``device``."""
        ks, vs, kb, vb, ib = (s.to(device) if isinstance(s, torch.Tensor) else s for s in (
            self.k_scale, self.v_scale, self.k_block_scale, self.v_block_scale, self.index_block_scale))
        return PagedKVCache(self.k.to(device), self.v.to(device), self.index.to(device), ks, vs,
                            kv_format=self.kv_format, k_block_scale=kb, v_block_scale=vb, index_block_scale=ib)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> "PagedKVCache":
        """K and V as ``dtype`` values, scales applied (``stored * scale[h]``; NVFP4: ``e2m1 * block scale``,
        exact); the index cache as it is, or as float32 values when it is NVFP4 (:meth:`index_values`).

        A full copy of K and V: for references and tests. Unscaled caches are
        simply cast.
        """
        if self.kv_format == NVFP4:
            k = dequantize_nvfp4(self.k, self.k_block_scale, dtype)  # type: ignore[arg-type]
            v = dequantize_nvfp4(self.v, self.v_block_scale, dtype)  # type: ignore[arg-type]
        else:
            k = dequantize(self.k.to(dtype), cast(Optional[torch.Tensor], self.k_scale))
            v = dequantize(self.v.to(dtype), cast(Optional[torch.Tensor], self.v_scale))
        return PagedKVCache(k, v, self.index_values() if self.index_format == NVFP4 else self.index)

    def index_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The index keys ``[num_pages, block_size, Di]`` as ``dtype`` values (NVFP4 dequantized, exactly)."""
        if self.index_block_scale is None:
            return self.index.to(dtype)
        return dequantize_nvfp4(self.index, self.index_block_scale, dtype)

