"""Every vLLM drop-in function on the cuda backend: no device sync after its first call, and captured in a CUDA graph.

vLLM's full-graph modes capture whole steps (decodes, prefills, mixed batches,
speculative decodes) with the metadata it passes: device tensors and Python
ints. Each step here calls the six functions as vLLM's MiniMax-M3 layer does
(decode half: ``minimax_m3_index_decode``, ``minimax_m3_index_decode_score``,
``minimax_m3_sparse_attn_decode``; prefill half: ``minimax_m3_index_score`` ->
``minimax_m3_index_topk``, ``minimax_m3_sparse_attn``), at M3's TP1 shapes.

* After one eager call of the step (the one host check of each shape class,
  and the guard's first check), the same step runs again under
  ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host copy or
  synchronisation inside a call raises.
* The step is captured in one CUDA graph (warm-up on a side stream), replayed
  on new queries and decode lengths refilled in place, and checked against the
  fp64 references: every decode token and a spread of prefill tokens, the
  selections, the outputs, both block-score tensors, the rows past the step
  untouched.

The CPU counterpart (tests/test_dropin_no_host_reads.py) proves the same
without a GPU by catching host reads where they start. Run on a CUDA machine
(skips elsewhere)::

    pytest tests/gpu/test_dropin_graphs_gpu.py -q
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mm3
from gpu_reference import (POISON_TOPK, assert_step_right, block_scores, build_case, capture, combined_kv,
                           sample_tokens)
from mm3.integrations import targets
from mm3.integrations import vllm as ops
from mm3.runtime.config import Settings

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

P = mm3.SparseAttentionParams.minimax_m3(tp_size=1)
UNFORCED = P.model_copy(update={"init_blocks": 0, "local_blocks": 0})
DECODES, PREFILLS = [3000, 700, 4100], [(300, 2000), (64, 64)]
#: name -> (decode seq_lens, prefills, decode query length)
STEPS = {
    "decode": (DECODES, [], 1),
    "speculative_decode": (DECODES, [], 2),
    "prefill": ([], PREFILLS, 1),
    "mixed": (DECODES[:2], PREFILLS, 1),
    "speculative_mixed": (DECODES[:2], PREFILLS, 3),
}
MAX_SEQ = 8192


class VllmStep:
    """One step's persistent tensors, as vLLM's layer holds them, and the six calls on them."""

    def __init__(self, name: str, seed: int = 3) -> None:
        decodes, prefills, dql = STEPS[name]
        self.case = case = build_case(P, decodes=decodes, prefills=prefills, decode_query_len=dql,
                                      padding_decodes=1 if decodes else 0, seed=seed)
        b, H, K = case.batch, P.num_kv_heads, P.topk
        self.dql, self.nd, self.td, self.T = dql, b.num_decodes, b.num_decode_tokens, b.num_tokens
        self.kv = combined_kv(case.caches)
        self.q, self.iq = case.q.clone(), case.index_q.clone()
        self.sl, self.bt = b.seq_lens.clone(), b.block_table.clone()
        nd = self.nd
        self.qsl = (b.query_start_loc[nd:] - b.query_start_loc[nd]).clone()
        self.ctx = b.context_lens[nd:].clone()
        self.mq = max((q for q, _ in prefills), default=0)
        self.storage = torch.full((self.T + 5, H, K), POISON_TOPK, dtype=torch.int32, device="cuda")
        self.view = self.storage.permute(1, 0, 2)
        self.out = torch.full((self.T + 5, P.num_heads, P.head_dim), float("nan"), dtype=self.q.dtype, device="cuda")
        self.dscore = torch.empty((H, self.td, MAX_SEQ // P.block_size), dtype=torch.float32, device="cuda")
        self.scores: dict[str, torch.Tensor] = {}

    def run(self) -> None:
        H, K, nd, td, T, dql = P.num_kv_heads, P.topk, self.nd, self.td, self.T, self.dql
        iq, bt, sl, view = self.iq, self.bt, self.sl, self.view
        if nd:
            ops.minimax_m3_index_decode(iq[:td], self.case.caches.index, bt[:nd], sl[:nd], MAX_SEQ, K, P.init_blocks,
                                        P.local_blocks, H, dql, 4, out=view[:, :td])
            ops.minimax_m3_index_decode_score(iq[:td], self.case.caches.index, bt[:nd], sl[:nd], MAX_SEQ,
                                              P.init_blocks, P.local_blocks, H, dql, 4, score_out=self.dscore)
            ops.minimax_m3_sparse_attn_decode(self.q[:td], self.kv, view[:, :td], bt[:nd], sl[:nd], H, P.softmax_scale,
                                              self.out[:td], dql)
        if T > td:
            self.scores["prefill"] = ops.minimax_m3_index_score(iq[td:T], self.case.caches.index, bt[nd:], self.qsl,
                                                                sl[nd:], self.ctx, self.mq, MAX_SEQ, H)
            ops.minimax_m3_index_topk(self.scores["prefill"], self.qsl, self.ctx, self.mq, K, P.init_blocks,
                                      P.local_blocks, out=view[:, td:T])
            ops.minimax_m3_sparse_attn(self.q[td:T], self.kv, view[:, td:T], bt[nd:], self.qsl, sl[nd:], self.ctx,
                                       self.mq, H, P.softmax_scale, self.out[td:T])

    def next_step(self) -> mm3.BatchMetadata:
        """New queries, each real decode one token further back (its cache slots hold keys already):
        refilled in place; returns the step's batch for the references."""
        b = self.case.batch
        g = torch.Generator(device="cuda").manual_seed(4)
        self.q.copy_(torch.randn(self.q.shape, device="cuda", generator=g).to(self.q.dtype))
        self.iq.copy_(torch.randn(self.iq.shape, device="cuda", generator=g).to(self.iq.dtype))
        lens = list(b.seq_lens_host)
        new = [s - 1 if (r < self.nd and s) else s for r, s in enumerate(lens)]
        self.sl.copy_(torch.tensor(new, dtype=torch.int32))
        self.storage.fill_(POISON_TOPK)
        self.out.fill_(float("nan"))
        self.dscore.fill_(float("nan"))
        return mm3.BatchMetadata.build(list(b.query_lens), new, self.bt, block_size=P.block_size,
                                       num_decodes=self.nd, decode_query_len=self.dql, device="cuda")

    def assert_right(self, batch: mm3.BatchMetadata, name: str) -> None:
        step_case = type(self.case)(P, self.q, self.iq, self.case.caches, batch)
        assert_step_right(step_case, P, self.storage, self.out, name, layout="token_major")
        toks = sample_tokens(batch)
        for params, scores, lo, hi in ((P, self.dscore, 0, self.td),
                                       (UNFORCED, self.scores.get("prefill"), self.td, self.T)):
            ref = block_scores(self.iq, self.case.caches, batch, params, [t for t in toks if lo <= t < hi])
            for t, S in ref.items():
                row = scores[:, t - lo].double().cpu()   # type: ignore[index]
                nb = S.shape[1]
                assert torch.allclose(row[:, :nb], S, rtol=1e-4, atol=1e-3), (name, t)
                assert (row[:, nb:scores.shape[2]] == float("-inf")).all(), (name, t)  # type: ignore[union-attr]


@pytest.fixture(autouse=True)
def _cuda_backend() -> Any:
    targets.configure(Settings(backend="cuda", check_contracts="first"))   # the production default
    yield
    targets.configure()


@pytest.mark.parametrize("name", sorted(STEPS))
def test_no_device_sync_after_the_first_call(name: str) -> None:
    with torch.inference_mode():
        s = VllmStep(name)
        s.run()                  # the first call of each class: selection, the one host check, the guard
        torch.cuda.synchronize()
        batch = s.next_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            s.run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        targets.check_page_ids()
        s.assert_right(batch, f"{name}, eager")
    used = {(x.indexer.name, x.attention.name, getattr(x.scorer, "name", None)) for x in targets.selections()}
    assert used == {("cuda", "cuda", "cuda")}, used


@pytest.mark.parametrize("name", sorted(STEPS))
def test_every_function_captures_in_a_cuda_graph(name: str) -> None:
    with torch.inference_mode():
        s = VllmStep(name)
        s.run()                  # eager first: a capture cannot select or bind
        torch.cuda.synchronize()
        graph = capture(s.run)
        torch.cuda.synchronize()
        batch = s.next_step()
        graph.replay()
        torch.cuda.synchronize()
        targets.check_page_ids()
        s.assert_right(batch, f"{name}, replayed")
