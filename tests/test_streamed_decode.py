"""The streamed decode step: the attention overlapping the indexer (``Algorithms.streamed_decode``).

Under Triton's interpreter the two kernels run one after the other, so these
tests prove the arithmetic and the bookkeeping, not the overlap (tests/gpu
runs them side by side): the score grid launched request by request, the
top-k of each request's last score program, the ready flags raised for every
request, the attention's wait and its merge; the results bit for bit
those of the separate launches, and right against the fp64 oracle, on mixed
batches with speculative rows and padding, in both top-k layouts. And the
hand-over: the attention waits only after the indexer call just before it on
the stream raised flags for the same top-k buffer.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3_backends.triton.launch import override

from decode_steps import assert_decode_step_right, run_decode_step as _run

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]


def _base() -> Any:
    from mm3_backends.cuda.plugin import PLATFORM

    return PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted


def _launch(launched: list, name: str) -> tuple[tuple, dict]:
    hits = [(grid, kw) for n, grid, kw in launched if n == name]
    assert len(hits) == 1, f"{name}: {len(hits)} launches in {[n for n, *_ in launched]}"
    return hits[0]


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("q_len,h,g", [(1, 2, 4), pytest.param(2, 1, 8, marks=pytest.mark.slow)])  # slow: minutes
def test_streamed_step_matches_the_separate_launches(layout: str, q_len: int, h: int, g: int) -> None:
    """Score programs request by request, top-k per request, ready flags, the waiting attention: the
    separate launches' top-k and output bits, the oracle's answer, every flag raised."""
    from mm3_backends.triton import arrivals

    p = SparseAttentionParams(num_heads=h * g, num_kv_heads=h, head_dim=32, num_index_heads=h, index_head_dim=32,
                              block_size=16, topk=4, init_blocks=1)
    case = make_case(p, decodes=[150, 17, 61, 300, 90], decode_query_len=q_len, padding_decodes=1,
                     prefills=[(9, 90)], dtype="float16", index_dtype="float16", seed=21 + q_len)
    # several splits per (token, KV head), merged in the last program
    streamed = override(_base(), target_programs=96,
                        algorithms=dict(streamed_decode=True, merge_in_last_program=True))
    nd = case.batch.num_decodes
    flags = arrivals.arrival_counters(torch.device("cpu"), nd, "ready")
    flags[:nd] = 1   # an earlier step's raised flags: the step lowers them before it raises its own
    sel_s, out_s, launched = _run(streamed, case, p, layout)
    grid, score = _launch(launched, "_decode_score_kernel")
    assert score["STREAM"] and score["TOPK_LAST"] and grid[1] == nd and grid[0] > 1   # (splits, requests)
    _, attn = _launch(launched, "_decode_attention_flat_kernel")
    assert attn["STREAM"] and attn["MERGE_LAST"] and attn["SPLITS"] > 1
    assert "_decode_topk_kernel" not in [n for n, *_ in launched]
    assert torch.equal(flags[:nd], torch.ones(nd, dtype=flags.dtype)), "a request's ready flag was not raised"
    assert int(arrivals.arrival_counters(torch.device("cpu"), 1, "topk").sum()) == 0
    assert int(arrivals.arrival_counters(torch.device("cpu"), 1, "merge").sum()) == 0

    separate = override(streamed, algorithms=dict(streamed_decode=False, topk_in_last_program=False))
    with pytest.MonkeyPatch.context() as mp:   # the per-KV-head merge: the last program's code
        mp.setattr(type(separate), "use_merge_per_row", lambda self, num_tokens, num_kv_heads: False)
        sel_p, out_p, launched_p = _run(separate, case, p, layout)
    assert "STREAM" not in _launch(launched_p, "_decode_score_kernel")[1]
    assert torch.equal(sel_s, sel_p)
    T = case.batch.num_tokens
    assert torch.equal(out_s[:T], out_p[:T])
    assert_decode_step_right(sel_s, out_s, case, p)


def test_the_attention_waits_only_on_flags_raised_for_its_buffer() -> None:
    """The hand-over: an attention on another top-k buffer, or after a plain indexer call, or after no
    indexer call at all, launches without waiting (nothing would raise the flags it waited on)."""
    from mm3_backends.triton import arrivals, attention

    p = SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4)
    case = make_case(p, decodes=[150, 61, 33], dtype="float16", index_dtype="float16", seed=5)
    streamed = override(_base(), target_programs=8, algorithms=dict(streamed_decode=True))
    T = case.batch.num_tokens

    other = TopkBuffer.allocate(T, p.num_kv_heads, p.topk, "token_major")
    _, out_other, launched = _run(streamed, case, p, "token_major", attention_buf=other)
    assert _launch(launched, "_decode_score_kernel")[1]["STREAM"]
    assert not _launch(launched, "_decode_attention_flat_kernel")[1].get("STREAM", False)
    sel, out, _ = _run(streamed, case, p, "token_major")
    assert torch.equal(out_other[:T], out[:T])

    plain = override(streamed, algorithms=dict(streamed_decode=False))
    _run(streamed, case, p, "token_major")               # raises flags, its attention claims them
    buf = TopkBuffer.allocate(T, p.num_kv_heads, p.topk, "token_major")
    from mm3_backends.triton import indexer
    indexer.index_topk(case.index_q, case.caches, case.batch, p, buf, streamed)   # raises, nobody claims
    indexer.index_topk(case.index_q, case.caches, case.batch, p, buf, plain)      # the record goes
    assert arrivals.claim_ready_flags(torch.device("cpu"), buf.storage, case.batch.num_decodes) is None
    indexer.index_topk(case.index_q, case.caches, case.batch, p, buf, streamed)
    assert arrivals.claim_ready_flags(torch.device("cpu"), buf.storage, case.batch.num_decodes + 1) is None
    assert arrivals.claim_ready_flags(torch.device("cpu"), buf.storage, case.batch.num_decodes) is None, \
        "a record is used once, whoever claims it"
    out2 = torch.full_like(case.q, float("nan"))
    attention.attention_forward(case.q, case.caches, buf, case.batch, p, out2, streamed)  # no indexer before
    assert torch.equal(out2[:T], out[:T])


def test_the_rule_streams_single_row_requests_from_64() -> None:
    """Where the rule streams (on the cuda plugin's values): 64 requests or more of one index row each;
    never fewer, several rows, the grid attention kernel or a config without PDL; under the interpreter
    only when asked."""
    from mm3_backends.triton.tl_utils import streamed_enabled

    cfg = _base().for_device_sms(132)
    assert cfg.use_streamed_decode(64, 1) and cfg.use_streamed_decode(300, 1)
    assert not cfg.use_streamed_decode(63, 1) and not cfg.use_streamed_decode(64, 4)
    assert not cfg.use_streamed_decode(64, 2), "draft tokens: two rows per request"
    assert not override(cfg, algorithms=dict(pdl=False)).use_streamed_decode(64, 1)
    assert not override(cfg, algorithms=dict(decode_attention_flat=False)).use_streamed_decode(64, 1)
    assert not streamed_enabled(cfg, 64, 1), "the interpreter has no PDL: the rule must not stream there"
    assert streamed_enabled(override(cfg, algorithms=dict(streamed_decode=True)), 1, 4)
    # streamed: stream_waves times the programs, so that many times shorter runs of blocks
    assert cfg.decode_index.stream_waves > 1
    assert cfg.decode_index_blocks_per_split(64, 512) == 64
    assert cfg.decode_index_blocks_per_split(64, 512, streamed=True) == 64 // cfg.decode_index.stream_waves
