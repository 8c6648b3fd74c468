"""Host work once per shape class, not per step, without losing a guarantee.

* the eager custom ops make the layer's decisions: the guard runs on the first
  call of each op and batch kind only, and their results match the fp64 oracle;
* the argument rules run once per shape class (the facts value): any input that
  differs in shape, dtype or device is a new class, checked (and refused) again;
* an op called again with the same tensors, refilled in place with a new step
  of the same shapes, reads the new contents;
* the fault flag reads the host only while a recorded check may still report.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mm3
import mm3.debug.guard as guard_mod
import mm3.runtime.step as step_mod
from mm3.contract import contents
from mm3.contract.contents import FaultFlag
from mm3.runtime.config import Settings
from mm3.runtime.ops import batch_args, batch_from_args
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention, oracle_topk

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                              index_head_dim=16, block_size=16, topk=4)
STEP = dict(decodes=[40, 33], prefills=[(5, 20)], dtype="float32")


def _layer() -> mm3.SparseAttention:
    # the default of a process (tests/conftest.py guards every step): "first"
    return mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="cpu_ref",
                               settings=Settings(check_contracts="first"))


def _ops(layer: mm3.SparseAttention, case: Any, out: torch.Tensor) -> None:
    c, args, h = case.caches, batch_args(case.batch), layer.op_target.handle
    st = layer.topk_buffer.storage
    torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, st, *args, h)
    torch.ops.mm3.attention(case.q, c.k, c.v, c.index, st, *args, h, out)


def _want(case: Any) -> torch.Tensor:
    sel = oracle_topk(case.index_q, case.caches, case.batch, P)
    return oracle_attention(case.q, case.caches, sel, case.batch, P)


def _count_guarded(monkeypatch: pytest.MonkeyPatch, which: str) -> list[str]:
    guarded: list[str] = []
    real = guard_mod.checked_call

    def counted(be: Any, op: str, args: Any, **k: Any) -> None:
        if op == which:
            guarded.append(args[3 if op == "attention" else 2].kind)
        return real(be, op, args, **k)
    monkeypatch.setattr(guard_mod, "checked_call", counted)
    return guarded


def test_eager_ops_guard_the_first_step_of_each_kind_only(monkeypatch: pytest.MonkeyPatch) -> None:
    guarded = _count_guarded(monkeypatch, "index_topk")
    layer = _layer()
    for seed, kw in enumerate([STEP, STEP, dict(decodes=[50], dtype="float32"), STEP]):
        case = make_case(P, seed=seed, **kw)
        out = torch.full_like(case.q, float("nan"))
        _ops(layer, case, out)
        T = case.batch.num_tokens
        torch.testing.assert_close(out[:T].double(), _want(case), rtol=1e-5, atol=1e-5)
    assert guarded == ["mixed", "decode"]


def test_a_target_judges_its_rules_once_then_compares_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"rules": 0}
    real = step_mod.check

    def counted(facts: Any) -> Any:
        counts["rules"] += 1
        return real(facts)
    monkeypatch.setattr(step_mod, "check", counted)
    layer = _layer()
    shapes = [STEP, dict(decodes=[40, 33, 12], dtype="float32"), dict(prefills=[(7, 7), (9, 30)], dtype="float32"),
              dict(decodes=[25], prefills=[(3, 40)], dtype="float32")]
    cases = [make_case(P, seed=s, num_pages=16, **kw) for s, kw in enumerate(shapes)]   # one cache shape
    for case in cases:
        out = torch.full_like(case.q, float("nan"))
        got = layer(case.q, case.index_q, case.caches, case.batch, out)
        torch.testing.assert_close(got.double(), _want(case), rtol=1e-5, atol=1e-5)
    # the first step ran every rule; the others, of new token counts and kinds, compared counts only
    assert counts == {"rules": 1}
    case = cases[0]
    bad_out = torch.empty(case.q.shape, dtype=torch.float64)
    with pytest.raises(mm3.InputError, match="out is torch.float64"):
        layer(case.q, case.index_q, case.caches, case.batch, bad_out)
    with pytest.raises(mm3.InputError, match="q has shape"):
        layer(case.q[:, :2], case.index_q, case.caches, case.batch)
    with pytest.raises(mm3.InputError, match="q has shape"):
        layer(case.q[:-1], case.index_q, case.caches, case.batch)   # a count: one row short
    with pytest.raises(mm3.InputError, match="k/v cache is torch.float64"):
        c = case.caches
        layer(case.q, case.index_q, mm3.PagedKVCache(c.k.double(), c.v.double(), c.index), case.batch)


def test_ops_on_tensors_refilled_in_place_read_the_new_step() -> None:
    layer = _layer()
    first = make_case(P, seed=1, **STEP)
    out = torch.full_like(first.q, float("nan"))
    _ops(layer, first, out)
    _ops(layer, first, out)
    # a new step of the same shapes (pages: 8 + 3 spare, and 6 + 5): other lengths and positions
    again = make_case(P, seed=2, decodes=[30, 47], prefills=[(5, 9)], dtype="float32", extra_pages=5)
    first.batch.update_(again.batch)
    for mine, theirs in ((first.q, again.q), (first.index_q, again.index_q), (first.caches.k, again.caches.k),
                         (first.caches.v, again.caches.v), (first.caches.index, again.caches.index)):
        mine.copy_(theirs)
    out.fill_(float("nan"))
    _ops(layer, first, out)
    torch.testing.assert_close(out.double(), _want(again), rtol=1e-5, atol=1e-5)
    # the batch the ops rebuild reads the refilled contents: nothing is kept from the last call
    args = batch_args(first.batch)
    seen = batch_from_args(*args)
    assert seen.seq_lens_host == (30, 47, 9) and seen.max_seq_len == 47
    first.batch.update_(make_case(P, seed=1, **STEP).batch)
    again_seen = batch_from_args(*args)
    assert again_seen.seq_lens_host == (40, 33, 20) and again_seen.max_seq_len == 40


def test_the_fault_flag_is_host_memory_read_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reporting kernel's store lands where the host reads: an eager step starts no copy."""
    flag = FaultFlag("cpu")
    assert flag.shared and flag.word.data_ptr() == flag._host.data_ptr()
    copies: list[int] = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: copies.append(1) or real_copy(self, *a, **k))
    flag.after_step()
    flag.word.fill_(contents.fault_word(0, 1))              # what a reporting kernel stores
    with pytest.raises(mm3.InputError, match="block_table\\[0, 1\\] is not a page id"):
        flag.raise_pending()
    flag.raise_pending()                                    # reported once
    assert copies == []


def test_a_word_the_host_cannot_share_is_read_after_its_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device cannot address host memory the word lives on the device: read only once copied."""
    host = torch.full((1,), contents.NO_FAULT, dtype=torch.int64)
    monkeypatch.setattr(contents, "_shared_word", lambda device: (host.clone(), host, False))
    good = make_case(P, seed=3, **STEP).batch
    flag = FaultFlag("cpu")
    assert not flag.shared and flag.word.data_ptr() != flag._host.data_ptr()
    flag.raise_pending()
    assert not flag._copied
    flag.record(good, num_pages=1000)
    assert flag._copied
    flag.raise_pending()                      # nothing bad; the copy has landed (CPU): read once
    assert not flag._copied
    bad = mm3.BatchMetadata.build([1], [20], torch.tensor([[3, 9]]), block_size=16, num_decodes=1)
    flag.record(bad, num_pages=8)
    with pytest.raises(mm3.InputError, match="block_table\\[0, 1\\] is not a page id"):
        flag.raise_pending()
    flag.raise_pending()                      # reported once
    flag.word.fill_(contents.fault_word(2, 0))
    flag.raise_pending()                      # not copied yet: nothing read
    with pytest.raises(mm3.InputError, match="block_table\\[2, 0\\] is not a page id"):
        flag.check()


def test_a_layer_step_is_admitted_once_and_guards_both_hooks_of_a_new_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """One admission per layer step (both hooks), one per custom op; the guard checks the indexer and the
    attention of each kind's first step, through the same call the plain steps make."""
    admitted: list[tuple[str, ...]] = []
    real = step_mod.OpTarget.run

    def counted(self: Any, entry: str, ops: tuple[str, ...], *args: Any, **kw: Any) -> Any:
        admitted.append(ops)
        return real(self, entry, ops, *args, **kw)
    monkeypatch.setattr(step_mod.OpTarget, "run", counted)
    guarded = _count_guarded(monkeypatch, "attention")
    layer = _layer()
    kinds = [STEP, STEP, dict(decodes=[50], dtype="float32"), STEP]
    for seed, kw in enumerate(kinds):
        case = make_case(P, seed=seed, **kw)
        out = torch.full_like(case.q, float("nan"))
        got = layer(case.q, case.index_q, case.caches, case.batch, out)
        torch.testing.assert_close(got.double(), _want(case), rtol=1e-5, atol=1e-5)
    assert admitted == [("index_topk", "attention")] * len(kinds)
    assert guarded == ["mixed", "decode"]     # the attention of each kind's first step is guarded
    case = make_case(P, seed=9, **STEP)        # an op called on its own is admitted on its own
    _ops(layer, case, torch.full_like(case.q, float("nan")))
    assert admitted[len(kinds):] == [("index_topk",), ("attention",)]
