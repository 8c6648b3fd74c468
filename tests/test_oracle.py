"""The shipped fp64 oracle (vectorized) against the literal per-token one of tests/literal_oracle.py.

Scores and selections must agree exactly; outputs to fp64 rounding. The
cases cover what the vectorization could get wrong: several requests with
different contexts, decodes with draft tokens and padding, init and local
forcing, NaN index queries, exact ties, selections with out-of-range ids
and NaN values in cache slots nothing selects.
"""

from __future__ import annotations

import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3.testing.oracle import NAN_SCORE, check_topk, oracle_attention, oracle_block_scores, oracle_topk
from literal_oracle import literal_attention, literal_block_scores, literal_topk

P = SparseAttentionParams(num_heads=6, num_kv_heads=2, head_dim=16, num_index_heads=2,
                          index_head_dim=16, block_size=8, topk=4, init_blocks=1, local_blocks=2)


def _case(seed: int, **kw):
    args = dict(decodes=[70, 9, 33], prefills=[(20, 50), (13, 13), (5, 100)], decode_query_len=2,
                padding_decodes=1, dtype="float32", seed=seed)
    args.update(kw)
    return make_case(kw.pop("params", P), **{k: v for k, v in args.items() if k != "params"})


def _assert_same(case, params=P) -> None:
    fast = oracle_block_scores(case.index_q, case.caches, case.batch, params)
    slow = literal_block_scores(case.index_q, case.caches, case.batch, params)
    assert len(fast) == len(slow)
    for t, (a, b) in enumerate(zip(fast, slow)):
        assert a.shape == b.shape, t
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=f"token {t}")
    sel = oracle_topk(case.index_q, case.caches, case.batch, params)
    assert torch.equal(sel.head_major(), literal_topk(case.index_q, case.caches, case.batch,
                                                      params).head_major())
    assert not check_topk(sel, case.index_q, case.caches, case.batch, params, scores=fast)
    out = oracle_attention(case.q, case.caches, sel, case.batch, params)
    ref = literal_attention(case.q, case.caches, sel, case.batch, params)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorized_oracle_matches_the_literal_one(seed: int) -> None:
    _assert_same(_case(seed))


def test_hnd_pages_and_bf16_inputs() -> None:
    _assert_same(_case(3, dtype="bfloat16", kv_layout="HND"))


def test_nan_index_query_and_exact_ties() -> None:
    case = _case(4)
    t = int(torch.nonzero(case.batch.token_positions >= 40)[0])
    case.index_q[t, 0, 5] = float("nan")
    scores = oracle_block_scores(case.index_q, case.caches, case.batch, P)[t]
    assert (scores[0, 1:-2] == NAN_SCORE).all() and not scores.isnan().any()
    case.caches.index[:] = case.caches.index[:, :1]       # every key of a page equal: ties in each row
    _assert_same(case)
    case.caches.index.fill_(0.5)                          # all scores equal: lowest ids win
    _assert_same(case)
    sel = oracle_topk(case.index_q, case.caches, case.batch, P).head_major()
    nb = int(case.batch.token_positions[t]) // P.block_size + 1
    assert sorted(sel[1, t].tolist()) == [0, 1, nb - 2, nb - 1]   # init, then the lowest free id, local


def test_attention_ignores_ids_past_the_context_and_nan_in_unselected_slots() -> None:
    case = _case(5)
    sel = oracle_topk(case.index_q, case.caches, case.batch, P)
    sel.head_major()[:, :, -1] = 999                     # an id past every context selects nothing
    case.caches.v[case.batch.block_table[0, 0].item()] = float("nan")  # request 0's block 0
    keep = (sel.head_major() != 0).all(dim=-1)          # tokens that do not read block 0
    out = oracle_attention(case.q, case.caches, sel, case.batch, P)
    ref = literal_attention(case.q, case.caches, sel, case.batch, P)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14, equal_nan=True)
    req0 = case.batch.token_to_request == 0
    assert out[req0 & keep.all(dim=0)].isfinite().all()


def test_large_request_is_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    import mm3.testing.oracle as oracle
    monkeypatch.setattr(oracle, "_CHUNK_ELEMENTS", 200)   # forces many chunks per request
    _assert_same(_case(6))
