"""mm3.integrations.vllm on the GPU with the cuda backend, captured in a CUDA graph as vLLM captures.

vLLM's MiniMax-M3 layer at M3's TP1 shapes (4 KV heads: a layout mix-up shows),
its tensors in vLLM's conventions (one ``[num_blocks, Hkv, 128, 2 * head_dim]`` KV
cache, token-major top-k storage behind a head-major view), made under
``torch.inference_mode()``. The six functions are captured in one graph (warm-up
on a side stream, then ``torch.cuda.graph``): the decode indexer and attention,
the decode scores, the prefill scores, the top-k chosen from them and the
prefill attention. The graph is replayed on new queries and sequence lengths
refilled in place. Everything is checked against the fp64 references: every decode
token and a spread of prefill tokens, the selection tie-tolerantly, the output
within bf16's tolerance, the rows past the step untouched. The same with
vLLM's ``fp8_e5m2`` KV cache and per-tensor scales (``k_scale``/``v_scale``).

Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_vllm_gpu.py -q
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import mm3
from gpu_reference import POISON_TOPK, assert_step_right, block_scores, build_case, combined_kv, sample_tokens
from mm3.integrations import targets
from mm3.integrations import vllm as ops
from mm3.runtime.config import Settings

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

P = mm3.SparseAttentionParams.minimax_m3(tp_size=1)
DECODES, PREFILLS = [3000, 700, 4100], [(300, 2000), (64, 64)]


def _capture(fn) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e5m2], ids=["bf16_kv", "e5m2_kv"])
@pytest.mark.parametrize("dql", [1, 2])
def test_the_six_functions_in_a_cuda_graph(dql: int, kv_dtype: Optional[torch.dtype]) -> None:
    targets.configure(Settings(backend="cuda"))
    try:
        with torch.inference_mode():
            _run(dql, kv_dtype)
    finally:
        targets.configure()


def _run(dql: int, kv_dtype: Optional[torch.dtype] = None) -> None:
    case = build_case(P, decodes=DECODES, prefills=PREFILLS, decode_query_len=dql, padding_decodes=1, seed=3,
                      kv_dtype=kv_dtype, kv_scale="head")
    # vLLM's layer scales of an fp8 cache: one element each (None for a 16-bit cache)
    ks, vs = ((case.caches.k_scale[:1].clone(), case.caches.v_scale[:1].clone()) if case.caches.kv_scaled
              else (None, None))
    b, H, K = case.batch, P.num_kv_heads, P.topk
    nd, td, T = b.num_decodes, b.num_decode_tokens, b.num_tokens
    kv = combined_kv(case.caches)
    index = case.caches.index
    # vLLM's persistent tensors: the graph reads and writes them in place
    q = case.q.clone()
    iq = case.index_q.clone()
    sl = b.seq_lens.clone()
    bt = b.block_table.clone()
    qsl_pf = (b.query_start_loc[nd:] - b.query_start_loc[nd]).clone()
    ctx_pf = b.context_lens[nd:].clone()
    storage = torch.full((T + 5, H, K), POISON_TOPK, dtype=torch.int32, device="cuda")
    view = storage.permute(1, 0, 2)
    out = torch.full((T + 5, P.num_heads, P.head_dim), float("nan"), dtype=q.dtype, device="cuda")
    max_seq = 8192
    dscore = torch.empty((H, td, 64), dtype=torch.float32, device="cuda")
    mq = max(q for q, _ in PREFILLS)

    def step() -> None:
        ops.minimax_m3_index_decode(iq[:td], index, bt[:nd], sl[:nd], max_seq, K, P.init_blocks, P.local_blocks,
                                    H, dql, 4, out=view[:, :td])
        ops.minimax_m3_sparse_attn_decode(q[:td], kv, view[:, :td], bt[:nd], sl[:nd], H, P.softmax_scale,
                                          out[:td], dql, ks, vs)
        ops.minimax_m3_index_decode_score(iq[:td], index, bt[:nd], sl[:nd], max_seq, P.init_blocks,
                                          P.local_blocks, H, dql, 4, score_out=dscore)
        score = ops.minimax_m3_index_score(iq[td:T], index, bt[nd:], qsl_pf, sl[nd:], ctx_pf, mq, max_seq, H)
        ops.minimax_m3_index_topk(score, qsl_pf, ctx_pf, mq, K, P.init_blocks, P.local_blocks, out=view[:, td:T])
        ops.minimax_m3_sparse_attn(q[td:T], kv, view[:, td:T], bt[nd:], qsl_pf, sl[nd:], ctx_pf, mq, H,
                                   P.softmax_scale, out[td:T], ks, vs)

    g = _capture(step)
    chosen = {x.attention.name for x in targets.selections()}
    assert chosen == {"cuda"}, chosen
    # the next step: new queries, each real decode one token further (its cache slots hold keys already)
    nxt = build_case(P, decodes=DECODES, prefills=PREFILLS, decode_query_len=dql, padding_decodes=1, seed=4)
    q.copy_(nxt.q)
    iq.copy_(nxt.index_q)
    lens = b.seq_lens_host
    new = [s - 1 if (r < nd and s) else s for r, s in enumerate(lens)]
    sl.copy_(torch.tensor(new, dtype=torch.int32))
    storage.fill_(POISON_TOPK)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    batch = mm3.BatchMetadata.build(list(b.query_lens), new, bt, block_size=P.block_size, num_decodes=nd,
                                    decode_query_len=dql, device="cuda")
    caches = case.caches
    if ks is not None:     # the reference reads the scales the calls were given: the one element of each
        caches = mm3.PagedKVCache(caches.k, caches.v, caches.index, ks, vs)
    step_case = type(case)(P, q, iq, caches, batch)
    assert_step_right(step_case, P, storage, out, f"vLLM drop-in, dql={dql}", layout="token_major")
    # the decode scores (the cuda backend's index_scores) against the fp64 reference's, forced blocks included
    ref = block_scores(iq, case.caches, batch, P, [t for t in sample_tokens(batch) if t < td])
    for t, S in ref.items():
        nb = S.shape[1]
        assert torch.allclose(dscore[:, t, :nb].double().cpu(), S, rtol=1e-4, atol=1e-3), t
