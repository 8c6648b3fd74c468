"""fp8 (e4m3) K/V caches on the GPU: the fp16-dot path with bf16 queries, and the decode step in a CUDA graph.

* The cuda plugin dots bf16 queries against fp8 K/V in fp16 (``numerics.kv_fp8_as_f16``:
  query rows scaled per row by a power of two, K/V widened e4m3 -> fp16, P in fp16)
  in the decode kernels. Checked against the fp64 reference at M3
  TP1 and TP8 shapes, mixed decode + prefill steps (speculative decodes, a padding
  row, a chunked and a fresh prefill), bf16 and fp8 index caches, NHD and HND pages,
  beside the previous path (K/V widened to bf16, ``kv_fp8_as_f16=False``), and with
  query rows far outside fp16's range (1e6, 1e-6), on NaN-poisoned outputs.
  Here bf16 is the real thing, which the CPU interpreter cannot run.
* An fp8-K/V decode step (indexer + attention) captured in a ``torch.cuda.CUDAGraph``
  and replayed with new lengths, positions, pages and queries equals eager bit
  for bit, at batch 64 (the persistent kernel's programs take two items each)
  and in a speculative step with flash-decoding splits; with scales per KV head and
  token slot too (eager, mixed steps, and a captured decode step).

Run on a CUDA machine: ``pytest tests/gpu/test_fp8_kv_gpu.py -q`` (skipped elsewhere).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3_backends.cuda import plugin as cuda_plugin

from gpu_reference import (attention_reference, block_scores, build_case, capture, replay_step, sample_tokens,
                           selection_errors)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn
SENTINEL = -7
# docs/spec.md §4 for bf16 against fp64: (max, mean)
TOL = (2e-2, 3e-4)
K8, K16, K32, K64 = 8192, 16384, 32768, 65536


def _hooks(path: str) -> Any:
    """The cuda plugin's hooks: its own config ("fp16"), or with K/V widened to bf16 as before ("bf16")."""
    if path == "fp16":
        assert cuda_plugin.PLATFORM.launch.numerics.kv_fp8_as_f16
        return cuda_plugin
    from mm3_backends.triton.launch import override
    from mm3_backends.triton.plugin_factory import make_hookimpls

    launch = override(cuda_plugin.PLATFORM.launch, numerics=dict(kv_fp8_as_f16=False))
    return make_hookimpls(replace(cuda_plugin.PLATFORM, launch=launch))


CASES = {
    # id: (tp, index dtype, kv layout, decode query len, decode contexts, prefills)
    "tp1_idxbf16_q1_nhd": (1, torch.bfloat16, "NHD", 1, [K64, K8 + 1, K32 - 3, 2500] * 4,
                           [(1024, K32 + 1024), (200, 200)]),
    "tp1_idxfp8_q2_hnd": (1, FP8, "HND", 2, [K64 - 5, K16 + 77, 3000], [(700, K8 + 700), (129, 129)]),
    "tp8_idxfp8_q1_nhd": (8, FP8, "NHD", 1, [K32, K64 + 7, K8] * 8, [(800, K16 + 800), (33, 33)]),
    "tp8_idxbf16_q3_hnd": (8, torch.bfloat16, "HND", 3, [K16, 5000], [(300, K8 + 300)]),
}


def _scale_rows(q: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """``q`` with row (token, head) ``i`` multiplied by ``factors[i % len(factors)]`` (fp32 math, back to q's dtype)."""
    T, H, D = q.shape
    f = torch.tensor(factors, device=q.device)[torch.arange(T * H, device=q.device) % len(factors)]
    return (q.float().reshape(-1, D) * f[:, None]).reshape(T, H, D).to(q.dtype)


def _check_step(hooks: Any, p: SparseAttentionParams, case: Any, q: Optional[torch.Tensor] = None) -> tuple[float, float]:
    """Indexer + attention of one step on a poisoned output; selection and output against fp64."""
    q = case.q if q is None else q
    T, batch = case.batch.num_tokens, case.batch
    buf = hooks.alloc_topk_buffer(T + 5, p.num_kv_heads, p.topk, q.device).fill_(SENTINEL)
    step = buf.rows(0, T)
    hooks.index_topk(case.index_q, case.caches, batch, p, step)
    out = torch.full((T + 3, p.num_heads, p.head_dim), float("nan"), dtype=q.dtype, device=q.device)
    hooks.attention_forward(q, case.caches, step, batch, p, out[:T])
    torch.cuda.synchronize()
    assert (buf.head_major()[:, T:] == SENTINEL).all(), "top-k rows >= T were written"
    assert out[T:].isnan().all(), "output rows >= T were written"
    assert not out[:T].isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    toks = sample_tokens(batch)
    errors = selection_errors(step, block_scores(case.index_q, case.caches, batch, p, toks), p)
    assert not errors, "\n".join(errors[:5])
    ref = attention_reference(q, case.caches, step, batch, p, toks)
    err = (out[toks].double() - torch.stack([ref[t] for t in toks])).abs()
    return err.max().item(), err.mean().item()


@pytest.mark.parametrize("path", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_queries_on_fp8_kv_against_fp64(name: str, path: str) -> None:
    tp, idx_dtype, layout, dq, decodes, prefills = CASES[name]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=decodes, prefills=prefills, decode_query_len=dq, padding_decodes=1,
                      dtype=torch.bfloat16, index_dtype=idx_dtype, kv_layout=layout, seed=len(name) + tp,
                      kv_dtype=FP8)
    max_err, mean_err = _check_step(_hooks(path), p, case)
    assert max_err <= TOL[0] and mean_err <= TOL[1], (max_err, mean_err)


@pytest.mark.parametrize("name", ["tp1_idxbf16_q1_nhd", "tp8_idxbf16_q3_hnd"])
def test_slot_scaled_fp8_kv_against_fp64(name: str) -> None:
    """Scales per KV head and token slot (vLLM's [Hkv, num_slots]): the decode and prefill attention
    read each key's own K and V factors."""
    tp, idx_dtype, layout, dq, decodes, prefills = CASES[name]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=decodes, prefills=prefills, decode_query_len=dq, padding_decodes=1,
                      dtype=torch.bfloat16, index_dtype=idx_dtype, kv_layout=layout, seed=len(name) + tp + 1,
                      kv_dtype=FP8, kv_scale="slot")
    assert case.caches.slot_scaled
    max_err, mean_err = _check_step(cuda_plugin, p, case)
    assert max_err <= TOL[0] and mean_err <= TOL[1], (max_err, mean_err)


@pytest.mark.parametrize("magnitude", [1e6, 1e-6])
@pytest.mark.parametrize("tp", [1, 8])
def test_query_rows_outside_fp16_range(tp: int, magnitude: float) -> None:
    """bf16 query rows fp16 cannot hold unscaled (1e6 overflows, 1e-6 is subnormal), the softmax
    scale set so the logits stay of order one: only the per-row scaling keeps them exact.

    Rows up to 7x the usual size make the softmax peakier than the tolerance table's inputs,
    so bf16's own rounding of q gives a larger mean error whatever the dot dtype (above the
    3e-4 bf16 mean tolerance on a GPU, on both paths). The fp16 path is therefore held to the max tolerance and
    to the mean error of the path that needs no scaling (K/V widened to bf16) on the same
    inputs; without the scaling, 1e6 rows overflow fp16 and 1e-6 rows flush to zero."""
    p = SparseAttentionParams.minimax_m3(tp_size=tp, scale=128 ** -0.5 / magnitude)
    case = build_case(p, decodes=[K16, 3000, K8 + 5] * 4, prefills=[(300, K8 + 300), (40, 40)], padding_decodes=1,
                      dtype=torch.bfloat16, index_dtype=FP8, seed=7 + tp, kv_dtype=FP8)
    q = _scale_rows(case.q, [magnitude * f for f in (1.0, 0.3, 7.0, 0.125, 2.5)])
    max_err, mean_err = _check_step(cuda_plugin, p, case, q)
    _, bf16_mean_err = _check_step(_hooks("bf16"), p, case, q)
    assert max_err <= TOL[0] and mean_err <= 1.1 * bf16_mean_err, (max_err, mean_err, bf16_mean_err)


GRAPH_CASES = {
    # id: (tp, decodes, decode query len); widths fixed by the contexts below
    "tp1_b64_q1": (1, 64, 1),
    "tp1_b8_spec_q2": (1, 8, 2),
    "tp8_b32_q1": (8, 32, 1),
    "tp1_b16_q1_slot": (1, 16, 1),
}


@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_fp8_kv_decode_step_in_cuda_graph(name: str) -> None:
    """Capture indexer + attention on fp8 K/V and an fp8 index; replay with new inputs == eager."""
    tp, n, dq = GRAPH_CASES[name]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    pages, width = n * (K16 // 128 + 2) + 64, K16 // 128 + 2
    kw = dict(prefills=[], decode_query_len=dq, width=width, num_pages=pages, dtype=torch.bfloat16,
              index_dtype=FP8, kv_dtype=FP8, kv_scale="slot" if name.endswith("_slot") else "head")
    first = build_case(p, decodes=[K8 + 11 * i for i in range(n)], seed=1, **kw)
    # same shapes (requests, query lengths, table width); new lengths, pages, queries (one padding row)
    replays = [build_case(p, decodes=[K16 - 97 * i for i in range(n - 1)], padding_decodes=1, seed=2, **kw),
               build_case(p, decodes=[3000 + 171 * i for i in range(n)], seed=3, **kw)]
    assert all(r.batch.block_table.shape == first.batch.block_table.shape for r in replays)
    caches = replays[0].caches      # one cache pool for all (the graph bakes in its address)
    plugin = cuda_plugin
    T = first.batch.num_tokens
    buf = plugin.alloc_topk_buffer(T + 16, p.num_kv_heads, p.topk, caches.device).fill_(SENTINEL)
    step = buf.rows(0, T)
    q, iq, batch = first.q.clone(), first.index_q.clone(), first.batch   # updated in place below
    out = torch.full((T + 4, p.num_heads, p.head_dim), float("nan"), dtype=q.dtype, device=q.device)

    def run() -> None:
        plugin.index_topk(iq, caches, batch, p, step)
        plugin.attention_forward(q, caches, step, batch, p, out[:T])

    graph = capture(run)

    for replay, src in enumerate(replays):
        replay_step(graph, q, iq, batch, out, src)
        eager_buf = plugin.alloc_topk_buffer(T, p.num_kv_heads, p.topk, caches.device)
        eager_out = torch.full_like(out[:T], float("nan"))
        plugin.index_topk(src.index_q, caches, src.batch, p, eager_buf)
        plugin.attention_forward(src.q, caches, eager_buf, src.batch, p, eager_out)
        torch.cuda.synchronize()
        assert torch.equal(step.head_major(), eager_buf.head_major()), f"replay {replay}: other blocks than eager"
        assert torch.equal(out[:T], eager_out), f"replay {replay}: output differs from eager"
        assert out[T:].isnan().all() and (buf.head_major()[:, T:] == SENTINEL).all(), "rows >= T were written"
        toks = sample_tokens(src.batch)
        errors = selection_errors(step, block_scores(src.index_q, caches, src.batch, p, toks), p)
        assert not errors, "\n".join(errors[:5])
        ref = attention_reference(src.q, caches, step, src.batch, p, toks)
        err = (out[toks].double() - torch.stack([ref[t] for t in toks])).abs()
        assert err.max().item() <= TOL[0] and err.mean().item() <= TOL[1], (err.max().item(), err.mean().item())
