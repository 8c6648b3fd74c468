"""NVFP4 K/V and index caches (docs/spec.md §1) on the GPU, at MiniMax-M3 shapes: the Triton kernels unpack
the packed e2m1 values and their per-16 e4m3 scales on chip, exactly.

Mixed steps (speculative decodes, a padding decode, a chunked and a fresh prefill) at TP1 and TP8, NHD
and HND pages, fp8 queries (the authors' q8kv4) and bf16 ones, NVFP4 and bf16 index keys, through both
plugins' hooks (cuda: persistent decode + block-grouped prefill; rocm's kernels as NVIDIA runs them: grid
decode + token-tile prefill), on poisoned outputs. The selection is checked against fp64 block scores of
the dequantized index keys, the output against the fp64 attention of the dequantized K/V, with the bf16
tolerance of §4 (an exact reader meets it; the quantized tolerance is looser).

Run on a CUDA machine: ``pytest tests/gpu/test_nvfp4_gpu.py -q`` (skipped elsewhere).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import quantize_caches
from mm3_backends.cuda import plugin as cuda_plugin
from mm3_backends.rocm import plugin as rocm_plugin

from gpu_reference import attention_reference, block_scores, build_case, sample_tokens, selection_errors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SENTINEL = -7
# docs/spec.md §4 for bf16 against fp64: (max, mean)
TOL = (2e-2, 3e-4)
K8, K16, K32, K64 = 8192, 16384, 32768, 65536

CASES = {
    # id: (tp, NVFP4 index keys, kv layout, fp8 queries, decode query len, decode contexts, prefills)
    "tp1_q8kv4_idx4_q1_nhd": (1, True, "NHD", True, 1, [K64, K8 + 1, K32 - 3, 2500] * 4,
                              [(1024, K32 + 1024), (200, 200)]),
    "tp1_kv4_idxbf16_q2_hnd": (1, False, "HND", False, 2, [K64 - 5, K16 + 77, 3000], [(700, K8 + 700), (129, 129)]),
    "tp8_q8kv4_idx4_q3_hnd": (8, True, "HND", True, 3, [K16, 5000, K32 + 9] * 8, [(800, K16 + 800), (33, 33)]),
}


@pytest.mark.parametrize("plugin", [cuda_plugin, rocm_plugin], ids=["cuda", "rocm"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_nvfp4_step_against_fp64(name: str, plugin: Any) -> None:
    tp, idx4, layout, q8, dq, decodes, prefills = CASES[name]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=decodes, prefills=prefills, decode_query_len=dq, padding_decodes=1,
                      dtype=torch.bfloat16, index_dtype=torch.bfloat16, kv_layout=layout, seed=len(name) + tp)
    caches = quantize_caches(case.caches, "nvfp4", "nvfp4" if idx4 else None)
    assert caches.kv_format == "nvfp4" and caches.kv_layout == layout
    values = caches.dequantized(torch.float32)     # the reference's input only: the kernels read `caches`
    q = case.q.to(torch.float8_e4m3fn) if q8 else case.q
    hooks = plugin
    T, batch = case.batch.num_tokens, case.batch
    buf = hooks.alloc_topk_buffer(T + 5, p.num_kv_heads, p.topk, q.device).fill_(SENTINEL)
    step = buf.rows(0, T)
    hooks.index_topk(case.index_q, caches, batch, p, step)
    out = torch.full((T + 3, p.num_heads, p.head_dim), float("nan"), dtype=torch.bfloat16, device=q.device)
    hooks.attention_forward(q, caches, step, batch, p, out[:T])
    torch.cuda.synchronize()
    assert (buf.head_major()[:, T:] == SENTINEL).all(), "top-k rows >= T were written"
    assert out[T:].isnan().all(), "output rows >= T were written"
    assert not out[:T].isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    toks = sample_tokens(batch)
    errors = selection_errors(step, block_scores(case.index_q, values, batch, p, toks), p)
    assert not errors, "\n".join(errors[:5])
    ref = attention_reference(q, values, step, batch, p, toks)
    err = (out[toks].double() - torch.stack([ref[t] for t in toks])).abs()
    assert err.max().item() <= TOL[0] and err.mean().item() <= TOL[1], (err.max().item(), err.mean().item())


def test_nvfp4_through_the_layer_picks_the_cuda_plugin() -> None:
    """``mm3.SparseAttention`` with NVFP4 K/V and index keys and fp8 queries selects the cuda plugin on a GPU."""
    import mm3

    p = SparseAttentionParams.minimax_m3(tp_size=8)
    layer = mm3.SparseAttention(p, dtype=torch.bfloat16, index_dtype="nvfp4", kv_dtype="nvfp4",
                                q_dtype=torch.float8_e4m3fn, max_num_tokens=256, device="cuda")
    assert (layer.selection.attention.name, layer.selection.indexer.name) == ("cuda", "cuda"), layer.explain()
    case = build_case(p, decodes=[K8, 3000], prefills=[(64, 2000)], dtype=torch.bfloat16, seed=3)
    caches = quantize_caches(case.caches, "nvfp4", "nvfp4")
    out = layer(case.q.to(torch.float8_e4m3fn), case.index_q, caches, case.batch)
    torch.cuda.synchronize()
    toks = sample_tokens(case.batch)
    sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
    ref = attention_reference(case.q.to(torch.float8_e4m3fn), caches.dequantized(torch.float32), sel, case.batch,
                              p, toks)
    err = (out[toks].double() - torch.stack([ref[t] for t in toks])).abs()
    assert err.max().item() <= TOL[0] and err.mean().item() <= TOL[1], (err.max().item(), err.mean().item())

