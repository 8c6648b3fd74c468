"""The conformance cases of the model authors' formats (docs/spec.md §1): fp8 queries, unscaled e4m3 and
NVFP4 K/V, NVFP4 index keys, and the authors' page layouts.

Each is a step of :mod:`.cases` with its formats fixed, so every backend is held to the same
inputs; one that does not declare a format (``kv_cache_dtypes``, ``index_cache_dtypes``,
``query_dtypes``) is not run on it, and the report says which declaration is missing. The names
follow the authors' precisions: ``q8kv8`` (fp8 queries, e4m3 K/V without a scale) and ``q8kv4``
(fp8 queries, NVFP4 K/V). Attention cases are compared with the fp64 oracle on the dequantized
values, under docs/spec.md §4's tolerance for quantized steps (a backend may round as the
authors do); index cases as every indexer case is (§3).

Example:
    >>> sorted({kind for kind, _ in QUANT_CASES.values()})
    ['attention', 'composed', 'indexer']
    >>> QUANT_CASES["q8kv4_shared_prefix"][1].kv_dtype
    'nvfp4'
"""

from __future__ import annotations

from mm3.testing.conformance.cases import Step

__all__ = ["QUANT_CASES"]

_UNSCALED = "float8_e4m3fn_unscaled"
_NVFP4 = "nvfp4"


def _att(**kw: object) -> tuple[str, Step]:
    return "attention", Step(K=16, **kw)  # type: ignore[arg-type]


QUANT_CASES: dict[str, tuple[str, Step]] = {
    # fp8 queries with a cache in the attention dtype: the output dtype is out's
    "q8_mixed": _att(H=2, G=4, decodes=(420, 300), padding=1, prefills=((6, 380),), q8=True),
    # q8kv8: fp8 queries, e4m3 K/V without a scale
    "q8kv8_decode": _att(H=2, G=4, decodes=(420, 300, 130), padding=1, q8=True, kv_quant=_UNSCALED),
    "q8kv8_spec_decode_hnd": _att(H=1, G=8, D=64, dq=3, decodes=(400, 250), padding=1, prefills=((5, 330),),
                                  kv_layout="HND", q8=True, kv_quant=_UNSCALED),
    "q8kv8_chunked_prefill": _att(H=1, G=4, D=64, decodes=(520,), prefills=((64, 640), (48, 400)), q8=True,
                                  kv_quant=_UNSCALED),
    "q8kv8_mixed": _att(H=2, G=2, decodes=(500, 280), prefills=((4, 4), (33, 460)), q8=True, kv_quant=_UNSCALED),
    "kv8_unscaled_mixed": _att(H=2, G=4, decodes=(420, 300), padding=1, prefills=((6, 380),), kv_quant=_UNSCALED),
    # q8kv4: fp8 queries, NVFP4 K/V
    "q8kv4_decode": _att(H=2, G=4, decodes=(420, 300, 130), padding=1, q8=True, kv_quant=_NVFP4),
    "q8kv4_spec_decode_hnd": _att(H=1, G=8, D=64, dq=4, decodes=(440, 360, 9), padding=1, prefills=((30, 600),),
                                  kv_layout="HND", q8=True, kv_quant=_NVFP4),
    "q8kv4_chunked_prefill": _att(H=1, G=4, D=64, decodes=(520,), prefills=((64, 640), (48, 400)), q8=True,
                                  kv_quant=_NVFP4),
    "q8kv4_mixed": _att(H=2, G=2, decodes=(500, 280), prefills=((4, 4), (33, 460)), q8=True, kv_quant=_NVFP4),
    "kv4_mixed_hnd": _att(H=2, G=4, dq=2, decodes=(400, 300), prefills=((21, 360),), kv_layout="HND",
                          kv_quant=_NVFP4),
    # the authors' page layouts: each request on its own ascending pages, and a prompt prefix shared
    # by every request (the default everywhere else is a random permutation of the pages)
    "q8kv4_disjoint": _att(H=2, G=4, dq=2, decodes=(400, 300), prefills=((21, 360),), q8=True, kv_quant=_NVFP4,
                           pages="disjoint"),
    "q8kv4_shared_prefix": _att(H=2, G=4, dq=2, decodes=(400, 300, 350), padding=1, prefills=((21, 360),), q8=True,
                                kv_quant=_NVFP4, pages="shared_prefix"),
    "q8kv8_shared_prefix_hnd": _att(H=1, G=8, D=64, decodes=(500, 330), prefills=((40, 520),), kv_layout="HND",
                                    q8=True, kv_quant=_UNSCALED, pages="shared_prefix"),
    # NVFP4 index keys: the selection of docs/spec.md §3 on their dequantized values
    "index_nvfp4_mixed": ("indexer", Step(H=2, G=2, decodes=(100, 33), padding=1, empty=1,
                                          prefills=((20, 20), (37, 150), (5, 40)), index_format=_NVFP4)),
    "index_nvfp4_spec_decode_di64": ("indexer", Step(H=2, G=2, Di=64, dq=3, decodes=(64, 200), padding=1,
                                                     prefills=((11, 11), (7, 100)), index_format=_NVFP4)),
    "index_nvfp4_shared_prefix": ("indexer", Step(H=1, G=4, decodes=(120, 65, 140), prefills=((31, 180),),
                                                  index_format=_NVFP4, pages="shared_prefix")),
    # at MiniMax-M3's head dims (128): a compiled tile takes other register layouts there than at 32 and 64,
    # and an unpacking that is right at one head dim can be wrong at another
    "q8kv4_decode_d128": _att(H=2, G=4, D=128, decodes=(420, 300, 130), padding=1, q8=True, kv_quant=_NVFP4),
    "kv4_mixed_hnd_d128": _att(H=2, G=4, D=128, dq=2, decodes=(400, 300), prefills=((21, 360),), kv_layout="HND",
                               kv_quant=_NVFP4),
    "q8kv4_chunked_prefill_d128": _att(H=1, G=4, D=128, decodes=(520,), prefills=((64, 640), (48, 400)), q8=True,
                                       kv_quant=_NVFP4),
    "index_nvfp4_mixed_di128": ("indexer", Step(H=2, G=2, Di=128, decodes=(100, 33), padding=1, empty=1,
                                                prefills=((20, 20), (37, 150), (5, 40)), index_format=_NVFP4)),
    "q8kv4_index_nvfp4_d128": ("composed", Step(H=2, G=4, D=128, Di=128, K=16, dq=2, decodes=(460, 260, 80),
                                                padding=1, prefills=((3, 3), (40, 520)), q8=True, kv_quant=_NVFP4,
                                                index_format=_NVFP4)),
    # all of it at once: fp8 queries, NVFP4 K/V and index keys, the backend's own indexer then attention
    "q8kv4_index_nvfp4": ("composed", Step(H=2, G=4, K=16, dq=2, decodes=(460, 260, 80), padding=1,
                                           prefills=((3, 3), (40, 520)), q8=True, kv_quant=_NVFP4,
                                           index_format=_NVFP4)),
    "q8kv8_index_fp8_spec_decode_hnd": ("composed", Step(H=1, G=8, D=64, Di=64, K=16, dq=3, decodes=(600, 240),
                                                         prefills=((28, 400),), kv_layout="HND", q8=True,
                                                         kv_quant=_UNSCALED, index_format="float8_e4m3fn")),
}
"""name -> (body kind, step): the cases of the authors' formats, planned once each (in the run's base dtype)."""
