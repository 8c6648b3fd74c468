"""The streamed decode step on the GPU: the attention running beside the indexer (``Algorithms.streamed_decode``).

Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_streamed_decode_gpu.py -s -q

The ``cuda`` plugin's hooks are built streamed and with separate launches (the
top-k kernel of its own; the same merge rule). On fresh random inputs of several shape
classes (TP1 and TP8 at batch 64, draft tokens with a chunked prefill, fp8
index and K/V, a batch where the attention has more items than programs),
the streamed step writes the separate launches' top-k rows and output bits,
three times in a row (every step lowers the flags the one before raised), and
passes the fp64 reference. An indexer call whose attention never ran leaves
its flags raised: the next step must not read its stale top-k. A step captured
in a CUDA graph streams and, replayed on new inputs, equals the eager step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mm3
from mm3.testing.factories import make_case

from gpu_reference import assert_replays_match, assert_step_right, build_case, run_hooks_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TP1 = mm3.SparseAttentionParams.minimax_m3(tp_size=1)
TP8 = mm3.SparseAttentionParams.minimax_m3(tp_size=8)

CASES = {
    "tp1_b64": (TP1, dict(decodes=[3000 + 977 * i for i in range(64)])),
    "tp8_b64": (TP8, dict(decodes=[700 + 1531 * i for i in range(64)])),
    "tp8_b300": (TP8, dict(decodes=[500 + 97 * i for i in range(300)])),
    "tp8_mixed_spec": (TP8, dict(decodes=[900 + 300 * i for i in range(20)], prefills=[(200, 1500)],
                                 decode_query_len=2, padding_decodes=1)),
    "tp1_fp8": (TP1, dict(decodes=[5000 + 211 * i for i in range(32)], index_dtype="float8_e4m3fn",
                          kv_dtype="float8_e4m3fn")),
}


def _case(p: mm3.SparseAttentionParams, shape: dict, seed: int):  # noqa: ANN202 - a GpuCase
    """``shape``'s step with its caches drawn on the GPU (``make_case`` draws them on the CPU: minutes at batch 64)."""
    kw = {k: getattr(torch, v) if k.endswith("dtype") else v for k, v in shape.items()}
    return build_case(p, prefills=kw.pop("prefills", []), seed=seed, **kw)


def _hooks(streamed: bool):  # noqa: ANN202 - the plugin's hook tuple
    from mm3_backends.cuda.plugin import PLATFORM
    from mm3_backends.triton.launch import override
    from mm3_backends.triton.plugin_factory import make_hookimpls

    # the same merge rule in both (the last program's merge and the per-KV-head kernel share their
    # code; the per-row kernel sums in another order), the top-k as a launch of its own
    algos = dict(streamed_decode=streamed, topk_in_last_program=None if streamed else False)
    return make_hookimpls(replace(PLATFORM, launch=override(PLATFORM.launch, algorithms=algos)))


def _launched(fn):  # noqa: ANN001, ANN202 - the kernel names one call launches
    from mm3_backends.triton import attention, fast_launch, indexer

    names: list[str] = []
    real = fast_launch.launch

    def recording(kernel, grid, args, kwargs, *rest):  # noqa: ANN001, ANN202
        names.append(kernel.__name__ + ("[stream]" if kwargs.get("STREAM") else ""))
        real(kernel, grid, args, kwargs, *rest)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(indexer, "launch", recording)
        mp.setattr(attention, "launch", recording)
        fn()
    return names


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_step_equals_the_separate_launches(name: str) -> None:
    p, shape = CASES[name]
    streamed, separate = _hooks(True), _hooks(False)
    T = None
    for rep in range(3):
        case = _case(p, shape, 100 + rep)
        T = case.batch.num_tokens
        bufs = [mm3.TopkBuffer.allocate(T, p.num_kv_heads, p.topk, layout="token_major", device="cuda")
                for _ in range(2)]
        outs = [torch.empty_like(case.q) for _ in range(2)]
        names = _launched(lambda: run_hooks_step(streamed, p, case, bufs[0], outs[0]))
        assert "_decode_score_kernel[stream]" in names and "_decode_attention_flat_kernel[stream]" in names, names
        run_hooks_step(separate, p, case, bufs[1], outs[1])
        torch.cuda.synchronize()
        assert torch.equal(bufs[0].storage, bufs[1].storage), f"{name} step {rep}: top-k rows differ"
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"{name} step {rep}: outputs differ"
        if rep == 0:
            assert_step_right(case, p, bufs[0].storage, outs[0], name)


def test_flags_an_unclaimed_indexer_left_raised_are_lowered_first() -> None:
    """An indexer call with no attention after it leaves every flag raised; the next streamed step, on new
    inputs, must wait for its own top-k, not read the stale one (a race the same inputs could not show)."""
    p, shape = CASES["tp8_b64"]
    streamed, separate = _hooks(True), _hooks(False)
    for rep in range(2):
        old = _case(p, shape, 200 + rep)
        new = _case(p, shape, 300 + rep)
        T = new.batch.num_tokens
        buf = mm3.TopkBuffer.allocate(T, p.num_kv_heads, p.topk, layout="token_major", device="cuda")
        streamed.index_topk(index_q=old.index_q, caches=old.caches, batch=old.batch, params=p, out=buf.rows(0, T))
        out = torch.empty_like(new.q)
        run_hooks_step(streamed, p, new, buf, out)
        ref_buf = mm3.TopkBuffer.allocate(T, p.num_kv_heads, p.topk, layout="token_major", device="cuda")
        ref = torch.empty_like(new.q)
        run_hooks_step(separate, p, new, ref_buf, ref)
        torch.cuda.synchronize()
        assert torch.equal(buf.storage, ref_buf.storage) and torch.equal(out.view(torch.int16), ref.view(torch.int16))


def test_a_captured_streamed_step_replays_right() -> None:
    p, shape = CASES["tp1_b64"]
    streamed, separate = _hooks(True), _hooks(False)
    case = make_case(p, device="cuda", seed=7, **shape)
    T = case.batch.num_tokens
    topk = mm3.TopkBuffer.allocate(T, p.num_kv_heads, p.topk, layout="token_major", device="cuda")
    out = torch.empty_like(case.q)
    run_hooks_step(streamed, p, case, topk, out)   # eager: allocates the counters and flags
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        names = _launched(lambda: run_hooks_step(streamed, p, case, topk, out))
    assert "_decode_attention_flat_kernel[stream]" in names, names
    assert_replays_match(graph, case, p, topk, out, separate,
                         lambda seed: make_case(p, device="cuda", seed=seed, **shape), range(8, 11))
