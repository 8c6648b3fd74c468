"""No drop-in call reads the device from the host in steady state: every vLLM function, mixed batches.

vLLM captures its MiniMax-M3 ops in CUDA graphs with the metadata it passes
(device tensors and Python ints), and runs them eagerly without a device sync.
mm3 may read a batch's contents on the host once, at the first call of each
shape class (docs/errors.md §2.6); every later call of the class must not read
a tensor's value on the host. On the CPU no copy is visible, so the reads are
caught where they start: a tensor's value turned into a Python number
(``aten._local_scalar_dense``: ``int(t)``, ``bool(t)``, ``t.item()``) or a
tensor handed to the host (``tolist``, ``numpy``, ``cpu``, ``to("cpu")``).

The CPU block tables stand in for device ones (``on_host`` is patched: a host
table is checked on the host every step, by design). cpu_ref is a
reference that plans its work from host lengths (it is not CUDA-graph safe and
says so); its own frames are let through, so its run proves the drop-in and the
step's boundary read nothing, while the cuda and rocm runs prove the whole path
(tests/host_reads.py is the mode). On a GPU, tests/gpu/test_dropin_graphs_gpu.py asks CUDA itself
(``torch.cuda.set_sync_debug_mode("error")``) and captures every function.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

import mm3
from host_reads import HostRead, NoHostReads
from mm3.integrations import targets
from mm3.integrations import vllm as ops
from mm3.runtime import step
from mm3.runtime.config import Settings
from mm3_backends.cpu_ref import plugin as cpu_ref_plugin
from vllm_steps import VllmStep, assert_step_right, vllm_step

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4, init_blocks=1, local_blocks=1)
#: decodes (and a padding one), prefills with and without a prefix
MIXED = dict(decodes=(70, 33), padding=1, prefills=((9, 40), (3, 3)))
#: cpu_ref's own frames: a reference that plans its work from host lengths
CPU_REF = os.path.dirname(cpu_ref_plugin.__file__) + os.sep


def test_the_checker_catches_each_kind_of_read() -> None:
    t = torch.arange(4, dtype=torch.int32)
    for read in (lambda: t.tolist(), lambda: int(t[0]), lambda: bool(t.any()), lambda: t.numpy(),
                 lambda: t.cpu(), lambda: t.to("cpu"), lambda: t.sum().item()):
        with pytest.raises(HostRead), NoHostReads():
            read()
    with NoHostReads():
        (t + 1).to(torch.int64).sum()


def _calls(s: VllmStep) -> dict[str, Callable[[], Any]]:
    """Each drop-in function on its half of ``s`` (decodes or prefills), as vLLM's layer calls it."""
    c, p, b = s.case, s.case.params, s.case.batch
    nd, td, H, dql = s.num_decodes, s.decode_tokens, p.num_kv_heads, s.dql
    view = s.topk_view
    qsl = b.query_start_loc[nd:] - b.query_start_loc[nd]
    sl, ctx, bt = s.seq_lens[nd:], b.context_lens[nd:], s.block_table[nd:]
    mq, ms = b.max_prefill_query_len, b.max_seq_len
    score_out = torch.empty(H, td, 16)
    scores: dict[str, torch.Tensor] = {}

    def index_score() -> None:
        scores["prefill"] = ops.minimax_m3_index_score(c.index_q[td:], c.caches.index, bt, qsl, sl, ctx, mq, ms, H)

    return {
        "minimax_m3_index_decode": lambda: ops.minimax_m3_index_decode(
            c.index_q[:td], c.caches.index, s.block_table[:nd], s.seq_lens[:nd], ms, p.topk, p.init_blocks,
            p.local_blocks, H, dql, 4, out=view[:, :td], score_out=score_out),
        "minimax_m3_index_decode_score": lambda: ops.minimax_m3_index_decode_score(
            c.index_q[:td], c.caches.index, s.block_table[:nd], s.seq_lens[:nd], ms, p.init_blocks, p.local_blocks,
            H, dql, 4, score_out=score_out),
        "minimax_m3_sparse_attn_decode": lambda: ops.minimax_m3_sparse_attn_decode(
            c.q[:td], s.kv_cache, view[:, :td], s.block_table[:nd], s.seq_lens[:nd], H, p.softmax_scale,
            s.output[:td], dql),
        "minimax_m3_index_score": index_score,
        "minimax_m3_index_topk": lambda: ops.minimax_m3_index_topk(
            scores["prefill"], qsl, ctx, mq, p.topk, p.init_blocks, p.local_blocks, out=view[:, td:],
            block_size=p.block_size),
        "minimax_m3_sparse_attn": lambda: ops.minimax_m3_sparse_attn(
            c.q[td:], s.kv_cache, view[:, td:], bt, qsl, sl, ctx, mq, H, p.softmax_scale, s.output[td:]),
    }


@pytest.mark.parametrize("dql", [1, 2], ids=["mixed", "speculative_mixed"])
@pytest.mark.parametrize("backend", [
    "cpu_ref",
    pytest.param("cuda", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                  reason="the Triton plugins on CPU tensors need the interpreter")),
    pytest.param("rocm", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                  reason="the Triton plugins on CPU tensors need the interpreter")),
])
def test_every_dropin_function_reads_nothing_on_the_host_after_its_first_call(
        backend: str, dql: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step, "on_host", lambda batch: False)   # the CPU tables stand in for device ones
    targets.configure(Settings(backend=backend, check_contracts="first"))   # the production default
    try:
        s = vllm_step(P, **MIXED, dql=dql, seed=21)
        calls = _calls(s)
        for fn in calls.values():   # the first call of each class: the one host check, and the guard
            fn()
        exempt = (CPU_REF,) if backend == "cpu_ref" else ()
        for name, fn in calls.items():
            with NoHostReads(*exempt):
                try:
                    fn()
                except HostRead as e:
                    raise AssertionError(f"{name} on {backend}: {e}") from e
        targets.check_page_ids()
        assert_step_right(s)
        used = {(x.indexer.name, x.attention.name, getattr(x.scorer, "name", None)) for x in targets.selections()}
        assert used == {(backend, backend, backend)}, used
    finally:
        targets.configure()
