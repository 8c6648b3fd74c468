"""The optional ``index_scores`` op (docs/spec.md §3.6): the scores the fused indexers rank, written out.

On cpu_ref and (under Triton's interpreter) cuda and rocm, on fresh random
mixed steps (decodes with draft tokens and padding, prefills with and without a
prefix), into poisoned views of larger tensors: the scores against the fp64
oracle, and the top-k the vLLM drop-in takes from them
(:func:`~mm3.integrations.block_scores.select_topk`) equal to the backend's own
fused ``index_topk``, bit for bit, and to the oracle's under exact ties. Then
the op's boundary (arguments named, a backend without it), its guard rules,
selection (the indexer's own, or none, explained), and the drop-in's use of it
and of its torch scorer where a backend has none.
"""

from __future__ import annotations

import os

import pytest
import torch

import mm3
from host_reads import NoHostReads
from mm3 import InputError, SparseAttentionParams
from mm3.contract.errors import BackendUnavailableError, ContractViolation
from mm3.contract.hookspecs import ALL_OPS, Op
from mm3.debug.guard import checked_call
from mm3.integrations import targets
from mm3.integrations import vllm as ops
from mm3.integrations.block_scores import select_topk
from mm3.runtime import step
from mm3.runtime.config import Settings
from mm3.runtime.registry import Registry
from mm3.runtime.selection import requirements_for, select
from mm3.testing.conformance.cases import TIES
from mm3.testing.conformance.scores import check_scores
from mm3.testing.factories import make_case
from mm3.testing.helpers import RegistryFactory
from mm3.testing.mock import MockBackend
from mm3.testing.oracle import check_topk, oracle_index_scores, oracle_topk
from mm3_backends.cpu_ref import plugin as cpu_ref
from vllm_steps import vllm_step

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["cpu_ref", *(pytest.param(b, marks=pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1"))
                         for b in ("cuda", "rocm"))]
P = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)
STEPS = {
    "speculative_mixed": dict(decodes=(70, 33, 100), padding_decodes=1, prefills=((9, 40), (3, 3), (12, 75)),
                              decode_query_len=2),
    "decode": dict(decodes=(120, 17, 64), padding_decodes=1),
    "prefill": dict(prefills=((20, 20), (7, 90))),
}
POISON = 7777.0
#: a backend with the fused ops only, for every index cache dtype the steps here use
FUSED_ONLY = dict(priority=5, index_cache_dtypes={"bfloat16", "float16", "float32", "float8_e4m3fn"})


def _backend(name: str):  # type: ignore[no-untyped-def]
    from mm3.runtime.registry import default_registry

    return default_registry().get(name)


def _scores_into_poisoned_view(be, case, params: SparseAttentionParams, N: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``be.index_scores`` into a NaN-filled [H, T, N] transposed view of a larger poisoned tensor."""
    H, T = params.num_index_heads, case.batch.num_tokens
    full = torch.full((N + 3, T + 2, H), POISON).permute(2, 1, 0)          # [H, T + 2, N + 3], odd strides
    view = full[:, 1:T + 1, 2:N + 2].fill_(float("nan"))
    be.index_scores(case.index_q, case.caches, case.batch, params, view)
    rest = full.clone()
    rest[:, 1:T + 1, 2:N + 2] = POISON
    assert (rest == POISON).all(), "index_scores wrote outside its view"
    return view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step_name", sorted(STEPS))
@pytest.mark.parametrize("dtype,index_dtype", [("float32", "float32"), ("bfloat16", "float8_e4m3fn")])
def test_scores_are_the_oracles_and_their_topk_is_the_fused_indexers(backend: str, step_name: str, dtype: str,
                                                                       index_dtype: str) -> None:
    be = _backend(backend)
    seed = hash((backend, step_name, dtype)) % 1000
    case = make_case(P, **STEPS[step_name], dtype=dtype, index_dtype=index_dtype, seed=seed)
    T, N = case.batch.num_tokens, case.batch.block_table.shape[1] + 2
    scores = _scores_into_poisoned_view(be, case, P, N)
    check_scores(case, scores, {})
    got = torch.empty(P.num_index_heads, T, P.topk, dtype=torch.int32)
    select_topk(scores, case.batch.token_positions, got, block_size=P.block_size, init_blocks=P.init_blocks,
                local_blocks=P.local_blocks)
    fused = mm3.TopkBuffer.allocate(T, P.num_index_heads, P.topk, be.capabilities.topk_layout)
    be.index_topk(case.index_q, case.caches, case.batch, P, fused)
    assert torch.equal(got.sort(-1).values, fused.head_major().sort(-1).values)
    assert not check_topk(mm3.TopkBuffer(got), case.index_q, case.caches, case.batch, P)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ties", ["same_pages", "all_equal", "half_tied", "nan_pages"])
def test_topk_of_tied_scores_goes_to_the_lowest_ids(backend: str, ties: str) -> None:
    """docs/spec.md §3.5's exact ties, planted in the keys: the top-k of the scores is the oracle's selection."""
    be = _backend(backend)
    case = make_case(P, **STEPS["speculative_mixed"], dtype="float32", index_dtype="float32", seed=3)
    TIES[ties](case.caches.index)
    T = case.batch.num_tokens
    scores = _scores_into_poisoned_view(be, case, P, case.batch.block_table.shape[1])
    got = torch.empty(P.num_index_heads, T, P.topk, dtype=torch.int32)
    select_topk(scores, case.batch.token_positions, got, block_size=P.block_size, init_blocks=P.init_blocks,
                local_blocks=P.local_blocks)
    want = oracle_topk(case.index_q, case.caches, case.batch, P).head_major()
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_index_scale_is_applied_and_forcing_follows_the_params() -> None:
    p = P.model_copy(update={"index_scale": 0.25, "init_blocks": 2, "local_blocks": 0})
    case = make_case(p, **STEPS["speculative_mixed"], dtype="float32", index_dtype="float32", seed=4)
    scores = _scores_into_poisoned_view(_backend("cpu_ref"), case, p, 9)
    ref = oracle_index_scores(case.index_q, case.caches, case.batch, p, 9)
    assert torch.allclose(scores.double(), ref.float().double(), rtol=1e-5, atol=1e-5, equal_nan=False)
    assert bool((scores == 1e30).any()) and not bool((scores == 1e29).any())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_fp8_index_caches_scores_carry_the_index_scale(backend: str, dtype: str) -> None:
    """A scale that is not 1 on an e4m3 index cache (bf16 queries: dotted in fp16 where the plugin says so, each
    row scaled and scaled back) reaches the scores' values, not only their order, which a uniform factor keeps:
    against the fp64 oracle of the same params, and not the oracle of the unscaled ones."""
    p = P.model_copy(update={"index_scale": 0.3})
    case = make_case(p, decodes=(70, 33), padding_decodes=1, prefills=((9, 40), (3, 3)), dtype=dtype,
                     index_dtype="float8_e4m3fn", seed=5)
    assert case.caches.index.dtype == torch.float8_e4m3fn
    N = case.batch.block_table.shape[1] + 1
    scores = _scores_into_poisoned_view(_backend(backend), case, p, N)
    check_scores(case, scores, {})
    unscaled = oracle_index_scores(case.index_q, case.caches, case.batch, P, N)
    free = (unscaled.abs() < 1e29) & (unscaled.abs() > 1)        # scored blocks, neither forced nor hidden
    assert bool(free.any())
    ratio = scores.double()[free] / unscaled[free]
    assert torch.allclose(ratio, torch.full_like(ratio, 0.3), rtol=1e-2), ratio


# -- the boundary --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out, match", [
    (lambda H, T: torch.empty(H, T, 8, dtype=torch.float16), r"out is torch.float16 .*float32 \[num_index_heads=2"),
    (lambda H, T: torch.empty(H + 1, T, 8), r"out is torch.float32 \(3, \d+, 8\); block scores need"),
    (lambda H, T: torch.empty(H, T - 1, 8), r">= \d+ tokens"),
    (lambda H, T: torch.empty(1, 1, 8).expand(H, T, 8), "share memory"),
    (lambda H, T: "scores", "out must be a torch.Tensor"),
])
def test_bad_outputs_are_named(out, match: str) -> None:  # type: ignore[no-untyped-def]
    case = make_case(P, **STEPS["decode"], dtype="float32", seed=5)
    with pytest.raises(InputError, match=match):
        _backend("cpu_ref").index_scores(case.index_q, case.caches, case.batch, P,
                                         out(P.num_index_heads, case.batch.num_tokens))


def test_a_backend_without_the_op_says_so() -> None:
    be = Registry([MockBackend("fused_only")], entry_points=False).get("fused_only")
    case = make_case(P, **STEPS["decode"], dtype="float32", seed=6)
    assert not be.provides("index_scores")
    with pytest.raises(BackendUnavailableError, match="does not provide 'index_scores'"):
        be.index_scores(case.index_q, case.caches, case.batch, P, torch.empty(2, case.batch.num_tokens, 8))


class _Misbehaving:
    """cpu_ref's scores, then one rule broken."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    @mm3.plugin.hookimpl
    def backend_capabilities(self):  # type: ignore[no-untyped-def]
        return cpu_ref.CAPABILITIES.model_copy(update={"name": "bad_scores"})

    @mm3.plugin.hookimpl
    def index_topk(self, index_q, caches, batch, params, out):  # type: ignore[no-untyped-def]
        cpu_ref.index_topk(index_q, caches, batch, params, out)

    @mm3.plugin.hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):  # type: ignore[no-untyped-def]
        cpu_ref.attention_forward(q, caches, topk, batch, params, out)

    @mm3.plugin.hookimpl
    def index_scores(self, index_q, caches, batch, params, out):  # type: ignore[no-untyped-def]
        if self.fault == "unwritten":
            return
        cpu_ref.index_scores(index_q, caches, batch, params, out)
        if self.fault == "hidden":
            out[:, :, -1] = 0.0
        elif self.fault == "nan":
            out[0, -1, 0] = float("nan")
        elif self.fault == "forced":
            out[:, :, 0] = torch.where(out[:, :, 0] == 1e30, 5.0, out[:, :, 0])
        elif self.fault == "outside":
            torch.as_strided(out, (1,), (1,), out.storage_offset() + out.shape[2] * out.stride(2)).fill_(1.0)


@pytest.mark.parametrize("fault", ["unwritten", "hidden", "nan", "forced", "outside"])
def test_the_guard_names_each_broken_rule(fault: str) -> None:
    be = RegistryFactory()(_Misbehaving(fault)).get("bad_scores")
    case = make_case(P, **STEPS["speculative_mixed"], dtype="float32", seed=7)
    T = case.batch.num_tokens
    full = torch.zeros(P.num_index_heads, T, case.batch.block_table.shape[1] + 1)
    with pytest.raises(ContractViolation, match=rf"index_scores: rule scores\.{fault}") as e:
        checked_call(be, Op.INDEX_SCORES, (case.index_q, case.caches, case.batch, P, full[:, :, :-1], None))
    assert e.value.rule == f"scores.{fault}"
    good = RegistryFactory()(cpu_ref).get("cpu_ref")
    checked_call(good, Op.INDEX_SCORES, (case.index_q, case.caches, case.batch, P, full[:, :, :-1], None))


# -- selection -------------------------------------------------------------------------------------------------

def test_selection_gives_the_scores_to_the_indexer_or_to_none_and_says_why() -> None:
    req = requirements_for(P, torch.float32, torch.float32, "cpu")
    both = Registry([MockBackend("fused_only", **FUSED_ONLY), cpu_ref], entry_points=False)
    layer_sel = select(req, both, device="cpu")            # a layer's step: no block scores asked for
    assert layer_sel.scorer is None and "index_scores" not in layer_sel.explain()
    sel = select(req.for_ops(*ALL_OPS), both, device="cpu")
    assert sel.indexer.name == "fused_only" and sel.scorer is None
    text = sel.explain()
    assert "index_scores:\n    fused_only  rejected: does not provide op(s) ['index_scores']" in text, text
    assert "block scores are the caller's to compute" in text and "torch scorer" in text
    sel = select(req.for_ops(*ALL_OPS), both, device="cpu", backend="cpu_ref")
    assert sel.scorer is not None and sel.scorer.name == "cpu_ref"
    assert "* cpu_ref  chosen" in sel.explain().split("index_scores:")[1]


# -- the vLLM drop-in ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_scores_come_from_the_selected_backend(backend: str) -> None:
    s = vllm_step(P, decodes=(70, 33), padding=1, prefills=((9, 40), (3, 3)), dql=2, seed=8)
    c, b = s.case, s.case.batch
    nd, td, H = s.num_decodes, s.decode_tokens, 2
    targets.configure(Settings(backend=backend, check_contracts="always"))
    try:
        dec = ops.minimax_m3_index_decode_score(c.index_q[:td], c.caches.index, s.block_table[:nd], s.seq_lens[:nd],
                                                b.max_seq_len, P.init_blocks, P.local_blocks, H, 2, 4)
        qsl = b.query_start_loc[nd:] - b.query_start_loc[nd]
        pre = ops.minimax_m3_index_score(c.index_q[td:], c.caches.index, s.block_table[nd:], qsl, s.seq_lens[nd:],
                                         b.context_lens[nd:], b.max_prefill_query_len, b.max_seq_len, H)
        sels = targets.selections()
    finally:
        targets.configure()
    width = -(-b.max_seq_len // 16 // 16) * 16
    assert dec.shape == pre.shape[:1] + (td, width) and pre.shape == (H, b.num_tokens - td, width)
    unforced = P.model_copy(update={"init_blocks": 0, "local_blocks": 0})
    ref = torch.cat([oracle_index_scores(c.index_q, c.caches, b, P, width)[:, :td],
                     oracle_index_scores(c.index_q, c.caches, b, unforced, width)[:, td:]], dim=1)
    got = torch.cat([dec, pre], dim=1).double()
    assert torch.equal(got.isinf(), ref.isinf()) and torch.allclose(got, ref.float().double(), rtol=1e-5, atol=1e-5)
    assert {x.scorer.name for x in sels if x.scorer is not None} == {backend}


def test_dropin_falls_back_to_the_torch_scorer_only_without_a_backends_and_reads_nothing_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry = Registry([MockBackend("fused_only", **FUSED_ONLY), cpu_ref], entry_points=False)
    s = vllm_step(P, decodes=(), prefills=((9, 40), (12, 75)), seed=9)
    c, b = s.case, s.case.batch
    monkeypatch.setattr(step, "on_host", lambda batch: False)   # the CPU table stands in for a device one
    targets.configure(Settings(check_contracts="first"), registry=registry)

    def scores() -> torch.Tensor:
        return ops.minimax_m3_index_score(c.index_q, c.caches.index, s.block_table, b.query_start_loc, s.seq_lens,
                                          b.context_lens, b.max_query_len, b.max_seq_len, 2)
    try:
        with mm3.use_backend("fused_only", registry=registry):
            first = scores()
            with NoHostReads():
                again = scores()
            (sel,) = targets.selections()
            bad = b.block_table.clone()
            bad[1, 2] = c.caches.num_pages + 5                  # found on the device, reported at the next call
            ops.minimax_m3_index_score(c.index_q, c.caches.index, bad, b.query_start_loc, s.seq_lens,
                                       b.context_lens, b.max_query_len, b.max_seq_len, 2)
            with pytest.raises(InputError, match=r"block_table\[1, 2\] is not a page id"):
                scores()
    finally:
        targets.configure()
    assert sel.scorer is None and "mm3's torch scorer" in sel.explain()
    unforced = P.model_copy(update={"init_blocks": 0, "local_blocks": 0})
    ref = oracle_index_scores(c.index_q, c.caches, b, unforced, first.shape[2])
    assert torch.equal(first, again) and torch.equal(first.isinf(), ref.isinf())
    assert torch.allclose(first.double(), ref.float().double(), rtol=1e-5, atol=1e-5)
