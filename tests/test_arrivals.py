"""The decode top-k and merge done by the last program of their group (backends/triton/arrivals.py).

Under Triton's interpreter: the fused launches against the separate top-k and
merge kernels (bit for bit: the same code computes both) and against the fp64
oracle, on mixed batches with speculative rows and padding, in both top-k
layouts; the counters left at zero after every launch; the fallback when no
counters can be had (a CUDA graph capture that would need to allocate them);
a captured step running the merge of its eager step (the same bits).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3_backends.triton.launch import override

from decode_steps import assert_decode_step_right, run_decode_step

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

SEPARATE = dict(algorithms=dict(merge_in_last_program=False, topk_in_last_program=False))


def _run(cfg: Any, case: Any, p: SparseAttentionParams, layout: str) -> tuple[torch.Tensor, torch.Tensor, list]:
    """:func:`decode_steps.run_decode_step` with the launched kernels' names only."""
    sel, out, launched = run_decode_step(cfg, case, p, layout)
    return sel, out, [name for name, *_ in launched]


def _counters_sum() -> int:
    from mm3_backends.triton.arrivals import arrival_counters

    return int(arrival_counters(torch.device("cpu"), 1).sum())


@pytest.mark.parametrize("layout", ["token_major", pytest.param("head_major", marks=pytest.mark.slow)])
@pytest.mark.parametrize("q_len,h,g", [(1, 2, 4), pytest.param(3, 1, 8, marks=pytest.mark.slow),   # slow: the
                                       pytest.param(2, 2, 3, marks=pytest.mark.slow)])             # interpreter's
def test_last_program_matches_separate_launches(layout: str, q_len: int, h: int, g: int) -> None:
    """Same top-k and bit-identical outputs as the separate kernels, two launches fewer, counters back to 0."""
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    p = SparseAttentionParams(num_heads=h * g, num_kv_heads=h, head_dim=32, num_index_heads=h, index_head_dim=32,
                              block_size=16, topk=4, init_blocks=1)
    case = make_case(p, decodes=[150, 17, 61, 300], decode_query_len=q_len, padding_decodes=1,
                     prefills=[(9, 90)], dtype="float16", index_dtype="float16", seed=11 + q_len)
    # several splits per (token, KV head); the top-k and merge always in the last program
    fused = override(base, target_programs=96, algorithms=dict(merge_in_last_program=True, topk_in_last_program=True))
    sel_f, out_f, launched_f = _run(fused, case, p, layout)
    assert _counters_sum() == 0
    # the separate merge as the per-KV-head kernel, whose code (merge_splits) the last program runs
    # (the per-row kernel sums the splits in another order: the same bits only by chance)
    separate = override(fused, **SEPARATE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(separate), "use_merge_per_row", lambda self, num_tokens, num_kv_heads: False)
        sel_s, out_s, launched_s = _run(separate, case, p, layout)
    assert "_decode_topk_kernel" not in launched_f and "_decode_topk_kernel" in launched_s
    assert "_merge_kernel" in launched_s and not [n for n in launched_f if n.startswith("_merge")]
    assert torch.equal(sel_f, sel_s)
    T = case.batch.num_tokens
    assert torch.equal(out_f[:T], out_s[:T])
    assert_decode_step_right(sel_f, out_f, case, p)
    # twice in a row: the second launch starts from the counters the first left (all zero)
    sel_2, out_2, _ = _run(fused, case, p, layout)
    assert torch.equal(sel_2, sel_f) and torch.equal(out_2[:T], out_f[:T])
    assert _counters_sum() == 0


def test_no_counters_falls_back_to_the_separate_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """When no counters can be had (a capture that would allocate), the top-k and merge launch on their own."""
    from mm3_backends.triton import arrivals, attention, indexer
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    p = SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4)
    case = make_case(p, decodes=[150, 61], dtype="float16", index_dtype="float16", seed=3)
    cfg = override(base, target_programs=32, algorithms=dict(merge_in_last_program=True, topk_in_last_program=True))
    sel_f, out_f, _ = _run(cfg, case, p, "token_major")
    monkeypatch.setattr(attention, "arrival_counters", lambda device, n, role="topk": None)
    monkeypatch.setattr(indexer, "arrival_counters", lambda device, n, role="topk": None)
    sel_n, out_n, launched = _run(cfg, case, p, "token_major")
    assert "_decode_topk_kernel" in launched and any(n.startswith("_merge") for n in launched)
    assert torch.equal(sel_f, sel_n) and torch.equal(out_f, out_n)
    assert arrivals.arrival_counters(torch.device("cpu"), 1) is not None


def test_counters_grow_but_never_move_a_buffer_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A larger need replaces the buffer (zeroed) and keeps the old one alive; a capture never allocates."""
    from mm3_backends.triton import arrivals

    for name, empty in (("_COUNTERS", {}), ("_GRAPH_COUNTERS", {}), ("_KEEP", [])):   # other tests' sizes
        monkeypatch.setattr(arrivals, name, empty)
    dev = torch.device("cpu")
    small = arrivals.arrival_counters(dev, 4)
    assert small is not None and small.numel() >= arrivals.MIN_COUNTERS
    big = arrivals.arrival_counters(dev, arrivals.MIN_COUNTERS + 1)
    assert big is not None and big.numel() >= arrivals.MIN_COUNTERS + 1 and int(big.sum()) == 0
    assert any(t is small for t in arrivals._KEEP)
    graph = arrivals._GRAPH_COUNTERS[(dev, "topk")]
    assert graph.numel() >= big.numel() and graph is not big and int(graph.sum()) == 0
    monkeypatch.setattr(arrivals, "capturing", lambda device: True)
    assert arrivals.arrival_counters(dev, 4 * big.numel()) is None
    assert arrivals.arrival_counters(dev, 4) is big
    # a capture on a stream (here: a thread) that never ran eagerly gets the device's graph counters
    got: list = []
    thread = threading.Thread(target=lambda: got.append(arrivals.arrival_counters(dev, 4)))
    thread.start()
    thread.join()
    assert got[0] is graph


def test_in_own_thread_runs_elsewhere_returns_the_result_and_raises_the_error() -> None:
    """The helper GPU counters and scratch are allocated through (graph trees pool the calling
    thread's allocations): another thread runs it, its result comes back, its error is raised here."""
    from mm3_backends.triton import arrivals

    me = threading.get_ident()
    assert arrivals.in_own_thread(threading.get_ident) != me
    with pytest.raises(ValueError, match="boom"):
        arrivals.in_own_thread(lambda: (_ for _ in ()).throw(ValueError("boom")))


@pytest.mark.parametrize("target_programs,decodes", [(64, [150]), (96, [150, 17, 61, 300]), (16, [90, 40, 70])])
def test_a_captured_step_runs_the_merge_of_its_eager_step(monkeypatch: pytest.MonkeyPatch, target_programs: int,
                                                          decodes: list) -> None:
    """By the rules (``None``), a step under capture and the same step eagerly launch the same merge
    (kernel or last program: they sum the splits in other orders) and write the same bits; only the
    top-k's place may differ (its bits never do). The H200 caught eager small grids merging in the
    last program while their graphs launched the per-row kernel."""
    from mm3_backends.triton import arrivals, scratch
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    p = SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=8)
    case = make_case(p, decodes=decodes, dtype="float16", index_dtype="float16", seed=5)
    cfg = override(base, target_programs=target_programs,
                   algorithms=dict(merge_in_last_program=None, topk_in_last_program=None))
    sel_e, out_e, launched_e = _run(cfg, case, p, "token_major")
    monkeypatch.setattr(arrivals, "capturing", lambda device: True)
    monkeypatch.setattr(scratch, "capturing", lambda device: True)
    sel_c, out_c, launched_c = _run(cfg, case, p, "token_major")
    merges = [[n for n in launched if n.startswith("_merge")] for launched in (launched_e, launched_c)]
    assert merges[0] == merges[1], f"eager merges {merges[0]}, captured {merges[1]}"
    T = case.batch.num_tokens
    assert torch.equal(sel_e, sel_c) and torch.equal(out_e[:T], out_c[:T])
