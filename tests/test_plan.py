"""A plan's count comparisons agree with the rules: a call passes them exactly when every rule passes.

A target judges every rule once per facts that engine traffic does not change
(its plan) and then compares each call's counts with the plan
(:mod:`mm3.runtime.step`). Those comparisons stand in for the count-dependent
rules of :func:`mm3.contract.checks.check`; if they let through a call the
rules refuse, a bad call runs. For steps of one layer's facts and each count
that can go wrong (rows short or long, more tokens than the capacity, draft
tokens past the promise, a batch inconsistent with itself, a caller's top-k
view), the fast path admits a call without running the rules exactly when the
rules pass it, and a refused call raises what the rules say.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import mm3
import mm3.runtime.step as step_mod
from mm3.contract.checks import check
from mm3.contract.hookspecs import Op
from mm3.testing.factories import make_case

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)
CAPACITY = 12
ENTRY = "SparseAttention.forward"


def _layer() -> mm3.SparseAttention:
    return mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=CAPACITY, max_decode_query_len=2,
                               backend="cpu_ref")


def _rules_pass(t: step_mod.OpTarget, ops: tuple[Op, ...], kw: dict[str, Any]) -> Optional[str]:
    """None when every rule passes the call, else the rules' message."""
    index = t.indexer if Op.INDEX_TOPK in ops else None
    try:
        check(step_mod.describe(ENTRY, ops, P, index, t.attention if Op.ATTENTION in ops else None,
                                layer=t.layer, **kw))
    except mm3.InputError as e:
        return str(e)
    return None


#: (decode seq_lens, decode query length, prefill query lengths) of steps of the plan's facts (T > 1)
SHAPES = [([20, 27], 1, [4]), ([33], 2, [3, 2]), ([], 1, [6, 5]), ([40, 41, 42, 43, 44, 45], 2, []),
          ([50], 1, [11])]
#: one count wrong, or not: the rows of q / index_q / out / a caller's top-k view, past the promise
CHANGES = ["none", "q short", "q long", "index_q long", "index_q short", "out short", "out long", "dql 3",
           "inconsistent", "caller top-k short", "caller top-k long", "caller top-k short view", "over capacity",
           "over capacity, caller top-k"]


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_the_counts_admit_exactly_what_the_rules_pass(shape: int, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    t = layer.op_target
    base = make_case(P, decodes=[30], prefills=[(3, 20)], dtype="float32", num_pages=24, seed=9)
    layer(base.q, base.index_q, base.caches, base.batch)          # the plan of these facts
    decodes, dql, prefills = SHAPES[shape]
    if change == "dql 3":
        decodes, dql = decodes or [25], 3
    if change.startswith("over capacity"):
        prefills = [CAPACITY + 1]
    case = make_case(P, decodes=decodes, decode_query_len=dql, prefills=[(n, n + 9) for n in prefills],
                     dtype="float32", num_pages=24, seed=shape)
    b, T = case.batch, case.batch.num_tokens
    if change == "inconsistent":   # per-token tensors one short: the batch's own shapes disagree (its other facts stay)
        b = mm3.BatchMetadata.assemble(b.query_start_loc, b.seq_lens, b.context_lens, b.block_table,
                                       b.token_to_request[:-1], b.token_positions, num_decodes=b.num_decodes,
                                       decode_query_len=b.decode_query_len, num_decode_tokens=b.num_decode_tokens,
                                       max_prefill_query_len=b.max_prefill_query_len, block_size=16)

    def rows(x: torch.Tensor, name: str) -> torch.Tensor:
        extra = {f"{name} short": -1, f"{name} long": 1}.get(change, 0)
        return torch.randn(x.shape[0] + extra, *x.shape[1:]) if extra > 0 else x[:x.shape[0] + extra]
    q, iq = rows(case.q, "q"), rows(case.index_q, "index_q")
    out = rows(torch.empty_like(case.q), "out")
    caller = {"caller top-k short": T - 1, "caller top-k long": T + 1, "over capacity, caller top-k": T + 1,
              "caller top-k short view": T - 1}.get(change)
    memory = torch.zeros(P.num_kv_heads, 2 * T, P.topk, dtype=torch.int32)   # a view's rows: a count, not a fact
    topk = t.topk if caller is None else mm3.TopkBuffer(memory[:, :caller])
    if caller is not None:     # the plan of a caller's view of this memory, made by a good call
        bt = base.batch.num_tokens
        t.admit_call(ENTRY, step_mod.BOTH, caches=base.caches, batch=base.batch, topk=mm3.TopkBuffer(memory[:, :bt]),
                     index_q=base.index_q, q=base.q, out=torch.empty_like(base.q))
    kw = dict(caches=base.caches, batch=b, topk=topk, index_q=iq, q=q, out=out)
    want = _rules_pass(t, step_mod.BOTH, kw)
    judged: list[object] = []
    real = step_mod.check
    monkeypatch.setattr(step_mod, "check", lambda f: judged.append(f) or real(f))
    try:
        t.admit_call(ENTRY, step_mod.BOTH, **kw)  # type: ignore[arg-type]
        got = None
    except mm3.InputError as e:
        got = str(e)
    assert got == want
    if want is None:
        assert not judged, "a call of the plan's facts ran the rules again"
    if change in ("none", "out long", "caller top-k long"):
        assert want is None                  # the change keeps every rule
    elif change != "dql 3" or dql > 2:
        assert want is not None              # it breaks one
