"""One boundary for a step: what it remembers, and that no entry point gives a silent wrong answer.

* A target's plans are keyed by the facts engine traffic does not change: a change to one judges every
  rule again, a new token count does not; the rules read nothing but the facts value.
* Three inputs that used to pass silently raise through every entry point (the layer, the custom
  ops and the step op, the vLLM drop-in, the tensor-parallel layer): a block table rewritten in place after a good
  step; token-major top-k memory given to the ops (correct, read as the view it is); a
  ``from_device`` batch whose lengths contradict its query starts.
* Every batch tensor an engine rewrites in place between steps: the next step raises, or reads the
  new contents (checked against the fp64 oracle), never the old ones and never a silent difference.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch

import mm3
import mm3.runtime.step as step_mod
from mm3.contract.checks import check
from mm3.contract.facts import StepFacts
from mm3.integrations import targets
from mm3.integrations import vllm as ops
from mm3.runtime.config import Settings
from mm3.runtime.ops import batch_args
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention, oracle_topk

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)
STEP = dict(decodes=[70, 40], prefills=[(9, 30)], dtype="float32")


def _layer(**kw: Any) -> mm3.SparseAttention:
    return mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=32, backend="cpu_ref", **kw)


def _want(q: torch.Tensor, index_q: torch.Tensor, caches: mm3.PagedKVCache, batch: mm3.BatchMetadata,
          p: mm3.SparseAttentionParams = P) -> torch.Tensor:
    return oracle_attention(q, caches, oracle_topk(index_q, caches, batch, p), batch, p)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)    # fp32 against fp64


# -- the memo: keyed by the value, every field counts --------------------------------------------------

def _facts() -> StepFacts:
    layer, case = _layer(), make_case(P, seed=0, **STEP)
    t = layer.op_target
    out = torch.empty_like(case.q)
    return step_mod.describe("test", step_mod.BOTH, P, t.indexer, t.attention, caches=case.caches,
                             batch=case.batch, topk=t.topk, index_q=case.index_q, q=case.q, out=out,
                             layer=t.layer)


def test_every_fact_that_stays_is_part_of_the_plan_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target keeps a plan per facts that engine traffic does not change: a change to any of them (a
    dtype, a device, a head count, the caches, the layouts) judges every rule again; a new token count
    does not."""
    layer, case = _layer(), make_case(P, seed=0, num_pages=16, **STEP)
    runs: list[StepFacts] = []
    real = step_mod.check
    monkeypatch.setattr(step_mod, "check", lambda f: runs.append(f) or real(f))
    layer(case.q, case.index_q, case.caches, case.batch)
    other = make_case(P, seed=1, decodes=[33], prefills=[(5, 12), (2, 2)], dtype="float32", num_pages=16)
    layer(other.q, other.index_q, other.caches, other.batch)
    assert len(runs) == 1                                   # new counts, one plan
    c = case.caches
    for changed in (dict(caches=mm3.PagedKVCache(c.k[:-1], c.v[:-1], c.index[:-1])),
                    dict(q=case.q.double())):
        args = dict(q=case.q, index_q=case.index_q, caches=c, batch=case.batch)
        args.update(changed)
        before = len(runs)
        try:
            layer(**args)
        except mm3.InputError:    # judged, and refused (the layer was built for float32)
            pass
        assert len(runs) == before + 1, changed
    layer(case.q, case.index_q, case.caches, case.batch)
    assert len(runs) == 3                                   # an earlier plan is kept


def test_the_rules_read_the_facts_value_only() -> None:
    """``check`` takes one argument, and the value holds no tensor: a rule cannot read a tensor's contents,
    nor anything the key leaves out."""
    assert list(inspect.signature(check).parameters) == ["facts"]
    facts = _facts()
    stack: list[Any] = [facts]
    while stack:
        v = stack.pop()
        assert not isinstance(v, torch.Tensor)
        if isinstance(v, tuple):
            stack.extend(v)
    check(facts)


def test_a_fact_a_rule_reads_changes_the_key_and_the_verdict() -> None:
    """The out tensor's strides are a fact (the overlap rule reads them): an expand()-ed out is judged
    and refused, whatever passed before."""
    layer, case = _layer(), make_case(P, seed=0, **STEP)
    layer(case.q, case.index_q, case.caches, case.batch)
    overlapping = torch.empty(P.num_heads, P.head_dim)[None].expand(case.batch.num_tokens, -1, -1)
    with pytest.raises(mm3.InputError, match="share memory"):
        layer(case.q, case.index_q, case.caches, case.batch, overlapping)


# -- case 1: a block table rewritten in place --------------------------------------------------------------

def _rewrite_page(table: torch.Tensor, num_pages: int) -> None:
    table[0, 4] = num_pages + 100            # request 0 (70 tokens) uses blocks 0..4


def _tp_layer() -> Any:
    return mm3.TensorParallelSparseAttention(P, rank=0, world_size=1, dtype=torch.float32, max_num_tokens=32,
                                             backend="cpu_ref")


ENTRIES: dict[str, Callable[[Any, Any], None]] = {}


def _entry(name: str) -> Callable[[Callable[[Any, Any], None]], Callable[[Any, Any], None]]:
    def add(fn: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        ENTRIES[name] = fn
        return fn
    return add


@_entry("layer")
def _via_layer(layer: Any, case: Any) -> torch.Tensor:
    return layer(case.q, case.index_q, case.caches, case.batch)


@_entry("tensor-parallel layer")
def _via_tp(layer: Any, case: Any) -> torch.Tensor:
    return layer(case.q, case.index_q, case.caches, case.batch)


@_entry("custom ops")
def _via_ops(layer: Any, case: Any) -> torch.Tensor:
    c, args, h = case.caches, batch_args(case.batch), layer.op_target.handle
    out = torch.full_like(case.q, float("nan"))
    torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, layer.topk_buffer.storage, *args, h)
    torch.ops.mm3.attention(case.q, c.k, c.v, c.index, layer.topk_buffer.storage, *args, h, out)
    return out


@_entry("step op")
def _via_step_op(layer: Any, case: Any) -> torch.Tensor:
    c, args, h = case.caches, batch_args(case.batch), layer.op_target.handle
    out = torch.full_like(case.q, float("nan"))
    torch.ops.mm3.sparse_attention(case.q, case.index_q, c.k, c.v, c.index, layer.topk_buffer.storage, *args, h, out)
    return out


def _make(entry: str) -> Any:
    return _tp_layer() if entry == "tensor-parallel layer" else _layer()


@pytest.mark.parametrize("entry", ["layer", "tensor-parallel layer", "custom ops", "step op"])
@pytest.mark.parametrize("mode", ["first", "always", "never"])
def test_a_block_table_rewritten_in_place_raises(entry: str, mode: str) -> None:
    layer = _make(entry) if mode == "first" else _layer(settings=Settings(check_contracts=mode))
    an_op = entry in ("custom ops", "step op")
    run = ENTRIES[entry] if mode == "first" or an_op else ENTRIES["layer"]
    case = make_case(P, seed=1, **STEP)
    got = run(layer, case)                                              # a good step
    _close(got, _want(case.q, case.index_q, case.caches, case.batch))
    _rewrite_page(case.batch.block_table, case.caches.num_pages)       # the engine's next table, in place
    for _ in range(2):                                                  # every step, not once per batch
        with pytest.raises(mm3.InputError, match=r"request 0, block 4: .*block_table\[0, 4\] = \d+ is not a page id"):
            run(layer, case)


def test_a_block_table_rewritten_in_place_raises_through_the_dropin() -> None:
    from vllm_steps import vllm_step

    targets.configure()
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=2)
    c, b = s.case, s.case.batch
    args = (c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len, 4, 1, 1, 2, 1, 1)
    ops.minimax_m3_index_decode(*args)
    _rewrite_page(s.block_table, c.caches.num_pages)
    with pytest.raises(mm3.InputError, match=r"minimax_m3_index_decode: request 0, block 4: block_table\[0, 4\]"):
        ops.minimax_m3_index_decode(*args)
    with pytest.raises(mm3.InputError, match=r"minimax_m3_sparse_attn_decode: request 0, block 4"):
        ops.minimax_m3_sparse_attn_decode(c.q, s.kv_cache, s.topk_view, s.block_table, s.seq_lens, 2,
                                          P.softmax_scale, s.output, 1)


def test_check_page_ids_reports_a_device_fault_of_an_earlier_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table the host cannot read without a sync (CPU tensors stand in for device ones): cpu_ref does not
    report bad ids itself, so the step records the check on the device and check_page_ids() raises."""
    monkeypatch.setattr(step_mod, "on_host", lambda batch: False)
    layer, case = _layer(), make_case(P, seed=3, **STEP)
    layer(case.q, case.index_q, case.caches, case.batch)               # the class's first step: on the host
    _rewrite_page(case.batch.block_table, case.caches.num_pages)
    layer(case.q, case.index_q, case.caches, case.batch)               # recorded, no sync
    with pytest.raises(mm3.InputError, match=r"request 0, block 4: .*found on the device"):
        layer.check_page_ids()


# -- case 2: token-major top-k memory through the custom ops -----------------------------------------------

def test_token_major_memory_through_the_ops_is_read_as_the_view_it_is() -> None:
    """The ops read a caller's top-k tensor as the logical [H, T, K] view (vLLM's convention) for both the
    indexer and the attention, so [T, H, K] memory with T == H is one consistent view: the answer is right."""
    layer = _layer()
    case = make_case(P, decodes=[70, 40], dtype="float32", seed=4)     # T == H == 2
    c, args, h = case.caches, batch_args(case.batch), layer.op_target.handle
    memory = torch.full((2, 2, P.topk), -7, dtype=torch.int32)          # [T, H, K], token-major
    out = torch.full_like(case.q, float("nan"))
    torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, memory, *args, h)
    torch.ops.mm3.attention(case.q, c.k, c.v, c.index, memory, *args, h, out)
    _close(out, _want(case.q, case.index_q, c, case.batch))
    right = memory.permute(1, 0, 2)                                    # the honest view of the same memory
    out2 = torch.full_like(case.q, float("nan"))
    torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, right, *args, h)
    torch.ops.mm3.attention(case.q, c.k, c.v, c.index, right, *args, h, out2)
    torch.testing.assert_close(out2, out)


def test_token_major_memory_of_another_token_count_names_the_layout() -> None:
    layer = _layer()
    case = make_case(P, decodes=[70, 40, 33], dtype="float32", seed=5)  # T = 3, H = 2
    c, args, h = case.caches, batch_args(case.batch), layer.op_target.handle
    memory = torch.full((3, 2, P.topk), -1, dtype=torch.int32)          # [T, H, K] passed as if [H, T, K]
    with pytest.raises(mm3.InputError, match=r"torch.ops.mm3.index_topk: topk is head_major storage \[H, T, K\] "
                                             r"= \(3, 2, 4\).*vLLM's MiniMax-M3 bug; pass the logical \[H, T, K\] view"):
        torch.ops.mm3.index_topk(case.index_q, c.k, c.v, c.index, memory, *args, h)


# -- case 3: a from_device batch whose lengths contradict each other --------------------------------------

def _short_seq_batch() -> tuple[Any, mm3.BatchMetadata]:
    case = make_case(P, prefills=[(9, 30)], dtype="float32", seed=6)
    b = case.batch
    bad = mm3.BatchMetadata.from_device(b.query_start_loc, torch.tensor([3], dtype=torch.int32), b.block_table,
                                        num_decodes=0, num_tokens=9, max_query_len=9, block_size=16)
    return case, bad


@pytest.mark.parametrize("entry", ["layer", "tensor-parallel layer", "custom ops", "step op"])
def test_a_from_device_batch_with_contradicting_lengths_raises(entry: str) -> None:
    case, bad = _short_seq_batch()
    assert bad.token_positions.tolist()[:3] == [-1, -1, -1]             # derived as given: no position for them
    layer = _make(entry)
    with pytest.raises(mm3.InputError, match=r"request 0 has seq_len 3 < query_len 9"):
        ENTRIES[entry](layer, type(case)(case.params, case.q, case.index_q, case.caches, bad))


def test_a_prefill_whose_seq_len_is_shorter_than_its_query_raises_through_the_dropin() -> None:
    from vllm_steps import combined_kv

    targets.configure()
    case, _ = _short_seq_batch()
    b = case.batch
    topk = torch.zeros(2, 9, P.topk, dtype=torch.int32)
    with pytest.raises(mm3.InputError, match=r"minimax_m3_sparse_attn: request 0 has seq_len 3 < query_len 9"):
        ops.minimax_m3_sparse_attn(case.q, combined_kv(case), topk, b.block_table, b.query_start_loc,
                                   torch.tensor([3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 9, 2,
                                   P.softmax_scale, torch.empty_like(case.q))


# -- every batch tensor rewritten in place between steps ----------------------------------------------------

def _rewrite(batch: mm3.BatchMetadata, what: str, num_pages: int) -> None:
    """Rewrite one of the batch's tensors in place, as an engine's buggy update might."""
    if what == "block_table (bad id)":
        batch.block_table[2, 1] = num_pages + 1
    elif what == "block_table (other page)":      # a valid page: the step must read it
        batch.block_table[0, 2] = int(batch.block_table[1, 0])
    elif what == "seq_lens":
        batch.seq_lens[0] += 3
    elif what == "query_start_loc":
        batch.query_start_loc[2] += 1
    elif what == "token_positions":
        batch.token_positions[5] += 1
    elif what == "token_to_request":
        batch.token_to_request[4] = 0
    elif what == "context_lens":
        batch.context_lens[2] -= 1


REWRITES = ["block_table (bad id)", "block_table (other page)", "seq_lens", "query_start_loc", "token_positions",
            "token_to_request", "context_lens"]


@pytest.mark.parametrize("entry", ["layer", "tensor-parallel layer", "custom ops", "step op"])
@pytest.mark.parametrize("what", REWRITES)
def test_an_in_place_rewrite_raises_or_is_read(entry: str, what: str) -> None:
    layer = _make(entry)
    case = make_case(P, seed=7, **STEP)
    ENTRIES[entry](layer, case)
    _rewrite(case.batch, what, case.caches.num_pages)
    try:
        got = ENTRIES[entry](layer, case)
    except mm3.InputError:
        assert what != "block_table (other page)"
        return
    assert what == "block_table (other page)", f"{what} rewritten in place passed silently"
    _close(got, _want(case.q, case.index_q, case.caches, case.batch))


DROPIN_REWRITES = {
    "block_table": lambda t: t["block_table"].__setitem__((0, 1), 10_000),
    "seq_lens": lambda t: t["seq_lens"].__setitem__(0, 2),                 # shorter than its query
    "cu_seqlens_q": lambda t: t["cu_seqlens_q"].__setitem__(1, 4),
    "prefix_lens": lambda t: t["prefix_lens"].__setitem__(0, 0),
}


@pytest.mark.parametrize("what", sorted(DROPIN_REWRITES))
def test_an_in_place_rewrite_of_vllms_tensors_raises_through_the_dropin(what: str) -> None:
    """vLLM refills its metadata tensors in place every step: the drop-in judges what they hold at each call."""
    from vllm_steps import vllm_step

    targets.configure()
    s = vllm_step(P, decodes=(), prefills=((9, 40), (5, 5)), seed=8)
    c, b = s.case, s.case.batch
    t = dict(block_table=s.block_table.clone(), seq_lens=s.seq_lens.clone(), cu_seqlens_q=b.query_start_loc.clone(),
             prefix_lens=b.context_lens.clone())

    def call() -> None:
        ops.minimax_m3_sparse_attn(c.q, s.kv_cache, s.topk_view, t["block_table"], t["cu_seqlens_q"], t["seq_lens"],
                                   t["prefix_lens"], 9, 2, P.softmax_scale, s.output)
    call()
    DROPIN_REWRITES[what](t)
    with pytest.raises(mm3.InputError, match=r"^minimax_m3_sparse_attn: "):
        call()
