"""The Triton kernels on fp8 K/V caches with scales, through Triton's interpreter (CPU, fp16/fp32 compute).

Both attention paths: the persistent decode kernel with the block-grouped
prefill (NVIDIA's), and the grid decode kernel with the token-tile prefill
(ROCm's), in fp16 and fp32. Each is a mixed batch (speculative decodes, a
padding decode, a chunked and a fresh prefill) on a NaN-poisoned output,
against the fp64 oracle on the dequantized cache; per-KV-head scales (HND)
and a per-tensor scale (NHD, a stride-0 view) both run. bf16 queries on fp8
K/V: tests/test_fp8_kv_f16_interpreter.py, tests/test_triton_conformance.py and
the GPU (tests/gpu).
"""

from __future__ import annotations

import os
import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention, oracle_topk
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


@pytest.mark.parametrize("path, dtype, kv_scale, layout", [
    ("persistent_decode+block_grouped_prefill", "float16", "head", "HND"),
    ("persistent_decode+block_grouped_prefill", "float32", "tensor", "NHD"),
    ("persistent_decode+block_grouped_prefill", "float16", "tensor", "NHD"),
    ("grid_decode+token_tile_prefill", "float32", "tensor", "NHD"),
    ("grid_decode+token_tile_prefill", "float16", "head", "NHD"),
])
def test_fp8_kv_attention_matches_oracle(path: str, dtype: str, kv_scale: str, layout: str) -> None:
    from mm3_backends.triton import attention

    p = SparseAttentionParams(num_heads=6, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4)
    case = make_case(p, decodes=[70, 33], prefills=[(9, 60), (3, 3)], padding_decodes=1, decode_query_len=2,
                     dtype=dtype, index_dtype=dtype, kv_dtype="float8_e4m3fn", kv_scale=kv_scale,
                     kv_layout=layout, seed=len(path))
    T = case.batch.num_tokens
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    out = torch.full((T + 2, p.num_heads, p.head_dim), float("nan"), dtype=case.q.dtype)
    attention.attention_forward(case.q, case.caches, sel, case.batch, p, out[:T], _configs()[path])
    assert out[T:].isnan().all(), "rows past the step were written"
    assert not out[:T].isnan().any(), "unwritten (NaN-poisoned) output elements"
    err = (out[:T].double() - oracle_attention(case.q, case.caches, sel, case.batch, p)).abs()
    max_tol, mean_tol = ATTN_TOL[case.q.dtype]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol, (err.max().item(), err.mean().item())
