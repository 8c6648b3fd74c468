"""Every content rule of a batch, broken alone, is caught on the host and on the device, naming where.

mm3/contract/contents.py lists the rules a batch's tensors must keep (the query
starts, the lengths, each token's position and request, the context lengths,
the page ids). They are judged in two places: on the host (``check_on_host``:
a batch in host memory, or the first step of a shape class) and on the device
(``FaultFlag.record``, raised by ``raise_pending`` at the next step). The table
below holds one batch per rule that breaks that rule and no other, so a rule
removed from either place fails its case: the other rules do not cover for it.
Each message must name the request (or token) at fault.

Then the same fault end to end: a device batch whose prefill's ``seq_len``
falls below its query length after the first step (so only the device-side
check can see it), on cpu_ref, which reports no bad contents itself.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import pytest
import torch

import mm3
import mm3.runtime.step as step_mod
from mm3 import BatchMetadata, InputError
from mm3.contract.contents import FaultFlag, check_on_host
from mm3.contract.facts import LAYER_NAMES
from mm3.runtime.registry import default_registry
from mm3.testing.factories import Case, make_case

#: pages in the cache the batches below index
PAGES = 12
#: four requests: two decodes (one token each), two prefills of 5 and 3 tokens; blocks of 16, 3 per row
GOOD = dict(qsl=(0, 1, 2, 7, 10), sl=(40, 20, 5, 35), T=10, nd=2, mq=5)
TABLE = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def _i32(values: Any) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def _batch(qsl: tuple[int, ...] = GOOD["qsl"], sl: tuple[int, ...] = GOOD["sl"], T: int = GOOD["T"],
           nd: int = GOOD["nd"], mq: int = GOOD["mq"], ndt: Optional[int] = None,
           ctx: Optional[tuple[int, ...]] = None, edit: Optional[Callable[[BatchMetadata], None]] = None
           ) -> BatchMetadata:
    """A batch made the way an engine makes one from its device tensors: contents are not checked here."""
    b = BatchMetadata.from_device(_i32(qsl), _i32(sl), torch.tensor(TABLE, dtype=torch.int32), num_decodes=nd,
                                  num_tokens=T, max_query_len=mq, block_size=16, num_decode_tokens=ndt,
                                  context_lens=None if ctx is None else _i32(ctx))
    if edit is not None:
        edit(b)
    return b


# (the rule, a batch that breaks it alone, what the message says: where, and which rule); "\S+" stands
# for a value the device does not carry back
BAD = [
    ("1 query starts at 0", lambda: _batch(qsl=(1, 1, 2, 7, 10)),
     r"request 0 starts \S*query_start_loc at \S+ instead of 0"),
    ("2 query starts never decrease", lambda: _batch(qsl=(0, 1, 2, 11, 10), mq=9),
     r"request 3 has a negative query length"),
    ("3 query starts end at the step's tokens", lambda: _batch(qsl=(0, 1, 2, 7, 9)),
     r"request 3 ends \S*query_start_loc at \S+ tokens, but the step has 10"),
    ("4 a decode holds decode_query_len tokens or none", lambda: _batch(qsl=(0, 2, 3, 8, 10), ndt=3),
     r"request 0 is one of the num_decodes=2 decodes but holds \S+ query tokens, not decode_query_len=1"),
    ("5 the decodes hold num_decode_tokens", lambda: _batch(ndt=3),
     r"request 0 closes the decodes at token \S+, but num_decode_tokens is 3"),
    ("6 seq_len at least the query length", lambda: _batch(sl=(40, 20, 5, 2)),
     r"request 3 has seq_len \S+ < query_len"),
    ("7 a prefill holds a token", lambda: _batch(qsl=(0, 1, 2, 2, 5), sl=(40, 20, 0, 35), T=5),
     r"request 2 is a prefill without query tokens"),
    ("8 a prefill holds at most max_prefill_query_len", lambda: _batch(mq=4),
     r"request 2 holds \S+ query tokens, more than max_prefill_query_len=4"),
    ("9 the blocks fit the table", lambda: _batch(sl=(49, 20, 5, 35)),
     r"request 0 has seq_len \S+, which needs \S+ blocks of 16 but the block table has only 3 columns"),
    ("10 positions are the lengths'", lambda: _batch(edit=lambda b: b.token_positions.__setitem__(5, 99)),
     r"token 5 has a position or request that the lengths do not give"),
    ("10 requests are the lengths'", lambda: _batch(edit=lambda b: b.token_to_request.__setitem__(8, 2)),
     r"token 8 has a position or request that the lengths do not give"),
    ("11 context lengths are the lengths'", lambda: _batch(ctx=(39, 19, 1, 32)),
     r"request 2 has \S*context_lens \S+"),
    ("page ids are pages of the cache", lambda: _batch(edit=lambda b: b.block_table.__setitem__((3, 1), PAGES)),
     r"request 3, block 1: \S*block_table\[3, 1\].* is not a page id in \[0, 12\)"),
    ("page ids are not negative", lambda: _batch(edit=lambda b: b.block_table.__setitem__((0, 2), -1)),
     r"request 0, block 2: \S*block_table\[0, 2\].* is not a page id in \[0, 12\)"),
]
CASES = [pytest.param(make, match, id=rule) for rule, make, match in BAD]

# batches that keep every rule, the edge of each included: both forms of padding decode (no token; a token
# with seq_len 0, which is below its query length and allowed), a prefill's seq_len equal to its query
# length, seq_len filling the table's last column, the largest prefill, a page id at the cache's end
FINE = {
    "plain": lambda: _batch(),
    "padding decode of one token, seq_len 0": lambda: _batch(sl=(0, 20, 5, 35)),
    "padding decode of no token": lambda: _batch(qsl=(0, 0, 1, 6, 9), T=9, ndt=1),
    "a fresh prefill, the last column, the last page": lambda: _batch(
        sl=(48, 20, 5, 3), edit=lambda b: b.block_table.__setitem__((0, 2), PAGES - 1)),
}


@pytest.mark.parametrize("make,match", CASES)
def test_the_host_check_names_the_broken_rule(make: Callable[[], BatchMetadata], match: str) -> None:
    with pytest.raises(InputError, match=f"^host step: {match}"):
        check_on_host(make(), PAGES, entry="host step")


def _judge_on_device(batch: BatchMetadata, flag: FaultFlag, checker: str) -> None:
    """The device check: mm3's torch ops (``FaultFlag.record``), or a backend's ``check_contents`` hook (the
    Triton plugins' one launch, through the interpreter)."""
    if checker == "torch":
        flag.record(batch, PAGES)          # torch ops on the batch's device, no host read
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton plugins on CPU tensors need the interpreter")
    hook = default_registry().get(checker).check_contents
    assert hook is not None
    flag.about("mm3", LAYER_NAMES, PAGES, batch)     # what the boundary names before it calls the hook
    hook(batch, PAGES, flag.word)


CHECKERS = ["torch", "cuda", "rocm"]


@pytest.mark.parametrize("checker", CHECKERS)
@pytest.mark.parametrize("make,match", CASES)
def test_the_device_check_names_the_broken_rule(make: Callable[[], BatchMetadata], match: str, checker: str) -> None:
    flag = FaultFlag("cpu")
    _judge_on_device(make(), flag, checker)
    with pytest.raises(InputError, match=f"{match}.*found on the device"):
        flag.raise_pending()
    flag.raise_pending()                # reported once: the word is cleared


@pytest.mark.parametrize("checker", CHECKERS)
@pytest.mark.parametrize("name", sorted(FINE))
def test_batches_that_keep_every_rule_pass_both_checks(name: str, checker: str) -> None:
    batch = FINE[name]()
    check_on_host(batch, PAGES, entry="host step")
    flag = FaultFlag("cpu")
    _judge_on_device(batch, flag, checker)
    flag.raise_pending()


# -- end to end: a device batch refilled with a prefill shorter than its query -----------------------------

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)


@pytest.mark.parametrize("reported_at", ["the next step", "check_page_ids"])
def test_a_prefill_seq_len_below_its_query_after_the_first_step_is_found_on_the_device(
        reported_at: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_ref reports no bad contents itself, and the table is a device one (CPU tensors stand in), so after
    the shape class's first step (checked on the host) only the device-side check sees the lengths."""
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30), (5, 40)], dtype="float32", seed=11)
    b = case.batch
    batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                      num_decodes=2, num_tokens=b.num_tokens, max_query_len=9, block_size=16)
    layer = mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="cpu_ref")
    assert not layer.selection.indexer.capabilities.reports_bad_page_ids
    layer(case.q, case.index_q, case.caches, batch)                     # the first step: on the host
    layer.check_page_ids()
    seq_lens = batch.seq_lens.clone()
    seq_lens[2] = 4                                                     # the first prefill holds 9 tokens
    batch.update_from_device_(batch.query_start_loc, seq_lens, batch.block_table)   # the engine's refill
    layer(case.q, case.index_q, case.caches, batch)                     # recorded on the device: no sync
    want = r"request 2 has seq_len \S+ < query_len .*found on the device"
    with pytest.raises(InputError, match=want):
        if reported_at == "the next step":
            layer(case.q, case.index_q, case.caches, batch)
        else:
            layer.check_page_ids()


def test_the_debugging_setting_waits_and_raises_in_the_step_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_contents_with_sync``: every eager step judges a device batch on the host, so the fault raises
    in the step that got it (and the default reports it one step later, from the device)."""
    from mm3.runtime.config import Settings

    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30)], dtype="float32", seed=12)
    b = case.batch
    for sync, raised in ((True, "in the step"), (False, "one step later")):
        batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                          num_decodes=2, num_tokens=b.num_tokens, max_query_len=9, block_size=16)
        layer = mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="cpu_ref",
                                    settings=Settings(check_contents_with_sync=sync))
        layer(case.q, case.index_q, case.caches, batch)
        batch.block_table[0, 1] = case.caches.num_pages + 5
        batch.update_from_device_(batch.query_start_loc, batch.seq_lens, batch.block_table)
        if raised == "in the step":
            with pytest.raises(InputError, match=r"request 0, block 1: batch.block_table\[0, 1\] = \d+ is not a page"):
                layer(case.q, case.index_q, case.caches, batch)
        else:
            layer(case.q, case.index_q, case.caches, batch)          # recorded on the device
            with pytest.raises(InputError, match=r"request 0, block 1: .*found on the device"):
                layer(case.q, case.index_q, case.caches, batch)


def test_a_failing_check_contents_hook_is_named_like_any_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin's ``check_contents`` that raises reaches the caller as a PluginError naming it and the hook."""
    from mm3.plugin import BackendCapabilities, hookimpl
    from mm3.runtime.registry import Registry
    from mm3_backends.cpu_ref import plugin as cpu_ref

    class Judge:
        @hookimpl
        def backend_capabilities(self) -> BackendCapabilities:
            return BackendCapabilities(name="judge", ops={"index_topk", "attention"}, device_types={"cpu"},
                                       topk_layout="head_major", dtypes={"float32"}, kv_cache_dtypes={"float32"},
                                       index_cache_dtypes={"float32"})

        @hookimpl
        def check_contents(self, batch: Any, num_pages: int, word: torch.Tensor) -> None:
            raise RuntimeError("the judge's kernel broke")

        @hookimpl
        def index_topk(self, index_q: Any, caches: Any, batch: Any, params: Any, out: Any) -> None:
            cpu_ref.index_topk(index_q=index_q, caches=caches, batch=batch, params=params, out=out)

        @hookimpl
        def attention_forward(self, q: Any, caches: Any, topk: Any, batch: Any, params: Any, out: Any) -> None:
            cpu_ref.attention_forward(q=q, caches=caches, topk=topk, batch=batch, params=params, out=out)

    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    case = make_case(P, decodes=[70, 40], dtype="float32", index_dtype="float32", seed=13)
    layer = mm3.SparseAttention(P, dtype=torch.float32, index_dtype=torch.float32, max_num_tokens=32,
                                backend="judge", registry=Registry([Judge()], entry_points=False))
    layer(case.q, case.index_q, case.caches, case.batch)       # the first step: judged on the host
    with pytest.raises(mm3.PluginError, match=r"backend 'judge'.*check_contents.*the judge's kernel broke"):
        layer(case.q, case.index_q, case.caches, case.batch)


@pytest.mark.parametrize("backend", ["cpu_ref", "cuda"])
def test_lengths_edited_in_place_on_the_same_batch_object_are_judged_again(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine rewrites seq_lens in place and calls again with the same batch object (no refill call): the
    next step judges what the tensors hold now, on the device, whatever judged them before. cpu_ref judges
    with mm3's torch operations, the cuda plugin (interpreter) in its indexer's launches."""
    if backend == "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton plugins on CPU tensors need the interpreter")
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    dtype = "float32" if backend == "cpu_ref" else "bfloat16"
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30)], dtype=dtype, seed=14)
    b = case.batch
    batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                      num_decodes=2, num_tokens=b.num_tokens, max_query_len=9, block_size=16)
    layer = mm3.SparseAttention(P, dtype=getattr(torch, dtype), max_num_tokens=32, backend=backend)
    layer(case.q, case.index_q, case.caches, batch)          # the first step: on the host
    layer(case.q, case.index_q, case.caches, batch)          # on the device: fine
    layer.check_page_ids()
    batch.seq_lens[2] = 4                                    # the prefill holds 9 tokens: seq_len 4 < 9
    layer(case.q, case.index_q, case.caches, batch)
    with pytest.raises(InputError, match=r"request 2 has seq_len \S+ < query_len .*found on the device"):
        layer.check_page_ids()


def test_a_bound_backends_own_calls_report_device_faults_at_check_page_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30)], dtype="float32", seed=16)
    be = default_registry().get("cpu_ref")
    rows = mm3.TopkBuffer.allocate(case.batch.num_tokens, P.num_kv_heads, P.topk, be.capabilities.topk_layout)
    be.index_topk(case.index_q, case.caches, case.batch, P, rows)      # the first call: judged on the host
    be.check_page_ids()
    case.batch.block_table[0, 1] = case.caches.num_pages + 2           # rewritten in place
    be.index_topk(case.index_q, case.caches, case.batch, P, rows)      # judged on the device: no wait
    with pytest.raises(InputError, match=r"cpu_ref\.index_topk: request 0, block 1: .*found on the device"):
        be.check_page_ids()


# -- the Triton indexer's own judge: a step of decodes is judged in its score launch ------------------------

#: three decodes of one token each (a step of decodes alone: the Triton indexer judges it in its score launch)
DECODES = dict(qsl=(0, 1, 2, 3), sl=(40, 20, 35), T=3)


def _decodes(qsl: tuple[int, ...] = DECODES["qsl"], sl: tuple[int, ...] = DECODES["sl"], T: int = DECODES["T"],
             ndt: Optional[int] = None, ctx: Optional[tuple[int, ...]] = None,
             edit: Optional[Callable[[BatchMetadata], None]] = None, device: str = "cpu", dql: int = 1
             ) -> BatchMetadata:
    b = BatchMetadata.from_device(_i32(qsl).to(device), _i32(sl).to(device),
                                  torch.tensor(TABLE[:3], dtype=torch.int32, device=device), num_decodes=3,
                                  num_tokens=T, max_query_len=dql, block_size=16, num_decode_tokens=ndt,
                                  context_lens=None if ctx is None else _i32(ctx).to(device), decode_query_len=dql)
    if edit is not None:
        edit(b)
    return b


# each a step of decodes that breaks a rule (or, the last three, none); what the check_contents hook finds
# in it, the indexer must find in the same words
DECODE_STEPS = {
    "1 query starts at 0": lambda d: _decodes(device=d, qsl=(1, 1, 2, 3)),
    "2 query starts never decrease": lambda d: _decodes(device=d, qsl=(0, 2, 1, 3)),
    "3 query starts end at the step's tokens": lambda d: _decodes(device=d, qsl=(0, 1, 2, 2)),
    "4 a decode holds decode_query_len tokens or none": lambda d: _decodes(device=d, qsl=(0, 2, 3, 3)),
    "5 the decodes hold num_decode_tokens": lambda d: _decodes(device=d, ndt=2),
    "6 seq_len at least the query length (a draft token each)": lambda d: _decodes(
        device=d, qsl=(0, 2, 4, 6), sl=(40, 1, 35), T=6, dql=2),
    "fine: a draft token each": lambda d: _decodes(device=d, qsl=(0, 2, 4, 6), sl=(40, 20, 35), T=6, dql=2),
    "9 the blocks fit the table": lambda d: _decodes(device=d, sl=(49, 20, 35)),
    "10 positions are the lengths'": lambda d: _decodes(device=d, edit=lambda b: b.token_positions.__setitem__(1, 33)),
    "10 requests are the lengths'": lambda d: _decodes(device=d, edit=lambda b: b.token_to_request.__setitem__(2, 0)),
    "11 context lengths are the lengths'": lambda d: _decodes(device=d, ctx=(39, 19, 30)),
    "page ids are pages of the cache":
        lambda d: _decodes(device=d, edit=lambda b: b.block_table.__setitem__((2, 1), PAGES)),
    "page ids are not negative": lambda d: _decodes(device=d, edit=lambda b: b.block_table.__setitem__((1, 0), -1)),
    "fine: plain": lambda d: _decodes(device=d),
    "fine: a padding decode": lambda d: _decodes(device=d, sl=(40, 0, 35)),
    "fine: a padding decode of no token": lambda d: _decodes(device=d, qsl=(0, 0, 1, 2), T=2, ndt=2),
    # a step without tokens: no kernel scores anything, its contents are judged all the same
    "page ids in a step without tokens": lambda d: _decodes(device=d, qsl=(0, 0, 0, 0), T=0, ndt=0,
                                                            edit=lambda b: b.block_table.__setitem__((2, 0), PAGES)),
    "fine: a step without tokens": lambda d: _decodes(device=d, qsl=(0, 0, 0, 0), T=0, ndt=0),
}


def _slot_decodes(device: str, edit: Optional[Callable[[Case], None]] = None) -> Case:
    """Three decodes through token slots (SGLang's page_size=1): a slot table row per request."""
    from mm3.testing.factories import as_token_slots

    case = as_token_slots(make_case(P, decodes=[70, 40, 33], dtype="bfloat16", seed=8, device=device),
                          torch.Generator().manual_seed(8))
    if edit is not None:
        edit(case)
    return case


def _slot(case: Case, request: int, column: int, value: int) -> None:
    slots = case.batch.slots
    assert slots is not None
    slots.table[int(slots.rows[request]), column] = value


SLOT_STEPS = {
    "fine": lambda d: _slot_decodes(d),
    "a slot past the cache": lambda d: _slot_decodes(d, lambda c: _slot(c, 1, 5, c.caches.num_pages)),
    "9 seq_len past the slot table's width": lambda d: _slot_decodes(d, _past_the_width),
}


def _past_the_width(case: Case) -> None:
    """Request 0's row filled with good slots to the table's last column, its seq_len one past it: rule 9 (a
    slot table's block is one position) and no bad slot."""
    slots = case.batch.slots
    assert slots is not None
    slots.table[int(slots.rows[0]), int(case.batch.seq_lens[0]):] = 0
    case.batch.seq_lens[0] = slots.width + 1


def _words(batch: BatchMetadata, plugin: str, case: Optional[Case] = None) -> tuple[int, int]:
    """The fault word of ``batch`` from the plugin's check_contents hook, and from its index_topk hook handed
    the word (``judges_contents``), each on a word of its own; on ``case``'s caches and queries, else random
    ones of ``PAGES`` pages."""
    from mm3.contract.contents import NO_FAULT

    be = default_registry().get(plugin)
    assert be.capabilities.judges_contents and be.check_contents is not None
    g = torch.Generator().manual_seed(3)
    dev = batch.block_table.device
    caches = case.caches if case is not None else mm3.PagedKVCache(*(
        torch.randn(*shape, generator=g).bfloat16().to(dev) for shape in (
            (PAGES, 16, P.num_kv_heads, P.head_dim), (PAGES, 16, P.num_kv_heads, P.head_dim),
            (PAGES, 16, P.index_head_dim))))
    index_q = case.index_q if case is not None else \
        torch.randn(batch.num_tokens, P.num_index_heads, P.index_head_dim, generator=g).bfloat16().to(dev)
    rows = mm3.TopkBuffer.allocate(batch.num_tokens, P.num_kv_heads, P.topk, be.capabilities.topk_layout, dev)
    by_hook, by_index = (torch.full((1,), NO_FAULT, dtype=torch.int64, device=dev) for _ in range(2))
    be.check_contents(batch, caches.num_pages, by_hook)
    be.calls["index_topk"](index_q, caches, batch, P, rows, by_index)
    return int(by_hook), int(by_index)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("plugin", ["cuda", "rocm"])
@pytest.mark.parametrize("name", sorted(DECODE_STEPS))
def test_the_indexer_judges_a_step_of_decodes_as_the_check_contents_hook_does(name: str, plugin: str,
                                                                              device: str) -> None:
    """The same word from both, on CPU tensors (the interpreter) and on a GPU (the compiled kernels)."""
    from mm3.contract.contents import NO_FAULT

    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton plugins on CPU tensors need the interpreter")
    if device == "cuda" and plugin == "rocm":
        pytest.skip("the rocm plugin's probe takes AMD GPUs only")
    by_hook, by_index = _words(DECODE_STEPS[name](device), plugin)
    assert (by_hook == NO_FAULT) == name.startswith("fine"), (name, hex(by_hook))
    if device == "cuda":   # programs that find faults at once race for the word (a plain store): any may win
        assert (by_index == NO_FAULT) == (by_hook == NO_FAULT), (name, hex(by_index), hex(by_hook))
        return
    assert by_index == by_hook, f"{name}: the indexer found {by_index:#x}, the check_contents hook {by_hook:#x}"


@pytest.mark.parametrize("step", ["decodes", "mixed", "prefills"])
def test_the_indexer_judges_each_step_in_one_launch(step: str) -> None:
    """Handed the word, the indexer judges a step of decodes in its score launch, and any other step in a
    launch of its own before its kernels (launches recorded, not made: a step with prefills has no score
    program per request); not handed it, it judges nothing."""
    from mm3_backends.triton import fast_launch

    batch = {"decodes": lambda: _decodes(), "mixed": _batch,
             "prefills": lambda: _batch(qsl=(0, 0, 0, 5, 8), sl=(0, 0, 5, 35), T=8, ndt=0)}[step]()
    be = default_registry().get("cuda")
    caches = mm3.PagedKVCache(*(torch.zeros(PAGES, 16, P.num_kv_heads, P.head_dim, dtype=torch.bfloat16)
                                for _ in range(2)), torch.zeros(PAGES, 16, P.index_head_dim, dtype=torch.bfloat16))
    index_q = torch.zeros(batch.num_tokens, P.num_index_heads, P.index_head_dim, dtype=torch.bfloat16)
    rows = mm3.TopkBuffer.allocate(batch.num_tokens, P.num_kv_heads, P.topk, be.capabilities.topk_layout)
    word = torch.zeros(1, dtype=torch.int64)
    for handed in (word, None):
        with fast_launch.recording() as launches:
            be.calls["index_topk"](index_q, caches, batch, P, rows, handed)
        names = [r.name for r in launches]
        judged = [r.name for r in launches if r.constexprs.get("JUDGE")]
        if handed is None:
            assert "_contents_kernel" not in names and not judged, names
        elif step == "decodes":
            assert judged == ["_decode_score_kernel"] and "_contents_kernel" not in names, names
        else:
            assert names[0] == "_contents_kernel" and names.count("_contents_kernel") == 1 and not judged, names
            assert any(a is word for a in launches[0].args)


def test_a_step_of_decodes_edited_in_place_is_judged_by_the_indexer_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda plugin declares ``judges_contents``: on a device batch (CPU tensors stand in) the layer makes no
    ``check_contents`` call after its first step, and a position edited in place still raises, found by the
    indexer's score launch."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton plugins on CPU tensors need the interpreter")
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    be = default_registry().get("cuda")
    assert be.capabilities.judges_contents
    calls: list[int] = []
    real = be.check_contents
    monkeypatch.setattr(be, "check_contents", lambda *a: (calls.append(1), real(*a)))  # type: ignore[misc]
    case = make_case(P, decodes=[70, 40, 33], prefills=[], dtype="bfloat16", seed=15)
    b = case.batch
    batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                      num_decodes=3, num_tokens=3, max_query_len=1, block_size=16)
    layer = mm3.SparseAttention(P, dtype=torch.bfloat16, max_num_tokens=8, backend="cuda")
    layer(case.q, case.index_q, case.caches, batch)          # the first step: on the host
    layer(case.q, case.index_q, case.caches, batch)          # on the device, in the indexer: fine
    layer.check_page_ids()
    batch.token_positions[1] = 12                             # the engine's edit: request 1 is at 39
    layer(case.q, case.index_q, case.caches, batch)
    with pytest.raises(InputError, match=r"token 1 has a position or request that the lengths do not give.*"
                                         r"found on the device"):
        layer.check_page_ids()
    assert not calls, "the layer called check_contents although its indexer judges the contents"


@pytest.mark.parametrize("name", sorted(SLOT_STEPS))
def test_the_indexer_judges_a_step_of_decodes_through_token_slots(name: str) -> None:
    """Token slots: the judge's block is one position (its table has a column per position)."""
    from mm3.contract.contents import NO_FAULT

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton plugins on CPU tensors need the interpreter")
    case = SLOT_STEPS[name]("cpu")
    by_hook, by_index = _words(case.batch, "cuda", case)
    assert (by_hook == NO_FAULT) == (name == "fine"), (name, hex(by_hook))
    assert by_index == by_hook, f"{name}: the indexer found {by_index:#x}, the check_contents hook {by_hook:#x}"


def test_the_attention_called_alone_still_judges_the_contents(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention op alone (a custom op's or the vLLM drop-in's second call) has no word to hand an indexer:
    the boundary judges its batch with the plugin's check_contents, so a position edited in place raises."""
    from mm3.contract.hookspecs import Op

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton plugins on CPU tensors need the interpreter")
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    case = make_case(P, decodes=[70, 40, 33], prefills=[], dtype="bfloat16", seed=17)
    b = case.batch
    batch = BatchMetadata.from_device(b.query_start_loc.clone(), b.seq_lens.clone(), b.block_table.clone(),
                                      num_decodes=3, num_tokens=3, max_query_len=1, block_size=16)
    layer = mm3.SparseAttention(P, dtype=torch.bfloat16, max_num_tokens=8, backend="cuda")
    out = torch.empty_like(case.q)
    layer(case.q, case.index_q, case.caches, batch, out=out)       # the first step: on the host
    target, rows = layer.op_target, layer.topk_buffer.rows(0, 3)
    target.run("attention alone", (Op.ATTENTION,), case.caches, batch, rows, q=case.q, out=out)
    layer.check_page_ids()
    batch.token_positions[2] = 5                                     # request 2 is at 32
    target.run("attention alone", (Op.ATTENTION,), case.caches, batch, rows, q=case.q, out=out)
    with pytest.raises(InputError, match=r"token 2 has a position or request that the lengths do not give.*"
                                         r"found on the device"):
        layer.check_page_ids()


def test_a_bound_backends_own_index_topk_judges_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound backend's own ``index_topk`` with no word of the caller's hands the hook its flag's word, so a
    judging indexer judges the step alone (no check_contents launch besides); given the caller's word, the
    boundary judges into the backend's flag and the hook into the caller's word (launches recorded)."""
    from mm3_backends.triton import fast_launch

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton plugins on CPU tensors need the interpreter")
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    be = default_registry().get("cuda")
    case = make_case(P, decodes=[70, 40], prefills=[], dtype="bfloat16", seed=19)
    rows = mm3.TopkBuffer.allocate(2, P.num_kv_heads, P.topk, be.capabilities.topk_layout)
    with fast_launch.recording():
        be.index_topk(case.index_q, case.caches, case.batch, P, rows)        # a first call: on the host
    for word in (None, torch.zeros(1, dtype=torch.int64)):
        with fast_launch.recording() as launches:
            be.index_topk(case.index_q, case.caches, case.batch, P, rows, word)
        names = [r.name for r in launches if r.name == "_contents_kernel" or r.constexprs.get("JUDGE")]
        assert names == (["_decode_score_kernel"] if word is None else ["_contents_kernel", "_decode_score_kernel"])
