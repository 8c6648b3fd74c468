"""The order of a top-k row is declared and the plan establishes it: every pairing of indexer, attention, entry.

The indexer declares the order it writes (``topk_order``: score or ascending),
the attention the order it needs (``topk_order_required``: any or ascending),
the entry point the order of the rows it returns and hands in (none or
ascending, SGLang's). For each of the eight pairings of a call of both ops the
boundary sorts exactly when docs/spec.md §3's table says, the rows come back
in the order the entry point asked for, the attention gets the order it
declared (the mock raises otherwise), the selection passes the fp64 oracle's
rules and the output is the oracle's on it. A call of the attention alone
reads a caller's rows, ``-1`` inside a row and repeated ids included: a sorted
copy when the attention needs ascending and the entry point promises nothing,
and the result is the oracle's on the rows as a set. Nothing sorts, and no
torch op is added, when nothing requires an order.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mm3
from mm3.contract.errors import InputError
from mm3.contract.topk_order import is_ascending, sort_ascending_, sorted_ascending
from mm3.plugin import BackendCapabilities, TopkBuffer, hookimpl
from mm3.runtime import step as step_mod
from mm3.runtime.config import Settings
from mm3.runtime.registry import Registry
from mm3.runtime.step import BOTH
from mm3.testing.factories import make_case
from mm3.testing.helpers import default_params
from mm3.testing.mock import MockBackend
from mm3.testing.oracle import check_topk, oracle_attention

P = default_params()
ATTENTION = ("attention",)


def _case() -> Any:
    # decodes of 5, 3 and 2 visible blocks (rows with -1 tails at K = 4) and a chunk after context
    return make_case(P, decodes=[70, 40, 20], prefills=[(9, 40)], dtype="float32", seed=4)


def _layer(idx: Any, att: Any, mode: str = "first") -> mm3.SparseAttention:
    return mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="att", indexer_backend="idx",
                               registry=Registry([idx, att], entry_points=False),
                               settings=Settings(check_contracts=mode))


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the boundary's sorts (in place, and into a copy)."""
    n = {"in place": 0, "copy": 0}

    def in_place(buf: TopkBuffer) -> TopkBuffer:
        n["in place"] += 1
        return sort_ascending_(buf)

    def copy(buf: TopkBuffer) -> TopkBuffer:
        n["copy"] += 1
        return sorted_ascending(buf)

    monkeypatch.setattr(step_mod, "sort_ascending_", in_place)
    monkeypatch.setattr(step_mod, "sorted_ascending", copy)
    return n


PAIRINGS = list(itertools.product(("score", "ascending"), (None, "ascending"), (None, "ascending")))


@pytest.mark.parametrize("written,needed,entry", PAIRINGS, ids=lambda v: str(v).lower())
def test_a_step_of_both_ops_sorts_exactly_when_someone_needs_it(written: str, needed: Optional[str],
                                                               entry: Optional[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    idx = MockBackend("idx", ops={"index_topk"}, topk_order=written)
    att = MockBackend("att", ops={"attention"}, topk_order_required=needed)   # raises on rows out of its order
    layer, case = _layer(idx, att), _case()
    sorts = _counting(monkeypatch)
    T = case.batch.num_tokens
    rows = TopkBuffer.allocate(T, P.num_kv_heads, P.topk)
    out = torch.empty_like(case.q)
    layer.op_target.run("entry", BOTH, caches=case.caches, batch=case.batch, topk=rows, index_q=case.index_q,
                        q=case.q, out=out, order=entry)

    sorted_by_core = written == "score" and "ascending" in (needed, entry)
    assert sorts == {"in place": int(sorted_by_core), "copy": 0}
    ascending = is_ascending(rows.head_major()).all().item()
    # score order shows: some row of this step is not ascending as written
    assert ascending == (written == "ascending" or sorted_by_core)
    assert not check_topk(rows, case.index_q, case.caches, case.batch, P)   # the oracle's selection, any order
    ref = oracle_attention(case.q, case.caches, rows, case.batch, P)
    assert (out.double() - ref).abs().max() < 1e-5
    # the attention read the rows the call returns (no copy: every layout and density agrees)
    assert att.calls_to("attention_forward")[-1].args["topk"].storage.data_ptr() == rows.storage.data_ptr()


@pytest.mark.parametrize("written,entry", list(itertools.product(("score", "ascending"), (None, "ascending"))))
def test_an_index_op_alone_returns_the_entry_points_order(written: str, entry: Optional[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    idx = MockBackend("idx", ops={"index_topk"}, topk_order=written)
    att = MockBackend("att", ops={"attention"}, topk_order_required="ascending")   # not part of this call
    layer, case = _layer(idx, att), _case()
    sorts = _counting(monkeypatch)
    rows = TopkBuffer.allocate(case.batch.num_tokens, P.num_kv_heads, P.topk)
    layer.op_target.run("entry", ("index_topk",), caches=case.caches, batch=case.batch, topk=rows,
                        index_q=case.index_q, order=entry)
    assert sorts["in place"] == int(written == "score" and entry == "ascending")
    assert is_ascending(rows.head_major()).all().item() == (written == "ascending" or entry == "ascending")


def _scrambled(rows: TopkBuffer) -> TopkBuffer:
    """The rows reversed, a -1 inside every row with room for one, and the rest filled with a repeat of the
    row's first id: the same sets, in no order."""
    hm = rows.head_major()
    out = torch.full_like(hm, -1)
    K = hm.shape[-1]
    for h, t in itertools.product(range(hm.shape[0]), range(hm.shape[1])):
        valid = [v for v in hm[h, t].tolist() if v >= 0][::-1]
        if valid and len(valid) < K:
            valid = valid[:1] + [-1] + valid[1:]
            valid += [valid[0]] * (K - len(valid))
        out[h, t, :len(valid)] = torch.tensor(valid, dtype=torch.int32)
    return TopkBuffer(out)


@pytest.mark.parametrize("needed,entry", list(itertools.product((None, "ascending"), (None, "ascending"))))
def test_an_attention_alone_reads_a_callers_rows_with_holes_and_repeats(needed: Optional[str],
                                                                        entry: Optional[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeats are read once (spec §4), not refused; -1 anywhere selects nothing."""
    idx = MockBackend("idx", ops={"index_topk"})
    att = MockBackend("att", ops={"attention"}, topk_order_required=needed)
    layer, case = _layer(idx, att), _case()
    T = case.batch.num_tokens
    clean = TopkBuffer.allocate(T, P.num_kv_heads, P.topk)
    layer.op_target.run("entry", ("index_topk",), caches=case.caches, batch=case.batch, topk=clean,
                        index_q=case.index_q)
    # an entry point that promises ascending rows hands them in ascending (its engine's convention)
    given = sorted_ascending(_scrambled(clean)) if entry == "ascending" else _scrambled(clean)
    held = given.storage.clone()
    assert entry == "ascending" or not is_ascending(given.head_major()).all().item()
    s = sorted_ascending(given).head_major()
    assert ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(), "no repeated id to read once"
    sorts = _counting(monkeypatch)
    out = torch.empty_like(case.q)
    layer.op_target.run("entry", ATTENTION, caches=case.caches, batch=case.batch, topk=given, q=case.q, out=out,
                        order=entry)
    copied = needed == "ascending" and entry is None
    assert sorts == {"in place": 0, "copy": int(copied)}
    read = att.calls_to("attention_forward")[-1].args["topk"]
    assert (read.storage.data_ptr() != given.storage.data_ptr()) == copied
    assert torch.equal(given.storage, held), "the caller's rows were changed"
    ref = oracle_attention(case.q, case.caches, clean, case.batch, P)     # the same sets, in order, once each
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_bound_backends_own_attention_refuses_rows_it_would_have_to_sort() -> None:
    att = MockBackend("att", ops={"attention"}, topk_order_required="ascending")
    be = Registry([att], entry_points=False).get("att")
    case = _case()
    ids = torch.full((P.num_kv_heads, case.batch.num_tokens, P.topk), -1, dtype=torch.int32)
    ids[..., 1] = 0                                  # block 0, after a -1: not ascending
    rows = TopkBuffer(ids)
    with pytest.raises(InputError, match="topk_order_required='ascending'.*sort them first"):
        be.attention_forward(case.q, case.caches, rows, case.batch, P, torch.empty_like(case.q))


def test_an_entry_point_may_ask_for_ascending_or_nothing() -> None:
    layer, case = _layer(MockBackend("idx", ops={"index_topk"}), MockBackend("att", ops={"attention"})), _case()
    rows = TopkBuffer.allocate(case.batch.num_tokens, P.num_kv_heads, P.topk)
    with pytest.raises(InputError, match="'score' order; the core establishes 'ascending'"):
        layer.op_target.run("entry", ("index_topk",), caches=case.caches, batch=case.batch, topk=rows,
                            index_q=case.index_q, order="score")


def test_a_required_order_is_ascending_or_none() -> None:
    with pytest.raises(ValueError, match="topk_order_required"):
        BackendCapabilities(name="x", ops={"attention"}, device_types={"cpu"}, topk_layout="head_major",
                            topk_order_required="score")


# -- what a step costs when nothing needs an order ----------------------------------------------------

class Quiet:
    """Hooks that return at once: every torch op of a step is then the boundary's."""

    def __init__(self, name: str, **caps: Any) -> None:
        self.caps = BackendCapabilities(name=name, device_types={"cpu"}, topk_layout="head_major", **caps)

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return self.caps

    @hookimpl
    def index_topk(self, out: TopkBuffer) -> None:
        pass

    @hookimpl
    def attention_forward(self, out: torch.Tensor) -> None:
        pass


SORT = ("aten.bitwise_xor.Scalar", "aten.sort.default", "aten.bitwise_xor.Scalar_out")


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_of_a_step(written: str, needed: Optional[str], entry: Optional[str]) -> list[str]:
    layer = _layer(Quiet("idx", ops={"index_topk"}, topk_order=written),
                   Quiet("att", ops={"attention"}, topk_order_required=needed), mode="never")
    case = _case()
    rows = TopkBuffer(torch.full((P.num_kv_heads, case.batch.num_tokens, P.topk), -1, dtype=torch.int32))
    out = torch.empty_like(case.q)
    kw = dict(caches=case.caches, batch=case.batch, topk=rows, index_q=case.index_q, q=case.q, out=out, order=entry)
    layer.op_target.run("entry", BOTH, **kw)     # the first step judges the contents on the host, once
    with Ops() as ops:
        layer.op_target.run("entry", BOTH, **kw)
    return ops.names


def test_no_torch_op_is_added_when_nothing_needs_an_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)   # a device table: no host check per call
    base = _ops_of_a_step("score", None, None)
    assert not [n for n in base if n.startswith(("aten.sort", "aten.bitwise_xor"))], base
    for pairing in PAIRINGS:
        got = _ops_of_a_step(*pairing)
        if pairing[0] == "score" and "ascending" in pairing[1:]:
            # the sort: three ops on the step's rows, no host read
            assert len(got) == len(base) + 3 and Counter(got) - Counter(base) == Counter(SORT), (pairing, got)
        else:
            assert got == base, (pairing, got)
