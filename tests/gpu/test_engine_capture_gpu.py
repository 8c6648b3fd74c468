"""A decode step captured as engines capture it, on the GPU: the plugin's kernels and nothing else.

An engine warms the model up on a side stream, then captures with
``torch.cuda.graph(g)`` (a capture stream of its own, often a memory pool shared
between graphs), under ``torch.inference_mode()`` with its tensors made there.
Such a capture of ``mm3.SparseAttention`` must hold the same kernels as a
capture of the bare plugin hooks a step calls (its two ops, the indexer handed the
fault word: the plugin judges a step's contents in its index launch, ``judges_contents``):
no torch kernels of mm3's own; its replays must match the fp64 reference with new
inputs refilled in place; and a bad page id or position in a replayed step must be
reported by ``check_page_ids()`` without faulting the GPU.

Run on a CUDA machine (skips elsewhere)::

    pytest tests/gpu/test_engine_capture_gpu.py -q
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import pytest
import torch

import mm3
from mm3.contract.contents import NO_FAULT
from mm3.contract.hookspecs import Op
from gpu_reference import POISON_TOPK, assert_step_right, build_case

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

P = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
STEP = dict(decodes=[3000, 700, 4100], prefills=[])


def _capture(fn: Callable[[], None], pool: Any) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        fn()
    torch.cuda.synchronize()
    return g


def _kernels(g: torch.cuda.CUDAGraph) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shared_pool", [False, True], ids=["own-pool", "shared-pool"])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "plain"])
def test_an_engine_capture_runs_the_plugin_kernels_only(mode: str, shared_pool: bool, batch: int) -> None:
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
           "plain": contextlib.nullcontext}[mode]
    with ctx():
        decodes = STEP["decodes"][:batch]
        case = build_case(P, decodes=decodes, prefills=[], seed=1, num_pages=200)
        step2 = build_case(P, decodes=[d + 77 for d in decodes], prefills=[], seed=2, num_pages=200,
                           width=case.batch.block_table.shape[1])
        assert step2.caches.num_pages == case.caches.num_pages   # its table's ids fit the captured caches
        layer = mm3.SparseAttention(P, device="cuda", max_num_tokens=8, backend="cuda", cuda_graph=True)
        idx, att = layer.op_target.indexer, layer.op_target.attention
        buf = layer.topk_buffer
        out = torch.full_like(case.q, float("nan"))
        pool = torch.cuda.graph_pool_handle() if shared_pool else None

        def layer_step() -> None:
            layer(case.q, case.index_q, case.caches, case.batch, out=out)

        word = torch.full((1,), NO_FAULT, dtype=torch.int64, device="cuda")

        def hooks_step() -> None:
            rows = buf.rows(0, case.batch.num_tokens)
            # the bare hooks a step makes: the ops, the indexer judging the batch's contents into the word
            assert idx.capabilities.judges_contents
            idx.invoke(Op.INDEX_TOPK, (case.index_q, case.caches, case.batch, P, rows, word))
            att.invoke(Op.ATTENTION, (case.q, case.caches, rows, case.batch, P, out))

        g_hooks = _capture(hooks_step, pool)
        g_layer = _capture(layer_step, pool)
        got, want = _kernels(g_layer), _kernels(g_hooks)
        assert got == want, f"layer capture {got}, hooks capture {want}"
        # a replay with the next step's inputs refilled in place, into poisoned outputs
        case.q.copy_(step2.q)
        case.index_q.copy_(step2.index_q)
        case.batch.update_(step2.batch)
        buf.fill_(POISON_TOPK)
        out.fill_(float("nan"))
        g_layer.replay()
        torch.cuda.synchronize()
        # the replay read the captured caches: the reference reads them too
        assert_step_right(dataclasses.replace(step2, caches=case.caches), P, buf.storage, out, f"{mode} capture")
        layer.check_page_ids()                                   # nothing bad so far
        case.batch.block_table[0, 1] = case.caches.num_pages + 5  # a bad id in the next replay
        g_layer.replay()
        torch.cuda.synchronize()
        with pytest.raises(mm3.InputError, match=r"request 0, block 1: batch.block_table\[0, 1\] is not a page id"):
            layer.check_page_ids()
        torch.cuda.synchronize()                                  # the context is still healthy
        case.batch.block_table.copy_(step2.batch.block_table)
        case.batch.token_positions[0] -= 1                        # a position its seq_len does not give
        g_layer.replay()
        torch.cuda.synchronize()
        with pytest.raises(mm3.InputError, match=r"token 0 has a position or request that the lengths do not give"):
            layer.check_page_ids()
