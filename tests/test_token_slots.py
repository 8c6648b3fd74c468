"""Token slots (docs/spec.md §2): a batch whose tokens are found through a slot table, not a block table.

The same step through pages and through token slots (a random permutation of
one-token cache pages, a slot table whose rows the requests sit on at random,
shared prefixes) gives cpu_ref's exact same results, and the oracle's. A
backend that does not declare ``addressings`` "slots" is refused by name, at
selection and at a bound call; the contents rules of a slot table (a slot row
per request, a cache slot per used position, a table wide enough) are judged
on the host and on the device and name the entry at fault.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import mm3
from mm3 import BatchMetadata, InputError
from mm3.contract.contents import FaultFlag, check_on_host
from mm3.contract.slots import TokenSlots, key_rows
from mm3.runtime.ops import batch_args
from mm3.runtime.registry import Registry, default_registry
from mm3.runtime.selection import requirements_for, select
from mm3.testing.factories import as_token_slots, make_case
from mm3.testing.mock import MockBackend
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4, init_blocks=1, local_blocks=1)


def _cases(seed: int, **kw: object) -> tuple[object, object]:
    paged = make_case(P, decodes=[120, 70], decode_query_len=2, prefills=[(9, 9), (20, 150)], padding_decodes=1,
                      dtype="float32", seed=seed, **kw)  # type: ignore[arg-type]
    return paged, as_token_slots(paged, torch.Generator().manual_seed(seed))


def _run(be: object, case: object) -> tuple[mm3.TopkBuffer, torch.Tensor]:
    T = case.batch.num_tokens  # type: ignore[attr-defined]
    topk = mm3.TopkBuffer.allocate(T, P.num_kv_heads, P.topk)
    out = torch.full((T, P.num_heads, P.head_dim), float("nan"))
    be.index_topk(case.index_q, case.caches, case.batch, P, topk)  # type: ignore[attr-defined]
    be.attention_forward(case.q, case.caches, topk, case.batch, P, out)  # type: ignore[attr-defined]
    return topk, out


@pytest.mark.parametrize("pages", ["permuted", "shared_prefix"])
def test_cpu_ref_reads_token_slots_as_it_reads_pages_and_as_the_oracle_says(pages: str) -> None:
    paged, slotted = _cases(3, pages=pages)
    be = default_registry().get("cpu_ref")
    topk_p, out_p = _run(be, paged)
    topk_s, out_s = _run(be, slotted)
    assert torch.equal(topk_p.head_major(), topk_s.head_major())
    assert torch.equal(out_p, out_s)       # the same keys, found another way: the same arithmetic
    assert not check_topk(topk_s, slotted.index_q, slotted.caches, slotted.batch, P)  # type: ignore[attr-defined]
    want = oracle_attention(slotted.q, slotted.caches, topk_s, slotted.batch, P)  # type: ignore[attr-defined]
    assert torch.allclose(out_s.double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(oracle_topk(slotted.index_q, slotted.caches, slotted.batch, P).head_major(),  # type: ignore[attr-defined]
                       oracle_topk(paged.index_q, paged.caches, paged.batch, P).head_major())  # type: ignore[attr-defined]


def test_the_slot_cases_hold_no_copy_of_a_page_order() -> None:
    """The slots are a permutation: neighbouring positions of a request are not neighbouring rows."""
    _, slotted = _cases(5)
    s = slotted.batch.slots  # type: ignore[attr-defined]
    row = s.table[s.rows[0], :120].long()
    assert (row.diff() != 1).float().mean() > 0.9
    assert slotted.caches.k.shape[1] == 1 and slotted.caches.index.shape[1] == 1  # type: ignore[attr-defined]


def test_key_rows_of_pages_and_slots() -> None:
    bt = torch.tensor([[5, 2]], dtype=torch.int32)
    pages = BatchMetadata.build([1], [20], bt, block_size=16)
    assert key_rows(pages, torch.tensor(0), torch.tensor([0, 15, 16, 19]), 8 * 16, 16).tolist() == [80, 95, 32, 35]
    table = torch.tensor([[-1, -1, -1], [9, 4, 7]], dtype=torch.int32)
    slots = BatchMetadata.build([1], [3], torch.zeros(1, 0, dtype=torch.int32), block_size=16,
                                slots=TokenSlots.of(table, torch.tensor([1])), num_pages=10)
    assert key_rows(slots, torch.tensor(0), torch.arange(3), 10, 1).tolist() == [9, 4, 7]
    assert slots.facts.addressing == "slots" and slots.prefill_seq_len_bound() == 3


def test_a_backend_without_slots_is_refused_by_name_when_bound_and_passed_over_by_selection() -> None:
    mock = MockBackend("pages_only", addressings={"pages"})
    reg = Registry(plugins=[mock], entry_points=False)
    be = reg.get("pages_only")
    _, slotted = _cases(7)
    with pytest.raises(InputError, match=r"cannot find tokens through slots .*addressings \['pages'\].*'pages_only'"):
        _run(be, slotted)
    req = requirements_for(P, torch.float32, torch.bfloat16, "cpu", decode_query_len=2, addressing="slots")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sel = select(req, default_registry(), device="cpu", backend="cpu_ref")
    assert sel.attention.name == "cpu_ref" and sel.indexer.name == "cpu_ref"
    reasons = mock.capabilities.unmet(req)
    assert any("slots" in r for r in reasons)
    with_slots = MockBackend("both", addressings={"pages", "slots"}).capabilities
    assert not with_slots.unmet(req)


@pytest.mark.parametrize("name", ["cuda", "rocm"])
def test_the_triton_plugins_claim_slots_and_their_bound_calls_read_them(name: str) -> None:
    """Both Triton plugins declare addressings "slots" (their kernels gather through the slot table), so selection
    keeps them for a slot batch; bound (under Triton's interpreter), their calls agree with the oracle."""
    import importlib

    plugin = importlib.import_module(f"mm3_backends.{name}.plugin")
    req = requirements_for(P, torch.bfloat16, torch.bfloat16, "cuda", addressing="slots")
    assert not [r for r in plugin.backend_capabilities().unmet(req) if "slots" in r]
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    be = Registry([plugin], entry_points=False).get(name)
    _, slotted = _cases(15)
    topk, out = _run(be, slotted)
    assert not check_topk(topk, slotted.index_q, slotted.caches, slotted.batch, P)  # type: ignore[attr-defined]
    want = oracle_attention(slotted.q, slotted.caches, topk, slotted.batch, P)  # type: ignore[attr-defined]
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-4)


def test_a_slot_batch_needs_one_token_pages() -> None:
    paged, slotted = _cases(9)
    be = default_registry().get("cpu_ref")
    wrong = mm3.PagedKVCache(paged.caches.k, paged.caches.v, paged.caches.index)  # type: ignore[attr-defined]
    with pytest.raises(InputError, match="token slots need caches of one-token pages"):
        _run(be, type(slotted)(P, slotted.q, slotted.index_q, wrong, slotted.batch))  # type: ignore[attr-defined, call-arg]


def test_the_layer_runs_token_slots_eagerly_and_the_custom_ops_refuse_them() -> None:
    _, slotted = _cases(11)
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.bfloat16, max_decode_query_len=2,
                                backend="cpu_ref")
    out = layer(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]
    want = oracle_attention(slotted.q, slotted.caches, layer.topk_buffer.rows(0, slotted.batch.num_tokens),  # type: ignore[attr-defined]
                            slotted.batch, P)  # type: ignore[attr-defined]
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(InputError, match="token slots .*torch.ops.mm3"):
        batch_args(slotted.batch)  # type: ignore[attr-defined]


def test_a_compiled_layer_refuses_token_slots_with_mm3s_reason() -> None:
    """The refusal is raised while dynamo traces the layer, which wraps it in an error of its own (under
    ``fullgraph=True``, ``torch._dynamo.exc.Unsupported``): the message still says what is wrong and what to do."""
    _, slotted = _cases(11)
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.bfloat16, max_decode_query_len=2,
                                backend="cpu_ref")
    compiled = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="token slots .*torch.ops.mm3.*run the layer eagerly"):
        compiled(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]


# -- contents ------------------------------------------------------------------------------------
NUM_SLOTS = 64


def _slot_batch(table: list[list[int]], rows: list[int], sl: tuple[int, ...] = (5, 3)) -> BatchMetadata:
    """One decode and one prefill of 3 tokens, built as an engine builds them: contents unchecked."""
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    slots = TokenSlots.of(torch.tensor(table, dtype=torch.int32), torch.tensor(rows))
    return BatchMetadata.from_device(qsl, torch.tensor(sl, dtype=torch.int32), torch.zeros(2, 0, dtype=torch.int32),
                                     num_decodes=1, num_tokens=4, max_query_len=3, block_size=16, slots=slots)


GOOD = [[-1] * 6, [10, 11, 3, 40, 63, -1], [7, 8, 9, -1, -1, -1]]
BAD = [
    ("a slot row outside the table", dict(rows=[1, 3]), r"request 1 has slot row (3|\?) \(\S*slot_rows\)"),
    ("a negative slot row", dict(rows=[-1, 2]), r"request 0 has slot row (-1|\?)"),
    ("a used position without a slot", dict(table=[[-1] * 6, [10, 11, 3, -1, 63, -1], GOOD[2]]),
     r"request 0, position 3: \S*slot_table\[\S*slot_rows\[0\], 3\]( = -1)? is not a slot of the cache, in \[0, 64\)"),
    ("a slot past the cache", dict(table=[[-1] * 6, GOOD[1], [7, 64, 9, -1, -1, -1]]),
     r"request 1, position 1: .* is not a slot of the cache"),
    ("a seq_len past the table", dict(table=[[-1] * 6, GOOD[1], [7, 8, 9, 12, 13, 14]], sl=(5, 7)),
     r"request 1 has seq_len \S+, but \S*slot_table has only \S+ columns"),
]


def test_a_good_slot_batch_passes_both_checks() -> None:
    b = _slot_batch(GOOD, [1, 2])
    check_on_host(b, NUM_SLOTS, entry="t")
    flag = FaultFlag("cpu")
    flag.record(b, NUM_SLOTS)
    flag.raise_pending()


@pytest.mark.parametrize("what, change, message", BAD, ids=[b[0] for b in BAD])
def test_each_slot_rule_is_caught_on_the_host_and_on_the_device(what: str, change: dict, message: str) -> None:
    args = dict(table=GOOD, rows=[1, 2], **{k: v for k, v in change.items() if k == "sl"})
    args.update({k: v for k, v in change.items() if k != "sl"})
    b = _slot_batch(args["table"], args["rows"], args.get("sl", (5, 3)))  # type: ignore[arg-type]
    with pytest.raises(InputError, match=message):
        check_on_host(b, NUM_SLOTS, entry="t")
    flag = FaultFlag("cpu")
    flag.about("t", mm3.contract.facts.LAYER_NAMES, NUM_SLOTS, b)
    flag.record(b, NUM_SLOTS)
    with pytest.raises(InputError, match=message):
        flag.raise_pending()


def test_a_slot_edited_in_place_between_steps_is_caught_at_the_next_step() -> None:
    """An engine rewrites its slot table in place; every step judges what it holds then."""
    _, slotted = _cases(13)
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.bfloat16, max_decode_query_len=2,
                                backend="cpu_ref")
    layer(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]
    s = slotted.batch.slots  # type: ignore[attr-defined]
    s.table[s.rows[0], 5] = slotted.caches.num_pages + 3  # type: ignore[attr-defined]
    with pytest.raises(InputError, match=r"request 0, position 5: .*slot_table.* is not a slot of the cache"):
        layer(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]


def test_a_padding_request_needs_no_slot_row() -> None:
    """A padding decode (seq_len 0) reads nothing: its row may be anything an engine leaves there (-1)."""
    b = _slot_batch(GOOD, [-1, 2], sl=(0, 3))
    check_on_host(b, NUM_SLOTS, entry="t")
    flag = FaultFlag("cpu")
    flag.record(b, NUM_SLOTS)
    flag.raise_pending()


def test_the_guard_finds_a_non_finite_key_through_the_slots() -> None:
    """The guard lets a non-finite output through only where an input the token attends to is not finite;
    with token slots it finds that input through the slot table (and blames nothing else)."""
    from mm3.runtime.config import Settings

    _, slotted = _cases(17)
    b = slotted.batch  # type: ignore[attr-defined]
    r = b.num_decodes + 1                                     # the longer prefill
    first = int(b.query_start_loc[r])
    slot = int(b.slots.table[b.slots.rows[r], 0])             # its position 0: always a forced init block
    slotted.caches.v[slot, 0, 1] = float("inf")               # KV head 1  # type: ignore[attr-defined]
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.bfloat16, max_decode_query_len=2,
                                backend="cpu_ref", settings=Settings(check_contracts="always"))
    out = layer(slotted.q, slotted.index_q, slotted.caches, b)  # type: ignore[attr-defined]
    assert not torch.isfinite(out[first:, 2:]).all()
    assert torch.isfinite(out[:, :2]).all()


def test_slot_tensors_of_the_wrong_kind_are_refused_by_name() -> None:
    with pytest.raises(InputError, match=r"slot_table must be a 2-D int32 or int64 tensor \[num_table_rows, "
                                         r"max_context\], got torch.float32"):
        TokenSlots.of(torch.zeros(2, 4), torch.tensor([0]))
    with pytest.raises(InputError, match=r"req_to_token is on cpu and slot_ids on meta"):
        TokenSlots.of(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64, device="meta"),
                      "req_to_token", "slot_ids")
    _, slotted = _cases(19)
    b = slotted.batch  # type: ignore[attr-defined]
    short = BatchMetadata.assemble(b.query_start_loc, b.seq_lens, None, b.block_table, b.token_to_request,
                                   b.token_positions, num_decodes=b.num_decodes, decode_query_len=2,
                                   num_decode_tokens=b.num_decode_tokens, max_prefill_query_len=20,
                                   block_size=16, slots=TokenSlots(b.slots.table, b.slots.rows[:-1]))
    with pytest.raises(InputError, match=r"batch.slot_rows has shape \(4,\), expected \(5,\): one slot-table row "
                                         r"per request"):
        _run(default_registry().get("cpu_ref"), type(slotted)(P, slotted.q, slotted.index_q,  # type: ignore[call-arg]
                                                              slotted.caches, short))  # type: ignore[attr-defined]


def test_slots_are_judged_on_the_device_path_even_where_a_backend_reports_page_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's ``reports_bad_page_ids`` covers the page ids its kernels load, not slots: without a
    ``check_contents`` hook, mm3's own torch rules judge a slot batch on the device at every call (the CPU
    tensors stand in for device ones), and a slot edited in place raises at the next step."""
    from mm3.runtime import step

    monkeypatch.setattr(step, "on_host", lambda batch: False)
    mock = MockBackend("reports_pages", addressings={"pages", "slots"}, reports_bad_page_ids=True)
    reg = Registry(plugins=[mock], entry_points=False)
    _, slotted = _cases(17)
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.bfloat16, max_decode_query_len=2,
                                backend="reports_pages", registry=reg)
    layer(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]   # host, once
    layer(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]   # device
    s = slotted.batch.slots  # type: ignore[attr-defined]
    s.table[s.rows[0], 5] = -1                       # a used position without a slot (read as the last one)
    layer(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]
    with pytest.raises(InputError, match=r"request 0, position 5: .*slot_table.* is not a slot of the cache"):
        layer(slotted.q, slotted.index_q, slotted.caches, slotted.batch)  # type: ignore[attr-defined]
