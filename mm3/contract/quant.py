"""The quantized formats of a step's caches and queries (docs/spec.md §1): names, rules, values.

Besides the attention dtypes and scaled fp8 (:mod:`~mm3.contract.kv_scales`), MiniMax-M3's
authors keep their caches in two more formats, and their queries in fp8:

* ``float8_e4m3fn_unscaled``: K/V stored as fp8 e4m3 **with no scale**: the value is the stored
  number, widened exactly. A cache says so when built (``kv_format=``), so an fp8 cache whose
  scales were forgotten is an error, not a misread;
* ``nvfp4``: K/V (or index keys) as packed e2m1 (uint8, two values per byte, the low nibble the
  even element: ``[..., D/2]``) with one e4m3 scale per 16 consecutive head-dim elements
  (``[..., D/16]``, linear, no global scale). Element ``i`` of a head is
  ``e2m1(i) * scale[i // 16]``, a product computed exactly (:func:`dequantize_nvfp4`);
* queries in fp8 e4m3 (no scale): the output dtype is then ``out``'s, not the query's.

Each is a name a backend declares (``BackendCapabilities.kv_cache_dtypes``, ``index_cache_dtypes``,
``query_dtypes``); selection passes over one that does not, and says why.

Example:
    >>> import torch
    >>> x = torch.tensor([[0.5, -1.0, 6.0, 0.0] * 4])
    >>> packed, scales = quantize_nvfp4(x)
    >>> packed.shape, scales.shape, scales.dtype
    (torch.Size([1, 8]), torch.Size([1, 1]), torch.float8_e4m3fn)
    >>> dequantize_nvfp4(packed, scales)[0, :4].tolist()
    [0.5, -1.0, 6.0, 0.0]
    >>> hex(int(packed[0, 0]))          # -1.0 (code 0xA) in the high nibble, 0.5 (code 0x1) in the low
    '0xa1'
"""

from __future__ import annotations

import functools

from typing import Optional, get_args

import torch

from mm3.contract.capabilities import KVDType
from mm3.contract.errors import InputError

__all__ = ["NVFP4", "FP8_UNSCALED", "NVFP4_GROUP", "E2M1_VALUES", "KV_FORMATS",
           "kv_format_of", "index_format_of", "resolve_kv_format", "check_nvfp4", "logical_dim",
           "unpack_e2m1", "dequantize_nvfp4", "quantize_nvfp4", "round_e4m3", "cache_fault"]

NVFP4 = "nvfp4"
FP8_UNSCALED = "float8_e4m3fn_unscaled"
NVFP4_GROUP = 16
"""Head-dim elements per NVFP4 scale."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the e2m1 codes 0-7; bit 3 of a nibble is the sign."""

KV_FORMATS: tuple[str, ...] = get_args(KVDType)
"""What a K/V cache can hold (the capability model's names): the attention dtypes, scaled fp8 (two formats),
unscaled e4m3, NVFP4."""

_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=None)    # a dtype's name is string work, and a custom op's call asks every time
def kv_format_of(k_dtype: torch.dtype, scaled: bool) -> str:
    """The format of K/V stored as ``k_dtype`` (``scaled``: with ``k_scale``/``v_scale``).

    uint8 is NVFP4 and unscaled e4m3 is :data:`FP8_UNSCALED` (a built cache has checked both).
    """
    if k_dtype == torch.uint8:
        return NVFP4
    if k_dtype == torch.float8_e4m3fn and not scaled:
        return FP8_UNSCALED
    return _name(k_dtype)


@functools.lru_cache(maxsize=None)
def index_format_of(index_dtype: torch.dtype) -> str:
    """The format of index keys stored as ``index_dtype`` (uint8: NVFP4)."""
    return NVFP4 if index_dtype == torch.uint8 else _name(index_dtype)


def logical_dim(stored: int, fmt: str) -> int:
    """The head dim of a format's last axis of ``stored`` elements (NVFP4 packs two per byte)."""
    return 2 * stored if fmt == NVFP4 else stored


def check_nvfp4(name: str, packed: torch.Tensor, scales: object, scale_name: str) -> None:
    """:class:`InputError` unless ``packed`` (uint8 ``[..., D/2]``) and ``scales`` (e4m3 ``[..., D/16]``)
    are an NVFP4 pair on one device, ``D`` a multiple of 16, every scale finite and >= 0.

    Reads the scales' values once (a device synchronisation): call it when a cache is built.
    """
    if packed.dtype != torch.uint8:
        raise InputError(f"{name} is {packed.dtype}; NVFP4 values are uint8, two e2m1 values per byte (low "
                         f"nibble = even element), [..., head_dim / 2]")
    if not isinstance(scales, torch.Tensor):
        raise InputError(f"NVFP4 {name} needs {scale_name}: float8_e4m3fn [..., head_dim / 16], one scale per "
                         f"16 head-dim elements; got {type(scales).__name__}")
    D = 2 * packed.shape[-1]
    if D % NVFP4_GROUP:
        raise InputError(f"{name} holds head_dim {D} ([..., {packed.shape[-1]}] bytes): NVFP4 needs a head_dim "
                         f"that is a multiple of {NVFP4_GROUP} (one e4m3 scale per {NVFP4_GROUP} elements)")
    if scales.dtype != torch.float8_e4m3fn:
        raise InputError(f"{scale_name} is {scales.dtype}; NVFP4 scales are float8_e4m3fn (pass "
                         f"{scale_name}.to(torch.float8_e4m3fn) if it holds e4m3 values)")
    want = (*packed.shape[:-1], D // NVFP4_GROUP)
    if tuple(scales.shape) != want:
        raise InputError(f"{scale_name} has shape {tuple(scales.shape)}; {name} {tuple(packed.shape)} (head_dim "
                         f"{D}) needs {want}: one e4m3 scale per {NVFP4_GROUP} head-dim elements")
    if scales.device != packed.device:
        raise InputError(f"{scale_name} is on {scales.device} but {name} is on {packed.device}")
    wide = scales.float()
    if bool((torch.isnan(wide) | (wide < 0)).any()):
        bad = wide[torch.isnan(wide) | (wide < 0)][:4].tolist()
        raise InputError(f"{scale_name} must be finite and >= 0 (value = e2m1 * scale); it holds {bad}")


def resolve_kv_format(k: torch.Tensor, kv_format: Optional[str], scales: tuple[object, object],
                      block_scales: tuple[object, object]) -> str:
    """The format of a cache's K/V as built: ``kv_format`` if given (checked against the tensors),
    else read from them; :class:`InputError` for every mismatch (values of NVFP4 scales included)."""
    if kv_format is not None and kv_format not in KV_FORMATS:
        raise InputError(f"kv_format {kv_format!r} unknown; use one of {list(KV_FORMATS)}")
    given = [n for n, s in zip(("k_block_scale", "v_block_scale"), block_scales) if s is not None]
    if k.dtype == torch.uint8 or kv_format == NVFP4:
        if kv_format not in (None, NVFP4) or k.dtype != torch.uint8:
            raise InputError(f"NVFP4 K/V are uint8 [num_pages, block_size, Hkv, head_dim / 2]; got {k.dtype} "
                             f"K/V with kv_format={kv_format!r}")
        if any(s is not None for s in scales):
            raise InputError("k_scale/v_scale given for NVFP4 K/V: NVFP4 has no global scale; its per-16 e4m3 "
                             "scales are k_block_scale and v_block_scale")
        for name, s in zip(("k", "v"), block_scales):
            check_nvfp4(f"{name} cache", k, s, f"{name}_block_scale")
        return NVFP4
    if given:
        raise InputError(f"{' and '.join(given)} given for a {k.dtype} K/V cache; block scales belong to NVFP4 "
                         f"(uint8) K/V only")
    if kv_format == FP8_UNSCALED:
        if k.dtype != torch.float8_e4m3fn or any(s is not None for s in scales):
            raise InputError(f"kv_format={FP8_UNSCALED!r} is float8_e4m3fn K/V without k_scale/v_scale; got "
                             f"{k.dtype} K/V{' with scales' if any(s is not None for s in scales) else ''}")
        return FP8_UNSCALED
    if kv_format is not None and kv_format != _name(k.dtype):
        raise InputError(f"kv_format={kv_format!r} but K/V are {k.dtype}")
    return _name(k.dtype)


def cache_fault(kv_format: str, index_format: str, k: tuple, index: tuple, k_scale: object,
                block: tuple[object, object, object]) -> Optional[str]:
    """What is wrong with a cache's facts for its formats (shapes and dtypes only), else ``None``.

    ``k``/``index``: ``(shape, dtype)``; ``block``: the facts (shape, dtype, ...) of ``k_block_scale``,
    ``v_block_scale`` and ``index_block_scale`` or ``None``. For the boundary's rules, which see tensors'
    facts, not their values (those were checked when the cache was built).
    """
    for what, fmt, (shape, dtype), scales in (("K/V", kv_format, k, block[:2]), ("index", index_format, index,
                                                                                 block[2:])):
        if fmt != NVFP4:
            if any(s is not None for s in scales):
                return f"NVFP4 block scales given with a {dtype} {what} cache"
            continue
        want = (*shape[:-1], 2 * shape[-1] // NVFP4_GROUP)
        for s in scales:
            if s is None or s[1] != torch.float8_e4m3fn or tuple(s[0]) != want or (2 * shape[-1]) % NVFP4_GROUP:
                got = "none" if s is None else f"{s[1]} {tuple(s[0])}"
                return (f"NVFP4 {what} {tuple(shape)} needs float8_e4m3fn block scales {want} (one per "
                        f"{NVFP4_GROUP} of head_dim {2 * shape[-1]}); got {got}")
    if kv_format in (NVFP4, FP8_UNSCALED) and k_scale is not None:
        return f"k_scale/v_scale given with {kv_format} K/V, which have no such scale"
    return None


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n]`` -> the float32 e2m1 values ``[..., 2n]`` (low nibble first), exact."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    return table[codes]


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 ``packed`` ``[..., D/2]`` with ``scales`` ``[..., D/16]`` -> values ``[..., D]`` in ``dtype``.

    ``e2m1 * scale`` in float32, exact (a 2-bit and a 4-bit significand), so as exact in any dtype that
    holds the product (float32, float64); this is the reference semantics (docs/spec.md §1).
    """
    v = unpack_e2m1(packed)
    g = v.unflatten(-1, (v.shape[-1] // NVFP4_GROUP, NVFP4_GROUP)) * scales.float().unsqueeze(-1)
    return g.flatten(-2).to(dtype)


def quantize_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` (D a multiple of 16) as NVFP4: ``(packed uint8 [..., D/2], scales e4m3 [..., D/16])``.

    Each group of 16 gets the scale ``amax / 6`` rounded to e4m3; values are ``x / scale`` rounded to the
    nearest e2m1 (ties to the even code), saturating at 6. For tests and engines' writers alike.
    """
    D = x.shape[-1]
    if D % NVFP4_GROUP:
        raise InputError(f"quantize_nvfp4: the last axis ({D}) must be a multiple of {NVFP4_GROUP}")
    g = x.float().unflatten(-1, (D // NVFP4_GROUP, NVFP4_GROUP))
    scales = (g.abs().amax(dim=-1) / 6.0).to(torch.float8_e4m3fn)
    s = scales.float().unsqueeze(-1)
    y = torch.where(s > 0, g / torch.where(s > 0, s, 1.0), torch.zeros_like(g))
    mag = y.abs().clamp(max=6.0)
    mids = _MIDPOINTS.to(x.device)
    code = torch.bucketize(mag, mids)                           # a tie goes to the lower code ...
    tie = (code < len(mids)) & (mag == mids[code.clamp(max=len(mids) - 1)]) & (code % 2 == 1)
    code = code + tie.long()                                    # ... unless the upper one is even
    code = code + 8 * ((y < 0) & (code > 0)).long()
    code = code.flatten(-2).to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), scales


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest e4m3 value, saturating at +-448 (float32): the authors' rounding of an
    NVFP4 product and of ``P * 448`` (docs/spec.md §1), for tests that mimic it."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
