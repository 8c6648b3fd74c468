"""The decode top-k and merge in the last program of their group, on the GPU (backends/triton/arrivals.py).

Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_arrivals_gpu.py -s -q

The ``cuda`` plugin's hooks are built twice from its platform, with the top-k
and the merge in the last program and as launches of their own (the merge
kernel per KV head, the code the last program runs).
On fresh random inputs of several shape classes (TP1 batch 1 at 64K, where the
last program sorts 4 rows of 512 blocks at once; TP8 at 256K, one row of 2048;
batch 64; draft tokens with a chunked prefill; fp8 index and K/V), both write
the same top-k rows and the same output bits, twice in a row (the second
launch starts from the counters the first left), the counters are all zero
after, and the rows pass the fp64 reference. A decode step captured in a CUDA
graph (on torch's capture stream, after an eager step on the current one) uses
the fused path and, replayed 6 times on new inputs, equals the separate
launches' eager step each time. The counters and the decode scratch are
allocated outside a memory pool the calling thread is routed to (what
torch.compile's CUDA-graph trees do during warm-up runs).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mm3
from mm3.testing.factories import make_case

from gpu_reference import assert_replays_match, assert_step_right, run_hooks_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TP1 = mm3.SparseAttentionParams.minimax_m3(tp_size=1)
TP8 = mm3.SparseAttentionParams.minimax_m3(tp_size=8)

CASES = {
    "tp1_b1_64k": (TP1, dict(decodes=[65536 - 77])),
    "tp1_q4_b2": (TP1, dict(decodes=[20000, 3000], decode_query_len=4)),
    "tp8_b1_256k": (TP8, dict(decodes=[1 << 18])),
    "tp8_b64": (TP8, dict(decodes=[700 + 37 * i for i in range(64)])),
    "tp8_mixed_spec": (TP8, dict(decodes=[900, 300, 2000], prefills=[(200, 1500), (7, 7)], decode_query_len=2,
                                 padding_decodes=1)),
    "tp1_fp8": (TP1, dict(decodes=[3000] * 3, index_dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn")),
}


def _hooks(last: bool):  # noqa: ANN202 - the plugin's hook tuple
    from mm3_backends.cuda.plugin import PLATFORM
    from mm3_backends.triton.launch import override
    from mm3_backends.triton.plugin_factory import make_hookimpls

    algos = dict(merge_in_last_program=last, topk_in_last_program=last)
    return make_hookimpls(replace(PLATFORM, launch=override(PLATFORM.launch, algorithms=algos)))


@pytest.fixture(autouse=True)
def _merge_per_kv_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """The separate merge as the per-KV-head kernel, whose code the last program runs (the per-row
    kernel that small grids take sums the splits in another order: not the same bits)."""
    from mm3_backends.triton.launch import LaunchConfig

    monkeypatch.setattr(LaunchConfig, "use_merge_per_row", lambda self, num_tokens, num_kv_heads: False)


def _all_counters_zero() -> bool:
    """Every arrival counter back at zero (a streamed step's ready flags stay raised: not counters)."""
    from mm3_backends.triton import arrivals

    kept = [*arrivals._COUNTERS.items(), *arrivals._GRAPH_COUNTERS.items()]
    return all(int(c.abs().sum()) == 0 for key, c in kept if c.is_cuda and key[-1] != "ready")


@pytest.mark.parametrize("name", sorted(CASES))
def test_last_program_writes_the_same_bits_as_separate_launches(name: str) -> None:
    p, make = CASES[name]
    separate, fused = _hooks(False), _hooks(True)
    for seed in (1, 2):
        case = make_case(p, device="cuda", seed=seed, **make)
        T = case.batch.num_tokens
        got = []
        for hooks in (separate, fused, fused):
            topk = mm3.TopkBuffer.allocate(T + 5, p.num_kv_heads, p.topk, layout="token_major", device="cuda")
            out = torch.empty(T + 3, p.num_heads, p.head_dim, dtype=case.q.dtype, device="cuda")
            run_hooks_step(hooks, p, case, topk, out)
            torch.cuda.synchronize()
            got.append((topk.storage.clone(), out.clone()))
        assert _all_counters_zero(), f"{name}: a counter was left non-zero"
        for i in (1, 2):
            assert torch.equal(got[0][0], got[i][0]), f"{name}: top-k rows differ (fused run {i})"
            assert torch.equal(got[0][1].view(torch.int16), got[i][1].view(torch.int16)), f"{name}: outputs differ"
        assert_step_right(case, p, got[1][0], got[1][1], name)


def test_graph_capture_uses_the_last_program_and_replays_right(monkeypatch: pytest.MonkeyPatch) -> None:
    from mm3_backends.triton import arrivals, attention, indexer

    separate, fused = _hooks(False), _hooks(True)
    p = TP1
    shape = dict(decodes=[4000, 1000, 65000])
    case = make_case(p, device="cuda", seed=3, **shape)
    T = case.batch.num_tokens
    topk = mm3.TopkBuffer.allocate(T, p.num_kv_heads, p.topk, layout="token_major", device="cuda")
    out = torch.empty_like(case.q)
    run_hooks_step(fused, p, case, topk, out)   # eager on the current stream: allocates the counters
    torch.cuda.synchronize()
    handed: list = []
    real = arrivals.arrival_counters

    def spy(device, n, role="topk"):  # noqa: ANN001, ANN202
        c = real(device, n, role)
        handed.append(c)
        return c

    monkeypatch.setattr(attention, "arrival_counters", spy)
    monkeypatch.setattr(indexer, "arrival_counters", spy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):               # torch's own capture stream
        run_hooks_step(fused, p, case, topk, out)
    assert len(handed) == 2 and all(c is not None for c in handed), "the capture fell back to separate launches"
    # new data and pages, same shapes
    assert_replays_match(graph, case, p, topk, out, separate,
                         lambda seed: make_case(p, device="cuda", seed=seed, **shape), range(4, 10))
    assert _all_counters_zero()


def test_kept_buffers_are_not_carved_from_a_pool_the_calling_thread_is_routed_to() -> None:
    """Why the counters and the decode scratch are allocated by a thread of their own (arrivals.in_own_thread):
    a pool routing (torch.compile's CUDA-graph trees during a warm-up run; ``torch.cuda.use_mem_pool``
    here) takes every allocation of the calling thread, so a buffer allocated there and kept for good
    would be memory the pool's owner takes back. Inside the routing, a tensor the calling thread
    allocates is in the pool; the counters and the scratch are not."""
    if not hasattr(torch.cuda, "use_mem_pool") or not hasattr(torch.cuda.MemPool, "snapshot"):
        pytest.skip("this PyTorch has no public memory-pool routing to show it with")
    from mm3_backends.triton import arrivals, scratch

    dev = torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        routed = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
        counters = arrivals._zeros(dev, 1 << 20)
        kept = scratch._allocate(dev, 1 << 20, torch.float32)
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]

    def in_pool(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in segments)
    assert in_pool(routed), "the premise: the calling thread's allocation is routed into the pool"
    assert not in_pool(counters), "the arrival counters were carved from the routed pool"
    assert not in_pool(kept), "the kept scratch was carved from the routed pool"
