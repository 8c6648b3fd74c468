"""Host work once per shape class, not per step, without losing a guarantee.

* the eager custom ops make the layer's decisions: the guard runs on the first
  step of each batch kind only, and their results match the fp64 oracle;
* argument checks are skipped only for a call whose shape class passed them:
  any input that differs in shape, dtype or device is checked (and refused) again;
* an op called again with the same tensors, refilled in place with a new step
  of the same shapes, reads the new contents;
* the page-id flag reads the host only while a recorded check may still report.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mm3
from mm3.contract import page_ids
from mm3.contract.page_ids import PageIdFlag
from mm3.debug.guard import GuardedBackend
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


def test_eager_ops_guard_the_first_step_of_each_kind_only(monkeypatch: pytest.MonkeyPatch) -> None:
    guarded: list[str] = []
    real = GuardedBackend.index_topk

    def counted(self: GuardedBackend, *a: Any) -> None:
        guarded.append(a[2].kind)
        return real(self, *a)
    monkeypatch.setattr(GuardedBackend, "index_topk", counted)
    layer = _layer()
    for seed, kw in enumerate([STEP, STEP, dict(decodes=[50], dtype="float32"), STEP]):
        case = make_case(P, seed=seed, **kw)
        out = torch.full_like(case.q, float("nan"))
        _ops(layer, case, out)
        T = case.batch.num_tokens
        torch.testing.assert_close(out[:T].double(), _want(case), rtol=1e-5, atol=1e-5)
    assert guarded == ["mixed", "decode"]


def test_steady_state_skips_the_checks_of_a_checked_class_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import mm3.runtime.backend as backend_mod
    import mm3.runtime.layer as layer_mod

    counts = {"layer": 0, "backend": 0}
    real_step, real_hook = layer_mod.check_step_inputs, backend_mod.check_index_args

    def step_counted(*a: Any, **k: Any) -> None:
        counts["layer"] += 1
        return real_step(*a, **k)

    def hook_counted(*a: Any, **k: Any) -> int:
        counts["backend"] += 1
        return real_hook(*a, **k)
    monkeypatch.setattr(layer_mod, "check_step_inputs", step_counted)
    monkeypatch.setattr(backend_mod, "check_index_args", hook_counted)
    layer = _layer()
    cases = [make_case(P, seed=s, **STEP) for s in range(4)]
    for case in cases:
        out = torch.full_like(case.q, float("nan"))
        got = layer(case.q, case.index_q, case.caches, case.batch, out)
        torch.testing.assert_close(got.double(), _want(case), rtol=1e-5, atol=1e-5)
    # the first step (guarded) ran every check; the other three, of its class, none
    assert counts == {"layer": 1, "backend": 1}
    case = cases[0]
    bad_out = torch.empty(case.q.shape, dtype=torch.float64)
    with pytest.raises(mm3.InputError, match="out is torch.float64"):
        layer(case.q, case.index_q, case.caches, case.batch, bad_out)
    with pytest.raises(mm3.InputError, match="q has shape"):
        layer(case.q[:, :2], case.index_q, case.caches, case.batch)
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


def test_the_page_id_flag_is_host_memory_read_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reporting kernel's store lands where the host reads: an eager step starts no copy."""
    flag = PageIdFlag("cpu")
    assert flag.shared and flag.word.data_ptr() == flag._host.data_ptr()
    copies: list[int] = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: copies.append(1) or real_copy(self, *a, **k))
    flag.after_step()
    flag.word.fill_(page_ids.fault_word(0, 1))              # what a reporting kernel stores
    with pytest.raises(mm3.InputError, match="block_table\\[0, 1\\] is not a page id"):
        flag.raise_pending()
    flag.raise_pending()                                    # reported once
    assert copies == []


def test_a_word_the_host_cannot_share_is_read_after_its_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device cannot address host memory the word lives on the device: read only once copied."""
    host = torch.full((1,), page_ids.NO_FAULT, dtype=torch.int64)
    monkeypatch.setattr(page_ids, "_shared_word", lambda device: (host.clone(), host, False))
    good = make_case(P, seed=3, **STEP).batch
    flag = PageIdFlag("cpu")
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
    flag.word.fill_(page_ids.fault_word(2, 0))
    flag.raise_pending()                      # not copied yet: nothing read
    with pytest.raises(mm3.InputError, match="block_table\\[2, 0\\] is not a page id"):
        flag.check()


def test_an_eager_layer_step_decides_the_guard_and_checks_the_page_ids_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention takes the indexer's decision (same step, batch and caches): one policy call per
    step, and the guarded pair still runs, both hooks of it, on the first step of each kind."""
    from mm3.runtime.step import OpTarget

    calls: list[bool] = []
    guarded: list[str] = []
    real_first, real_att = OpTarget._guarded, GuardedBackend.attention_forward

    def first_counted(self: OpTarget, *a: Any, **k: Any) -> bool:
        calls.append(True)
        return real_first(self, *a, **k)

    def att_counted(self: GuardedBackend, *a: Any) -> None:
        guarded.append(a[3].kind)
        return real_att(self, *a)
    monkeypatch.setattr(OpTarget, "_guarded", first_counted)
    monkeypatch.setattr(GuardedBackend, "attention_forward", att_counted)
    layer = _layer()
    kinds = [STEP, STEP, dict(decodes=[50], dtype="float32"), STEP]
    for seed, kw in enumerate(kinds):
        case = make_case(P, seed=seed, **kw)
        out = torch.full_like(case.q, float("nan"))
        got = layer(case.q, case.index_q, case.caches, case.batch, out)
        torch.testing.assert_close(got.double(), _want(case), rtol=1e-5, atol=1e-5)
    assert calls == [True] * len(kinds)       # the indexer's only
    assert guarded == ["mixed", "decode"]     # the attention of each kind's first step is guarded
    # an op called on its own still decides for itself
    case = make_case(P, seed=9, **STEP)
    _ops(layer, case, torch.full_like(case.q, float("nan")))
    assert len(calls) == len(kinds) + 2
