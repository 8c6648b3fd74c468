"""The Triton kernels on fp8 K/V caches with scales, through Triton's interpreter (CPU, fp16/fp32 compute).

Both attention paths: the persistent decode kernel with the block-grouped
prefill (NVIDIA's), and the grid decode kernel with the token-tile prefill
(ROCm's), in fp16 and fp32, on both fp8 formats (e4m3, e5m2). Each is a mixed
batch (speculative decodes, a padding decode, a chunked and a fresh prefill)
on a NaN-poisoned output, against the fp64 oracle on the dequantized cache;
per-KV-head scales (HND), a per-tensor scale (NHD, a stride-0 view), scales
per (KV head, slot) and the scale 1.0 run. e5m2 values past e4m3's range
(up to 57344) on both paths, and e5m2 through the layer on both plugins.
bf16 queries on fp8 K/V: tests/test_fp8_kv_f16_interpreter.py,
tests/test_triton_conformance.py and the GPU (tests/gpu).
"""

from __future__ import annotations

import os
import pytest
import torch

import mm3
from mm3.contract.buffers import PagedKVCache
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import full_range_fp8, make_case
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk
from mm3_backends.triton.launch import override

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

# docs/spec.md §4 tolerances: (max, mean); the oracle reads the dequantized cache, so they are unchanged
ATTN_TOL = {torch.float16: (1e-2, 1.5e-4), torch.float32: (1e-5, 1e-5)}


def _configs() -> dict[str, object]:
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    return {
        "persistent_decode+block_grouped_prefill": base,
        "grid_decode+token_tile_prefill": override(base, algorithms=dict(decode_attention_flat=False),
                                                   prefill_attention=None),
    }


P = SparseAttentionParams(num_heads=6, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                          block_size=16, topk=4)
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _check(path: str, case: object, caches: PagedKVCache) -> None:
    """The attention of ``case``'s step on ``caches`` into a NaN-poisoned output, against the fp64 oracle."""
    from mm3_backends.triton import attention

    T = case.batch.num_tokens
    sel = oracle_topk(case.index_q, caches, case.batch, P)
    out = torch.full((T + 2, P.num_heads, P.head_dim), float("nan"), dtype=case.q.dtype)
    attention.attention_forward(case.q, caches, sel, case.batch, P, out[:T], _configs()[path])
    assert out[T:].isnan().all(), "rows past the step were written"
    assert not out[:T].isnan().any(), "unwritten (NaN-poisoned) output elements"
    err = (out[:T].double() - oracle_attention(case.q, caches, sel, case.batch, P)).abs()
    max_tol, mean_tol = ATTN_TOL[case.q.dtype]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol, (err.max().item(), err.mean().item())


def _case(path: str, dtype: str, kv_dtype: str, kv_scale: str = "head", layout: str = "NHD") -> object:
    return make_case(P, decodes=[70, 33], prefills=[(9, 60), (3, 3)], padding_decodes=1, decode_query_len=2,
                     dtype=dtype, index_dtype=dtype, kv_dtype=kv_dtype, kv_scale=kv_scale, kv_layout=layout,
                     seed=len(path))


@pytest.mark.parametrize("path, dtype, kv_scale, layout, kv_dtype", [
    ("persistent_decode+block_grouped_prefill", "float16", "head", "HND", E4M3),
    ("persistent_decode+block_grouped_prefill", "float32", "tensor", "NHD", E4M3),
    ("persistent_decode+block_grouped_prefill", "float16", "tensor", "NHD", E4M3),
    ("grid_decode+token_tile_prefill", "float32", "tensor", "NHD", E4M3),
    ("grid_decode+token_tile_prefill", "float16", "head", "NHD", E4M3),
    ("persistent_decode+block_grouped_prefill", "float16", "head", "HND", E5M2),
    ("persistent_decode+block_grouped_prefill", "float32", "unit", "NHD", E5M2),
    ("persistent_decode+block_grouped_prefill", "float16", "slot", "NHD", E5M2),
    ("grid_decode+token_tile_prefill", "float32", "slot", "HND", E5M2),
    ("grid_decode+token_tile_prefill", "float16", "tensor", "NHD", E5M2),
])
def test_fp8_kv_attention_matches_oracle(path: str, dtype: str, kv_scale: str, layout: str, kv_dtype: str) -> None:
    case = _case(path, dtype, kv_dtype, kv_scale, layout)
    _check(path, case, case.caches)


@pytest.mark.parametrize("path", sorted(_configs()))
def test_e5m2_values_past_e4m3s_range(path: str) -> None:
    """Stored e5m2 values up to its largest, 57344 (e4m3 stops at 448), scaled back to N(0, 1) values: the
    kernels widen them exactly into fp16 (whose largest is 65504) and scale them, so the step is held to
    fp16's usual tolerances."""
    case = _case(path, "float16", E5M2)
    caches = full_range_fp8(case.caches, torch.Generator().manual_seed(7))
    assert caches.k.float().abs().max() == 57344
    _check(path, case, caches)


@pytest.mark.parametrize("backend, kv_scale", [("cuda", "head"), ("rocm", "tensor"), ("cuda", "unit")])
def test_e5m2_kv_through_the_layer(backend: str, kv_scale: str) -> None:
    """mm3.SparseAttention built for e5m2 K/V on a Triton plugin: its selection, its indexer's rows, its output."""
    case = make_case(P, decodes=[70, 33], prefills=[(9, 60)], padding_decodes=1, decode_query_len=2,
                     dtype="float16", index_dtype="float16", kv_dtype=E5M2, kv_scale=kv_scale, seed=3)
    layer = mm3.SparseAttention(P, dtype=torch.float16, index_dtype=torch.float16, kv_dtype=torch.float8_e5m2,
                                max_num_tokens=32, max_decode_query_len=2, backend=backend)
    assert (layer.selection.attention.name, layer.selection.indexer.name) == (backend, backend)
    assert "KV cache float8_e5m2" in layer.explain()
    out = layer(case.q, case.index_q, case.caches, case.batch)
    sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
    assert not check_topk(sel, case.index_q, case.caches, case.batch, P)
    err = (out.double() - oracle_attention(case.q, case.caches, sel, case.batch, P)).abs()
    max_tol, mean_tol = ATTN_TOL[torch.float16]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol, (err.max().item(), err.mean().item())
