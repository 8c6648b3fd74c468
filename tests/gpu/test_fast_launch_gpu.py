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
inputs (data and pages) equals the plain hooks' eager step. A fallback of the
fast launcher to Triton's own launch (its warning) fails every test here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mm3
from mm3.testing.factories import make_case

from gpu_reference import assert_step_right, run_hooks_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              # a fallback to Triton's own launch on this Triton is a failure here, not a slower pass
              pytest.mark.filterwarnings("error::mm3_backends.triton.fast_launch.FastLaunchWarning")]

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
            run_hooks_step(hooks, P, case, topk, out)
            torch.cuda.synchronize()
            got.append((topk.storage.clone(), out.clone()))
        assert torch.equal(got[0][0], got[1][0]), f"{name}: top-k rows differ"
        assert torch.equal(got[0][1].view(torch.int16), got[1][1].view(torch.int16)), f"{name}: outputs differ"
        assert_step_right(case, P, got[1][0], got[1][1], name)   # and right
    assert fast_launch._DEFAULT.stats()["direct"] > before, "no launch went the direct way"


def test_fast_launch_inside_cuda_graph_capture() -> None:
    plain, fast = _hooks(False), _hooks(True)
    case = make_case(P, device="cuda", seed=3, decodes=[4000, 1000])
    T = case.batch.num_tokens
    topk = mm3.TopkBuffer.allocate(T, P.num_kv_heads, P.topk, layout="token_major", device="cuda")
    out = torch.empty_like(case.q)
    run_hooks_step(fast, P, case, topk, out)   # the Triton launches of the class, outside capture
    run_hooks_step(fast, P, case, topk, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_hooks_step(fast, P, case, topk, out)
    new = make_case(P, device="cuda", seed=4, decodes=[4000, 1000])   # new data and pages, same shapes
    case.batch.update_(new.batch)
    for mine, theirs in ((case.q, new.q), (case.index_q, new.index_q), (case.caches.k, new.caches.k),
                         (case.caches.v, new.caches.v), (case.caches.index, new.caches.index)):
        mine.copy_(theirs)
    graph.replay()
    torch.cuda.synchronize()
    ref_topk = mm3.TopkBuffer.allocate(T, P.num_kv_heads, P.topk, layout="token_major", device="cuda")
    ref_out = torch.empty_like(out)
    run_hooks_step(plain, P, new, ref_topk, ref_out)
    torch.cuda.synchronize()
    assert torch.equal(topk.storage, ref_topk.storage)
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16))


def test_prefill_steps_of_new_lengths_launch_directly() -> None:
    """A prefill step's counts and offsets change every step; the kernels leave them unspecialized
    (``tl_utils.step_kernel``), so later steps of other lengths still launch directly and write
    what Triton's launch writes."""
    from mm3_backends.triton import fast_launch

    plain, fast = _hooks(False), _hooks(True)
    steps = [[(2000, 2300)], [(1500, 5000), (300, 300)], [(700, 9000)]]
    direct = []
    for i, prefills in enumerate(steps):
        # as an engine's: one page count and one block-table width for every step (both are
        # specialized launch arguments), other lengths, requests and positions
        need = [-(-s // P.block_size) for _, s in prefills]
        case = make_case(P, device="cuda", seed=10 + i, prefills=prefills, extra_pages=80 - sum(need),
                         extra_block_columns=72 - max(need))
        T = case.batch.num_tokens
        got = []
        for hooks in (plain, fast):
            topk = mm3.TopkBuffer.allocate(4096, P.num_kv_heads, P.topk, layout="token_major", device="cuda")
            out = torch.empty(T + 3, P.num_heads, P.head_dim, dtype=case.q.dtype, device="cuda")
            run_hooks_step(hooks, P, case, topk, out)
            torch.cuda.synchronize()
            got.append((topk.storage.clone(), out.clone()))
        direct.append(fast_launch._DEFAULT.stats()["direct"])
        assert torch.equal(got[0][0], got[1][0]), f"step {i}: top-k rows differ"
        assert torch.equal(got[0][1].view(torch.int16), got[1][1].view(torch.int16)), f"step {i}: outputs differ"
        assert_step_right(case, P, got[1][0], got[1][1], f"step {i}")
    # the indexer, pair count, pair place, run and merge launches of each later step went direct (the
    # scan's tile width follows the step's segment count: a new class when it crosses a power of two)
    assert direct[1] - direct[0] >= 5 and direct[2] - direct[1] >= 5, direct
