"""cpu_ref against the fp64 oracle: fixed cases, garbage-filled caches, bad ids, random batches.

cpu_ref accumulates in fp32 and rounds once, so its attention is held to a
per-element bound of one unit in the last place of the output dtype (plus a
tiny absolute term), much tighter than docs/spec.md §4's conformance tolerances.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3 import SparseAttentionParams, TopkBuffer
from mm3.contract.errors import InputError
from mm3.runtime.registry import Registry
from mm3.testing.factories import Case, make_case
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk
from mm3_backends.cpu_ref.attention import attention_forward
from mm3_backends.cpu_ref.indexer import index_topk

SENTINEL = 123456789


def _params(H: int = 2, G: int = 2, D: int = 32, B: int = 16, K: int = 4, init: int = 0,
            local: int = 1) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=H * G, num_kv_heads=H, head_dim=D, num_index_heads=H,
                                 index_head_dim=D, block_size=B, topk=K, init_blocks=init,
                                 local_blocks=local)


def _run_indexer(case: Case, layout: str = "head_major", **kw: Any) -> TopkBuffer:
    """Index into rows(0, T) of a sentinel-filled buffer with spare rows; check the spares."""
    p, T = case.params, case.batch.num_tokens
    big = TopkBuffer.allocate(T + 3, p.num_index_heads, p.topk, layout, fill=SENTINEL)
    index_topk(case.index_q, case.caches, case.batch, p, big.rows(0, T), **kw)
    assert (big.head_major()[:, T:] == SENTINEL).all(), "indexer wrote rows past the step"
    return big.rows(0, T)


def _assert_indexer_ok(case: Case, buf: TopkBuffer) -> None:
    errors = check_topk(buf, case.index_q, case.caches, case.batch, case.params)
    assert not errors, f"{len(errors)} bad rows, first: {errors[0]}"


def _run_attention(case: Case, sel: TopkBuffer, **kw: Any) -> torch.Tensor:
    """Attention into the first T rows of a NaN-poisoned, larger output; check the spare rows."""
    T = case.batch.num_tokens
    out = torch.full((T + 2, *case.q.shape[1:]), float("nan"), dtype=case.q.dtype)
    attention_forward(case.q, case.caches, sel, case.batch, case.params, out[:T], **kw)
    assert out[T:].isnan().all(), "attention wrote rows past the step"
    return out[:T]


def _assert_attention_ok(case: Case, sel: TopkBuffer, out: torch.Tensor) -> None:
    ref = oracle_attention(case.q, case.caches, sel, case.batch, case.params)
    got = out.double()
    eps = torch.finfo(out.dtype).eps
    bound = ref.abs() * eps + 1e-6       # one ulp of the output dtype
    err = (got - ref).abs()
    bad = ~(err <= bound)                # NaN counts as bad
    assert not bad.any(), (f"{int(bad.sum())} elements off by more than 1 ulp; max err "
                           f"{float(err.nan_to_num(float('inf')).max()):.3g}, first at "
                           f"{bad.nonzero()[0].tolist()}")
    pad = case.batch.token_positions < 0
    assert (out[pad] == 0).all(), "padding tokens must output zeros"


MIXED = dict(decodes=[100, 33, 7], prefills=[(20, 20), (37, 150), (5, 40)], padding_decodes=1,
             empty_decodes=1)


# -- fixed cases --------------------------------------------------------------------------------


@pytest.mark.parametrize("H,G", [(1, 4), (2, 2), (4, 1)])
@pytest.mark.parametrize("dtype,index_dtype", [("bfloat16", "bfloat16"), ("float16", "float8_e4m3fn"),
                                               ("float32", "float32"), ("bfloat16", "float16")])
def test_mixed_batch_vs_oracle(H: int, G: int, dtype: str, index_dtype: str) -> None:
    p = _params(H, G, init=1, local=2)
    case = make_case(p, dtype=dtype, index_dtype=index_dtype, decode_query_len=3, seed=H * 10 + G,
                     **MIXED)
    sel = _run_indexer(case, layout="token_major")
    _assert_indexer_ok(case, sel)
    _assert_attention_ok(case, sel, _run_attention(case, sel))


@pytest.mark.parametrize("strategy", ["gather", "dense", "auto"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("max_elements", [1 << 24, 3000])
def test_attention_strategies_and_chunking(strategy: str, kv_layout: str, max_elements: int) -> None:
    p = _params(2, 3)
    case = make_case(p, dtype="float32", kv_layout=kv_layout, decode_query_len=2, seed=5, **MIXED)
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    out = _run_attention(case, sel, strategy=strategy, max_elements=max_elements)
    _assert_attention_ok(case, sel, out)


@pytest.mark.parametrize("max_elements", [1 << 24, 4000, 1])
@pytest.mark.parametrize("init,local", [(0, 0), (0, 1), (2, 2), (1, 0)])
def test_indexer_policies_and_chunking(max_elements: int, init: int, local: int) -> None:
    p = _params(2, 1, init=init, local=local)
    case = make_case(p, decodes=[90, 64, 17, 16, 200], decode_query_len=4,
                     prefills=[(70, 70), (33, 160)], padding_decodes=2, seed=init * 3 + local)
    _assert_indexer_ok(case, _run_indexer(case, max_elements=max_elements))


def test_short_contexts_fill_with_minus_one() -> None:
    p = _params(1, 2, K=6)
    case = make_case(p, decodes=[1, 17, 40], prefills=[(3, 3)], seed=2)
    buf = _run_indexer(case)
    _assert_indexer_ok(case, buf)
    rows = buf.head_major()[0]
    assert rows[0].tolist() == [0, -1, -1, -1, -1, -1]
    assert sorted(rows[2].tolist()[:3]) == [0, 1, 2] and rows[2].tolist()[3:] == [-1, -1, -1]


def test_speculative_decode_len_8_and_hnd_cache() -> None:
    p = _params(2, 4)
    case = make_case(p, decodes=[300, 129, 8], decode_query_len=8, prefills=[(9, 60)],
                     padding_decodes=1, kv_layout="HND", dtype="bfloat16", seed=8)
    sel = _run_indexer(case)
    _assert_indexer_ok(case, sel)
    _assert_attention_ok(case, sel, _run_attention(case, sel))


def test_padding_and_empty_decodes() -> None:
    p = _params(2, 2)
    case = make_case(p, decodes=[50], padding_decodes=3, empty_decodes=2, prefills=[(4, 30)],
                     decode_query_len=2, seed=4)
    sel = _run_indexer(case)
    pad = case.batch.token_positions < 0
    assert pad.sum() == 6
    assert (sel.head_major()[:, pad] == -1).all()
    out = _run_attention(case, sel)
    assert (out[pad] == 0).all()
    _assert_attention_ok(case, sel, out)


def test_all_padding_and_empty_step() -> None:
    p = _params(1, 2)
    case = make_case(p, padding_decodes=2, empty_decodes=1, seed=1)
    sel = _run_indexer(case)
    assert (sel.head_major() == -1).all()
    assert (_run_attention(case, sel) == 0).all()
    empty = make_case(p, empty_decodes=2, seed=1)
    assert empty.batch.num_tokens == 0
    _run_indexer(empty)
    _run_attention(empty, TopkBuffer.allocate(0, 1, p.topk))


def test_nan_index_query_keeps_forced_blocks_and_spares_other_tokens() -> None:
    p = _params(2, 2, init=1, local=1)
    case = make_case(p, decodes=[120, 90], prefills=[(10, 100)], seed=6)
    case.index_q[1, 0, 3] = float("nan")
    sel = _run_indexer(case)
    _assert_indexer_ok(case, sel)
    row = sel.head_major()[0, 1].tolist()
    assert 0 in row and (90 - 1) // p.block_size in row   # init block and the token's own block


def _poison_unused(case: Case) -> None:
    """NaN into every cache slot no request may read: spare pages and slots past seq_len."""
    B = case.params.block_size
    used = torch.zeros(case.caches.num_pages, B, dtype=torch.bool)
    bt = case.batch.block_table.tolist()
    for r, s in enumerate(case.batch.seq_lens_host):
        for j in range(s):
            used[bt[r][j // B], j % B] = True
    for t in (case.caches.k, case.caches.v, case.caches.index):
        t[~used] = float("nan")


@pytest.mark.parametrize("strategy", ["gather", "dense"])
def test_unwritten_cache_slots_never_reach_results(strategy: str) -> None:
    p = _params(2, 2, init=1)
    case = make_case(p, dtype="bfloat16", decode_query_len=2, seed=9, **MIXED)
    _poison_unused(case)
    sel = _run_indexer(case)
    _assert_indexer_ok(case, sel)
    out = _run_attention(case, sel, strategy=strategy)
    assert not out.isnan().any()
    _assert_attention_ok(case, sel, out)


@pytest.mark.parametrize("strategy", ["gather", "dense"])
def test_attention_reads_ids_as_a_set_of_visible_blocks(strategy: str) -> None:
    """Duplicates count once; -1, other negatives and ids >= nb select nothing (as the oracle)."""
    p = _params(1, 2, K=5)
    case = make_case(p, decodes=[70], prefills=[(4, 50)], dtype="float32", seed=3)
    sel = TopkBuffer.allocate(case.batch.num_tokens, 1, 5)
    sel.head_major()[0] = torch.tensor([[4, 4, 1, -1, -7], [0, 3, 9, 3, -1], [2, 1, 0, 3, 3],
                                        [3, 100, 2, -2, 0], [1, 1, 1, 1, 1]], dtype=torch.int32)
    _assert_attention_ok(case, sel, _run_attention(case, sel, strategy=strategy))


def test_buffers_in_any_layout_and_strides() -> None:
    p = _params(2, 2)
    case = make_case(p, decode_query_len=2, seed=11, **MIXED)
    T = case.batch.num_tokens
    results = []
    for layout in ("head_major", "token_major"):
        buf = _run_indexer(case, layout=layout)
        results.append(buf.head_major().clone())
        # Attention reads a non-contiguous slice of a larger buffer in either layout.
        big = TopkBuffer.allocate(T + 5, 2, p.topk, "token_major" if layout == "head_major" else "head_major")
        big.rows(2, T + 2).copy_(buf)
        out = torch.empty(p.num_heads, T, p.head_dim, dtype=case.q.dtype).permute(1, 0, 2)
        attention_forward(case.q, case.caches, big.rows(2, T + 2), case.batch, p, out)
        _assert_attention_ok(case, buf, out)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("strategy", ["gather", "dense"])
def test_non_contiguous_inputs_and_fp32_caches(strategy: str) -> None:
    """Strided q / index_q / out and fp32 HND caches (where .float() is a no-op view)."""
    p = _params(2, 3)
    base = make_case(p, dtype="float32", index_dtype="float32", kv_layout="HND", decode_query_len=2,
                     seed=14, **MIXED)

    def strided(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape[1], t.shape[0], t.shape[2], dtype=t.dtype).permute(1, 0, 2).copy_(t)

    case = Case(p, strided(base.q), strided(base.index_q), base.caches, base.batch)
    assert not case.q.is_contiguous() and not case.index_q.is_contiguous()
    sel = _run_indexer(case, max_elements=3000)
    _assert_indexer_ok(base, sel)
    _assert_attention_ok(base, sel, _run_attention(case, sel, strategy=strategy, max_elements=3000))


def test_input_errors_say_what_to_fix() -> None:
    """The bound backend checks the shared rules; cpu_ref itself only its own (the strategy)."""
    be = Registry(plugins=[cpu_ref], entry_points=False).get("cpu_ref")
    p = _params(2, 2)
    case = make_case(p, decodes=[40], seed=0)
    T = case.batch.num_tokens
    with pytest.raises(InputError, match="index_q has shape"):
        be.index_topk(case.index_q[:, :1], case.caches, case.batch, p, TopkBuffer.allocate(T, 2, 4))
    wrong_heads = r"the top-k buffer is head_major storage \[H, T, K\] = \(1, \d+, 4\), but the step needs \[H=2"
    with pytest.raises(InputError, match="cpu_ref.index_topk: " + wrong_heads):
        be.index_topk(case.index_q, case.caches, case.batch, p, TopkBuffer.allocate(T, 1, 4))
    with pytest.raises(InputError, match="block sizes disagree"):
        be.index_topk(case.index_q, case.caches, case.batch, p.model_copy(update={"block_size": 32}),
                      TopkBuffer.allocate(T, 2, 4))
    with pytest.raises(InputError, match="cpu_ref.attention_forward: " + wrong_heads):
        be.attention_forward(case.q, case.caches, TopkBuffer.allocate(T, 1, 4), case.batch, p,
                             torch.empty_like(case.q))
    with pytest.raises(InputError, match="strategy"):
        attention_forward(case.q, case.caches, TopkBuffer.allocate(T, 2, 4), case.batch, p,
                          torch.empty_like(case.q), strategy="fast")  # type: ignore[arg-type]


def test_plugin_declaration_and_registry_binding() -> None:
    be = Registry(plugins=[cpu_ref], entry_points=False).get("cpu_ref")
    caps = be.capabilities
    assert caps.topk_layout == "head_major" and not caps.topk_requires_contiguous
    assert caps.priority == 0 and caps.device_types == {"cpu", "cuda"}
    assert caps.max_decode_query_len >= 8 and not caps.cuda_graph_safe
    assert be.provides("index_topk") and be.provides("attention")
    assert be.probe("cpu").available and not be.probe("meta").available
    buf = be.alloc_topk_buffer(10, 2, 4, "cpu")
    assert buf.layout == "head_major" and buf.num_tokens == 10 and buf.is_contiguous()
    p = _params(2, 2)
    case = make_case(p, decodes=[60], prefills=[(5, 5)], seed=0)
    out = torch.empty_like(case.q)
    be.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, case.batch.num_tokens))
    be.attention_forward(case.q, case.caches, buf.rows(0, case.batch.num_tokens), case.batch, p, out)
    _assert_attention_ok(case, buf.rows(0, case.batch.num_tokens), out)


# -- random mixed batches --------------------------------------------------------------------------


@st.composite
def _steps(draw: st.DrawFn) -> dict[str, Any]:
    H = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 4]))
    B = draw(st.sampled_from([8, 16]))
    K = draw(st.integers(2, 6))
    init = draw(st.integers(0, 2))
    local = draw(st.integers(0, min(2, K - init)))
    dq = draw(st.integers(1, 4))
    decodes = draw(st.lists(st.integers(dq, 12 * B), max_size=4))
    prefills = draw(st.lists(st.tuples(st.integers(1, 3 * B), st.integers(0, 8 * B)), max_size=3))
    return dict(
        params=_params(H, G, D=16, B=B, K=K, init=init, local=local),
        decodes=decodes, decode_query_len=dq,
        prefills=[(q, q + ctx) for q, ctx in prefills],
        padding_decodes=draw(st.integers(0, 2)), empty_decodes=draw(st.integers(0, 1)),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        index_dtype=draw(st.sampled_from(["bfloat16", "float8_e4m3fn"])),
        kv_layout=draw(st.sampled_from(["NHD", "HND"])),
        layout=draw(st.sampled_from(["head_major", "token_major"])),
        strategy=draw(st.sampled_from(["auto", "gather", "dense"])),
        max_elements=draw(st.sampled_from([1 << 24, 2000])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=30, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_steps())
def test_random_mixed_batches(step: dict[str, Any]) -> None:
    layout, strategy, budget = step.pop("layout"), step.pop("strategy"), step.pop("max_elements")
    case = make_case(step.pop("params"), **step)
    sel = _run_indexer(case, layout=layout, max_elements=budget)
    _assert_indexer_ok(case, sel)
    out = _run_attention(case, sel, strategy=strategy, max_elements=budget)
    _assert_attention_ok(case, sel, out)


def test_deterministic() -> None:
    p = _params(2, 2)
    case = make_case(p, decode_query_len=2, seed=12, **MIXED)
    a, b = _run_indexer(case), _run_indexer(case)
    assert torch.equal(a.head_major(), b.head_major())
    assert torch.equal(_run_attention(case, a), _run_attention(case, a))


def test_product_of_layouts_matches() -> None:
    """Same numbers whatever the top-k layout, KV layout or strategy."""
    p = _params(2, 2)
    base = make_case(p, decode_query_len=2, seed=13, **MIXED)
    sel = oracle_topk(base.index_q, base.caches, base.batch, p)
    outs = []
    for kv, layout, strategy in itertools.product(["NHD", "HND"], ["head_major", "token_major"],
                                                  ["gather", "dense"]):
        case = Case(p, base.q, base.index_q, base.caches.to_layout(kv), base.batch)  # type: ignore[arg-type]
        outs.append(_run_attention(case, sel.to_layout(layout), strategy=strategy))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=torch.finfo(o.dtype).eps * 4)


def test_padding_only_step_on_an_empty_cache() -> None:
    """A CUDA-graph-style step of padding slots only, before any page exists: zeros, all -1."""
    import mm3
    from mm3.testing.factories import make_case

    p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                                  index_head_dim=16, block_size=16, topk=4)
    c = make_case(p, padding_decodes=2, dtype="float32", extra_pages=0)
    assert c.caches.num_pages == 0
    layer = mm3.SparseAttention(p, dtype=torch.float32, max_num_tokens=8, backend="cpu_ref")
    out = torch.full_like(c.q, float("nan"))
    layer(c.q, c.index_q, c.caches, c.batch, out=out)
    assert bool((out == 0).all())
    assert bool((layer.topk_buffer.rows(0, 2).head_major() == -1).all())
