"""The fast launch path on the GPU: the same bits as Triton's launch, also inside CUDA-graph capture.

Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_fast_launch_gpu.py -s -q

The ``cuda`` plugin's hooks are built twice from its platform, with
``Algorithms.fast_launch`` off and on. On fresh random inputs of several shape
classes (decode batch 1 and 64, a mixed step with draft tokens and a chunked
prefill, an fp8 index cache, fp8 K/V), each run twice (the second call of a
class is the direct launch), the fast hooks' top-k rows and outputs (buffers
poisoned before each call) equal the plain hooks' bit for bit, the top-k rows
pass the fp64 reference (gpu_reference: every decode token, a spread of prefill
tokens) and the outputs match it. A decode
step captured in a CUDA graph with the fast hooks and replayed on new
inputs (data and pages) equals the plain hooks' eager step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mm3
from mm3.testing.factories import make_case

from gpu_reference import attention_reference, block_scores, sample_tokens, selection_errors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

P = mm3.SparseAttentionParams.minimax_m3(tp_size=8)

CASES = {
    "decode_b1": dict(decodes=[4096]),
    "decode_b64": dict(decodes=[700 + 37 * i for i in range(64)]),
    "mixed_spec": dict(decodes=[900, 300, 2000], prefills=[(200, 1500), (7, 7)], decode_query_len=2),
    "decode_fp8_index": dict(decodes=[3000] * 8, index_dtype="float8_e4m3fn"),
    "decode_fp8_kv": dict(decodes=[2500] * 4, kv_dtype="float8_e4m3fn"),
}


def _hooks(fast: bool):  # noqa: ANN202 - the plugin's hook tuple
    from mm3_backends.cuda.plugin import PLATFORM
    from mm3_backends.triton.launch import override
    from mm3_backends.triton.plugin_factory import make_hookimpls

    return make_hookimpls(replace(PLATFORM, launch=override(PLATFORM.launch, algorithms=dict(fast_launch=fast))))


def _step(hooks, case, topk: mm3.TopkBuffer, out: torch.Tensor) -> None:  # noqa: ANN001
    T = case.batch.num_tokens
    topk.fill_(-7)
    out.fill_(float("nan"))
    rows = topk.rows(0, T)
    hooks.index_topk(index_q=case.index_q, caches=case.caches, batch=case.batch, params=P, out=rows)
    hooks.attention_forward(q=case.q, caches=case.caches, topk=rows, batch=case.batch, params=P, out=out[:T])


@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_launch_writes_the_same_bits_as_tritons_launch(name: str) -> None:
    from mm3_backends.triton import fast_launch

    plain, fast = _hooks(False), _hooks(True)
    before = fast_launch._DEFAULT.stats()["direct"]
    for seed in (1, 2):   # the second call of each class is launched directly
        case = make_case(P, device="cuda", seed=seed, **CASES[name])
        T = case.batch.num_tokens
        got = []
        for hooks in (plain, fast):
            topk = mm3.TopkBuffer.allocate(T + 5, P.num_kv_heads, P.topk, layout="token_major", device="cuda")
            out = torch.empty(T + 3, P.num_heads, P.head_dim, dtype=case.q.dtype, device="cuda")
            _step(hooks, case, topk, out)
            torch.cuda.synchronize()
            got.append((topk.storage.clone(), out.clone()))
        assert torch.equal(got[0][0], got[1][0]), f"{name}: top-k rows differ"
        assert torch.equal(got[0][1].view(torch.int16), got[1][1].view(torch.int16)), f"{name}: outputs differ"
        # and right: the fp64 reference on every decode token and a spread of prefill tokens
        sel = mm3.TopkBuffer(got[1][0], "token_major").rows(0, T)
        toks = sample_tokens(case.batch)
        errors = selection_errors(sel, block_scores(case.index_q, case.caches, case.batch, P, toks), P)
        assert not errors, "\n".join(errors[:5])
        ref = attention_reference(case.q, case.caches, sel, case.batch, P, toks)
        err = max((got[1][1][t].double() - ref[t]).abs().max().item() for t in toks)
        assert err <= 2e-2, f"{name}: {err} from the fp64 reference"
        assert torch.isnan(got[1][1][T:]).all() and (got[1][0][T:] == -7).all()   # rows past T untouched
    assert fast_launch._DEFAULT.stats()["direct"] > before, "no launch went the direct way"


def test_fast_launch_inside_cuda_graph_capture() -> None:
    plain, fast = _hooks(False), _hooks(True)
    case = make_case(P, device="cuda", seed=3, decodes=[4000, 1000])
    T = case.batch.num_tokens
    topk = mm3.TopkBuffer.allocate(T, P.num_kv_heads, P.topk, layout="token_major", device="cuda")
    out = torch.empty_like(case.q)
    _step(fast, case, topk, out)            # the Triton launches of the class, outside capture
    _step(fast, case, topk, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(fast, case, topk, out)
    new = make_case(P, device="cuda", seed=4, decodes=[4000, 1000])   # new data and pages, same shapes
    case.batch.update_(new.batch)
    for mine, theirs in ((case.q, new.q), (case.index_q, new.index_q), (case.caches.k, new.caches.k),
                         (case.caches.v, new.caches.v), (case.caches.index, new.caches.index)):
        mine.copy_(theirs)
    graph.replay()
    torch.cuda.synchronize()
    ref_topk = mm3.TopkBuffer.allocate(T, P.num_kv_heads, P.topk, layout="token_major", device="cuda")
    ref_out = torch.empty_like(out)
    _step(plain, new, ref_topk, ref_out)
    torch.cuda.synchronize()
    assert torch.equal(topk.storage, ref_topk.storage)
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16))
