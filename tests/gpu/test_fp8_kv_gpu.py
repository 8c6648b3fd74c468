"""fp8 (e4m3, e5m2) K/V caches on the GPU: the fp16-dot path with bf16 queries, and the decode step in a CUDA graph.

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
* e5m2 K/V (vLLM's ``fp8_e5m2``) through the same kernels: the cases above at M3
  shapes, per-KV-head and per-slot scales, a captured decode step; stored
  values across e5m2's whole range (up to 57344, past e4m3's 448) on both dot
  paths; and through ``mm3.SparseAttention`` on both plugins, eager and captured.

Run on a CUDA machine: ``pytest tests/gpu/test_fp8_kv_gpu.py -q`` (skipped elsewhere).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import pytest
import torch

import mm3
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import full_range_fp8
from mm3_backends.cuda import plugin as cuda_plugin

from gpu_reference import (attention_reference, block_scores, build_case, capture, replay_step, sample_tokens,
                           selection_errors)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
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


@pytest.mark.parametrize("path, kv_dtype", [("fp16", FP8), ("bf16", FP8), ("fp16", E5M2)],
                         ids=["fp16-e4m3", "bf16-e4m3", "fp16-e5m2"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_queries_on_fp8_kv_against_fp64(name: str, path: str, kv_dtype: torch.dtype) -> None:
    tp, idx_dtype, layout, dq, decodes, prefills = CASES[name]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=decodes, prefills=prefills, decode_query_len=dq, padding_decodes=1,
                      dtype=torch.bfloat16, index_dtype=idx_dtype, kv_layout=layout, seed=len(name) + tp,
                      kv_dtype=kv_dtype)
    max_err, mean_err = _check_step(_hooks(path), p, case)
    assert max_err <= TOL[0] and mean_err <= TOL[1], (max_err, mean_err)


@pytest.mark.parametrize("kv_dtype", [FP8, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", ["tp1_idxbf16_q1_nhd", "tp8_idxbf16_q3_hnd"])
def test_slot_scaled_fp8_kv_against_fp64(name: str, kv_dtype: torch.dtype) -> None:
    """Scales per KV head and token slot (vLLM's [Hkv, num_slots]): the decode and prefill attention
    read each key's own K and V factors."""
    tp, idx_dtype, layout, dq, decodes, prefills = CASES[name]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=decodes, prefills=prefills, decode_query_len=dq, padding_decodes=1,
                      dtype=torch.bfloat16, index_dtype=idx_dtype, kv_layout=layout, seed=len(name) + tp + 1,
                      kv_dtype=kv_dtype, kv_scale="slot")
    assert case.caches.slot_scaled
    max_err, mean_err = _check_step(cuda_plugin, p, case)
    assert max_err <= TOL[0] and mean_err <= TOL[1], (max_err, mean_err)


@pytest.mark.parametrize("path", ["fp16", "bf16"])
@pytest.mark.parametrize("kv_dtype", [FP8, E5M2], ids=["e4m3", "e5m2"])
def test_stored_values_across_the_whole_fp8_range(kv_dtype: torch.dtype, path: str) -> None:
    """K/V stored up to the format's largest finite value (e5m2: 57344, past e4m3's 448; fp16's largest is
    65504) and scaled back to N(0, 1) (mm3.testing.factories.full_range_fp8): both dot paths widen them
    exactly, so the step is held to the usual tolerances."""
    tp, idx_dtype, layout, dq, decodes, prefills = CASES["tp8_idxbf16_q3_hnd"]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=decodes, prefills=prefills, decode_query_len=dq, padding_decodes=1,
                      dtype=torch.bfloat16, index_dtype=idx_dtype, kv_layout=layout, seed=11, kv_dtype=kv_dtype)
    case = replace(case, caches=full_range_fp8(case.caches, torch.Generator().manual_seed(11)))
    assert case.caches.k.float().abs().max().item() == torch.finfo(kv_dtype).max
    max_err, mean_err = _check_step(_hooks(path), p, case)
    assert max_err <= TOL[0] and mean_err <= TOL[1], (max_err, mean_err)


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_e5m2_kv_through_the_layer_eager_and_captured(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """mm3.SparseAttention(kv_dtype=torch.float8_e5m2) on a Triton plugin: a mixed step eager against the
    fp64 references, then a decode step captured in a CUDA graph and replayed == eager, bit for bit.
    (The rocm plugin runs here through its test-only override, in a registry of its own.)"""
    from mm3.runtime.registry import Registry
    from mm3_backends.rocm import plugin as rocm_plugin

    monkeypatch.setenv(rocm_plugin.ALLOW_NON_ROCM_ENV, "1")
    registry = Registry(plugins=[cuda_plugin, rocm_plugin], entry_points=False)
    p = SparseAttentionParams.minimax_m3(tp_size=8)
    layer = mm3.SparseAttention(p, device="cuda", dtype=torch.bfloat16, kv_dtype=E5M2, max_num_tokens=2048,
                                max_decode_query_len=2, backend=backend, cuda_graph=True, registry=registry)
    assert layer.selection.attention.name == backend and "KV cache float8_e5m2" in layer.explain()
    case = build_case(p, decodes=[K16, 3000, K8 + 5], prefills=[(300, K8 + 300), (40, 40)], padding_decodes=1,
                      decode_query_len=2, dtype=torch.bfloat16, seed=12, kv_dtype=E5M2, kv_scale="head")
    out = layer(case.q, case.index_q, case.caches, case.batch)
    T = case.batch.num_tokens
    step = layer.topk_buffer.rows(0, T)
    toks = sample_tokens(case.batch)
    errors = selection_errors(step, block_scores(case.index_q, case.caches, case.batch, p, toks), p)
    assert not errors, "\n".join(errors[:5])
    ref = attention_reference(case.q, case.caches, step, case.batch, p, toks)
    exact = torch.stack([ref[t] for t in toks])
    err = (out[toks].double() - exact).abs()
    floor = (exact.to(torch.bfloat16).double() - exact).abs().mean().item()   # the output's own rounding
    assert err.max().item() <= TOL[0] and err.mean().item() <= TOL[1], \
        (err.max().item(), err.mean().item(), f"bf16 rounding floor {floor:.3g}, ratio {err.mean().item() / floor:.3g}")

    dec = build_case(p, decodes=[K8 + 11 * i for i in range(16)], prefills=[], dtype=torch.bfloat16, seed=13,
                     kv_dtype=E5M2, kv_scale="tensor", num_pages=16 * (K16 // 128 + 2) + 64, width=K16 // 128 + 2)
    q, iq, buf = dec.q.clone(), dec.index_q.clone(), torch.full_like(dec.q, float("nan"))
    graph = capture(lambda: layer(q, iq, dec.caches, dec.batch, out=buf))
    new = build_case(p, decodes=[K16 - 97 * i for i in range(16)], prefills=[], dtype=torch.bfloat16, seed=14,
                     kv_dtype=E5M2, kv_scale="tensor", num_pages=16 * (K16 // 128 + 2) + 64, width=K16 // 128 + 2)
    dec.batch.update_(new.batch)
    q.copy_(new.q)
    iq.copy_(new.index_q)
    graph.replay()
    eager = layer(new.q, new.index_q, dec.caches, new.batch)
    torch.cuda.synchronize()
    assert torch.equal(buf[:dec.batch.num_tokens], eager), "replay differs from eager"


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
    "tp1_b64_q1_e5m2": (1, 64, 1),
    "tp1_b8_spec_q2_e5m2_slot": (1, 8, 2),
}


@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_fp8_kv_decode_step_in_cuda_graph(name: str) -> None:
    """Capture indexer + attention on fp8 K/V (e4m3, or e5m2) and an fp8 index; replay with new inputs == eager."""
    tp, n, dq = GRAPH_CASES[name]
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    pages, width = n * (K16 // 128 + 2) + 64, K16 // 128 + 2
    kw = dict(prefills=[], decode_query_len=dq, width=width, num_pages=pages, dtype=torch.bfloat16,
              index_dtype=FP8, kv_dtype=E5M2 if "_e5m2" in name else FP8,
              kv_scale="slot" if name.endswith("_slot") else "head")
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
