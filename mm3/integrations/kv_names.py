"""The engines' kv-cache dtype names (``--kv-cache-dtype``) as mm3's K/V formats (docs/spec.md §1).

An engine's plugin that builds mm3's own layer (``SparseAttention(kv_dtype=...)``) or reads a
cache the engine allocated asks here what its setting means to mm3. A name mm3 reads maps to
a format; a name whose format mm3 does not read is an :class:`InputError` that says why and
what to do: no guessing, and no silent widening copy.

* vLLM: ``auto`` (the model dtype), ``bfloat16``/``float16``, ``fp8``/``fp8_e4m3`` (e4m3 with
  per-tensor, per-head or per-slot scales), ``fp8_e5m2``. vLLM's ``nvfp4`` is another NVFP4
  layout than the authors' (data and block scales in one ``[..., D/2 + D/16]`` tensor, a global
  per-tensor scale, and V block scales interleaved for SM100's kernels), so it is refused.
* SGLang: ``auto``, ``bf16``, ``fp8_e4m3`` and ``fp8_e5m2`` (per-tensor scales). Its
  ``fp4_e2m1`` is MXFP4-style (power-of-two e8m0 scales), not NVFP4: refused.

Neither engine has a name for the authors' NVFP4 or for e4m3 K/V declared unscaled: those are
served by mm3's own layer, on a cache allocated as docs/engines.md says
(``PagedKVCache.allocate(..., kv_format="nvfp4")``).

Example:
    >>> kv_format("vllm", "fp8_e4m3", "bfloat16"), kv_format("sglang", "auto", "bfloat16")
    ('float8_e4m3fn', 'bfloat16')
    >>> kv_format("vllm", "nvfp4", "bfloat16")
    Traceback (most recent call last):
    ...
    mm3.contract.errors.InputError: vllm --kv-cache-dtype nvfp4: vLLM's nvfp4 cache keeps data and block scales in one [..., D/2 + D/16] tensor with a global per-tensor scale (and SM100-interleaved V scales); mm3 reads the authors' NVFP4 (separate linear e4m3 block scales, no global scale): serve with --kv-cache-dtype fp8, or use mm3's own layer on a cache from PagedKVCache.allocate(..., kv_format='nvfp4') (docs/engines.md)
"""

from __future__ import annotations

from mm3.contract.errors import InputError

__all__ = ["VLLM_KV_CACHE_DTYPES", "SGLANG_KV_CACHE_DTYPES", "kv_format"]

_MODEL = "the model dtype"

VLLM_KV_CACHE_DTYPES: dict[str, str] = {
    "auto": _MODEL, "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}
"""vLLM's ``--kv-cache-dtype`` names mm3 reads, and the K/V format each is (fp8: scaled)."""

SGLANG_KV_CACHE_DTYPES: dict[str, str] = {
    "auto": _MODEL, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""SGLang's ``--kv-cache-dtype`` names mm3 reads, and the K/V format each is (fp8: scaled)."""

#: each engine's name of the scaled e4m3 cache mm3 reads: the advice of a refusal
_FP8_NAME = {"vllm": "fp8", "sglang": "fp8_e4m3"}

_REFUSED: dict[tuple[str, str], str] = {
    ("vllm", "nvfp4"): "vLLM's nvfp4 cache keeps data and block scales in one [..., D/2 + D/16] tensor with a global "
                       "per-tensor scale (and SM100-interleaved V scales); mm3 reads the authors' NVFP4 (separate "
                       "linear e4m3 block scales, no global scale)",
    ("sglang", "fp4_e2m1"): "SGLang's fp4_e2m1 is MXFP4-style (power-of-two e8m0 scales), not NVFP4 (e4m3 scales per "
                            "16); mm3 does not read it",
}


def kv_format(engine: str, kv_cache_dtype: str, model_dtype: str) -> str:
    """The mm3 K/V format (``kv_cache_dtypes`` name) of ``engine``'s ``--kv-cache-dtype kv_cache_dtype``.

    ``engine``: ``"vllm"`` or ``"sglang"``; ``model_dtype``: the attention dtype (``"bfloat16"``...),
    what ``auto`` means. :class:`InputError` for a name mm3 does not read, with the reason.
    """
    names = {"vllm": VLLM_KV_CACHE_DTYPES, "sglang": SGLANG_KV_CACHE_DTYPES}.get(engine)
    if names is None:
        raise InputError(f"unknown engine {engine!r}; use 'vllm' or 'sglang'")
    fmt = names.get(kv_cache_dtype)
    if fmt is not None:
        return model_dtype if fmt == _MODEL else fmt
    why = _REFUSED.get((engine, kv_cache_dtype), f"mm3 reads {sorted(names)} from {engine}")
    raise InputError(f"{engine} --kv-cache-dtype {kv_cache_dtype}: {why}: serve with --kv-cache-dtype "
                     f"{_FP8_NAME[engine]}, or use "
                     f"mm3's own layer on a cache from PagedKVCache.allocate(..., kv_format='nvfp4') "
                     f"(docs/engines.md)")
