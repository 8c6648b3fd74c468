"""mm3.integrations.vllm on cpu_ref: vLLM's MiniMax-M3 op signatures against the fp64 oracle, in vLLM's conventions.

The seed's case first (token-major top-k storage behind a head-major view, a
mixed batch of decodes, a padding decode and prefills with a prefix), then
speculative decodes under ``torch.inference_mode()``, fp8 K/V (e4m3, e5m2) with
no scales, scalar, per-head and per-(KV head, slot) scales, ids a row must ignore, ``out=``'s
stable address, the score functions, and the arguments mm3 refuses.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mm3
from mm3 import InputError, SparseAttentionParams
from mm3.contract.buffers import TopkBuffer
from mm3.integrations import targets
from mm3.integrations import vllm as ops
from mm3.integrations.vllm_inputs import decode_batch
from mm3.runtime.config import Settings
from mm3.testing.oracle import oracle_attention, oracle_block_scores, oracle_topk
from vllm_steps import SENTINEL, assert_step_right, run_step, vllm_step

P = SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)
MIXED = dict(decodes=(70, 33, 100), padding=1, prefills=((9, 40), (5, 5), (12, 75)))


@pytest.fixture(autouse=True)
def _cpu_ref():
    with mm3.use_backend("cpu_ref"):
        yield
    targets.configure()


def _guard_every_call() -> None:
    targets.configure(Settings(backend="cpu_ref", check_contracts="always"))


def test_seed_case_mixed_batch_token_major_storage() -> None:
    s = vllm_step(P, **MIXED)
    run_step(s)
    assert_step_right(s)


def test_speculative_decode_in_inference_mode() -> None:
    with torch.inference_mode():
        s = vllm_step(P, decodes=(90, 40), padding=1, prefills=((7, 60),), dql=3, seed=1)
        run_step(s, max_dql=4)
    assert_step_right(s)


def test_every_call_guarded() -> None:
    _guard_every_call()
    s = vllm_step(P, **MIXED, seed=2)
    run_step(s)
    run_step(s)
    assert_step_right(s)


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("kv_scale", ["tensor", "head", "slot"])
def test_fp8_kv_scales(kv_scale: str, kv_dtype: str) -> None:
    s = vllm_step(P, **MIXED, kv_dtype=kv_dtype, kv_scale=kv_scale, seed=3)
    ks, vs = s.k_scale, s.v_scale
    if kv_scale == "tensor":     # vLLM's layer scale: one element
        ks, vs = ks[:1].clone().reshape(()), vs[:1].clone()
    if kv_scale == "slot":       # vLLM's buffer may hold more slots than the cache: read as the first ones
        ks = torch.cat([ks, torch.full((ks.shape[0], 16), float("nan"))], dim=1)
    run_step(s, k_scale=ks, v_scale=vs)
    assert_step_right(s)
    # the oracle reads the dequantized cache; unscaled values are far from it
    c = s.case
    raw = mm3.PagedKVCache(c.caches.k.double(), c.caches.v.double(), c.caches.index)
    unscaled = oracle_attention(c.q, raw, TopkBuffer(s.topk_view[:, :c.batch.num_tokens]), c.batch, P)
    assert float((s.output.double() - unscaled).abs().max()) > 1.0


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_without_scales_reads_values_as_stored(kv_dtype: str) -> None:
    """vLLM passes k_scale=v_scale=None for an fp8 cache it did not calibrate: the values are read as stored."""
    s = vllm_step(P, **MIXED, kv_dtype=kv_dtype, kv_scale="unit", seed=4)
    s.k_scale = s.v_scale = None
    run_step(s)
    assert_step_right(s)      # against the oracle on the cache with scale 1.0


def test_ignored_ids_select_nothing() -> None:
    """-1, negative ids, ids past the token's blocks and repeats add nothing (vLLM's decode kernel skips them)."""
    s = vllm_step(P, decodes=(70, 33), prefills=((9, 40),), seed=4)
    c, b = s.case, s.case.batch
    clean = oracle_topk(c.index_q, c.caches, b, P)
    dirty = clean.head_major().clone()
    dirty[:, :, 2] = dirty[:, :, 0]             # a repeat
    dirty[0, 0, 3] = 10 ** 6                    # past every block
    dirty[1, 1, 3] = -5                         # negative
    dirty[:, 2, 1] = b.token_positions[2] // P.block_size + 1   # the first block the token cannot see
    out = torch.full_like(c.q, float("nan"))
    nd, td = b.num_decodes, b.num_decode_tokens
    ops.minimax_m3_sparse_attn_decode(c.q[:td], s.kv_cache, dirty[:, :td], s.block_table[:nd], s.seq_lens[:nd],
                                      2, P.softmax_scale, out[:td], 1)
    qsl = b.query_start_loc[nd:] - b.query_start_loc[nd]
    ops.minimax_m3_sparse_attn(c.q[td:], s.kv_cache, dirty[:, td:], s.block_table[nd:], qsl, s.seq_lens[nd:],
                               b.context_lens[nd:], b.max_prefill_query_len, 2, P.softmax_scale, out[td:])
    ref = oracle_attention(c.q, c.caches, TopkBuffer(dirty), b, P)
    assert float((out.double() - ref).abs().max()) < 1e-5
    # and the repeats/garbage really changed what a literal reading would attend to
    assert float((ref - oracle_attention(c.q, c.caches, clean, b, P)).abs().max()) > 1e-3


def test_out_keeps_its_address_and_rows_past_the_step() -> None:
    s = vllm_step(P, decodes=(70, 33, 100), prefills=())
    c, b = s.case, s.case.batch
    out = torch.full((2, 8, 4), SENTINEL, dtype=torch.int32)   # head-major, capacity 8 > 3 tokens
    got = ops.minimax_m3_index_decode(c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len, 4, 1, 1,
                                      2, 1, 1, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (2, 3, 4)
    assert (out[:, 3:] == SENTINEL).all()
    fresh = ops.minimax_m3_index_decode(c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len, 4, 1,
                                        1, 2, 1, 1)
    assert fresh.is_contiguous() and torch.equal(fresh, got)


class _CountOps(TorchDispatchMode):
    """Counts the torch ops that run (on a GPU each is a kernel of the captured step)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func not in (torch.ops.aten.view.default, torch.ops.aten.unsqueeze.default):   # views: no kernel
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dql,kernels", [(1, 1), (2, 2)])
def test_decode_batch_is_what_from_device_derives(dql: int, kernels: int) -> None:
    """One small kernel per call (two with draft tokens: the padding positions' clamp); the context
    lengths, which no decode kernel reads, only when asked for, and then equal to from_device's."""
    sl = torch.tensor([40, 0, 17, 33], dtype=torch.int32)
    bt = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    decode_batch("f", sl, bt, dql, 4 * dql, 16, graph=False)      # the constants, made once per class
    with _CountOps() as counted:
        mine = decode_batch("f", sl, bt, dql, 4 * dql, 16, graph=False)
    assert len(counted.ops) == kernels, counted.ops
    ref = mm3.BatchMetadata.from_device(torch.arange(5, dtype=torch.int32) * dql, sl, bt, num_decodes=4,
                                        num_tokens=4 * dql, max_query_len=dql, block_size=16, decode_query_len=dql)
    for name in ("query_start_loc", "context_lens", "token_to_request", "token_positions"):
        assert torch.equal(getattr(mine, name), getattr(ref, name)), name
    assert mine.context_lens.tolist() == [40 - dql, 0, 17 - dql, 33 - dql]
    assert mine.validate().kind == ("decode" if dql == 1 else "speculative decode")


def test_decode_scores_are_the_oracles() -> None:
    s = vllm_step(P, decodes=(70, 33, 100), padding=1, prefills=(), dql=2, seed=5)
    c, b = s.case, s.case.batch
    nblk = -(-b.max_seq_len // 16)
    score_out = torch.full((8, 2, 16), 7.0).transpose(0, 1)        # a transposed view, as vLLM allows
    got = ops.minimax_m3_index_decode_score(c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len,
                                            1, 1, 2, 2, 2, score_out=score_out)
    assert got is score_out and (got[:, :, nblk:] == 7.0).all()
    for t, S in enumerate(oracle_block_scores(c.index_q, c.caches, b, P)):
        nb = S.shape[1]
        assert torch.allclose(got[:, t, :nb].double(), S, rtol=1e-5, atol=1e-4), t
        assert (got[:, t, nb:nblk] == float("-inf")).all()
    # index_decode with score_out: the same scores, and its top-k
    again = torch.zeros_like(score_out)
    ops.minimax_m3_index_decode(c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len, 4, 1, 1, 2, 2,
                                2, score_out=again)
    assert torch.equal(again[:, :, :nblk], got[:, :, :nblk])


def test_prefill_scores_and_topk_from_them() -> None:
    p = P.model_copy(update={"init_blocks": 0, "local_blocks": 0})   # unforced: oracle S = the raw scores
    s = vllm_step(p, decodes=(), prefills=((9, 40), (12, 75)), seed=6)
    c, b = s.case, s.case.batch
    score = ops.minimax_m3_index_score(c.index_q, c.caches.index, s.block_table, b.query_start_loc, s.seq_lens,
                                       b.context_lens, b.max_query_len, b.max_seq_len, 2)
    assert score.shape == (2, 21, 16) and score.dtype == torch.float32
    for t, S in enumerate(oracle_block_scores(c.index_q, c.caches, b, p)):
        assert torch.allclose(score[:, t, :S.shape[1]].double(), S, rtol=1e-5, atol=1e-4), t
    got = ops.minimax_m3_index_topk(score, b.query_start_loc, b.context_lens, b.max_query_len, 4, 0, 0,
                                    block_size=16)
    ref = oracle_topk(c.index_q, c.caches, b, p).head_major()
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)


def test_topk_from_tied_and_nan_scores_goes_to_lowest_ids() -> None:
    cu = torch.tensor([0, 2], dtype=torch.int32)
    prefix = torch.tensor([70], dtype=torch.int32)                      # positions 70, 71: 5 blocks
    score = torch.zeros(1, 2, 16)
    score[0, 0, 1] = float("nan")
    score[0, 1, 9] = 99.0                                                # past the visible blocks: ignored
    got = ops.minimax_m3_index_topk(score, cu, prefix, 2, 4, 0, 1, block_size=16)
    assert got[0, 0].tolist() == [4, 0, 2, 3]                            # local first, ties lowest, NaN last
    assert got[0, 1].tolist() == [4, 0, 1, 2]


@pytest.mark.parametrize("case, match", [
    ("heads", "num_kv_heads=3"),
    ("tokens", "decode_query_len=1; a decode batch holds"),
    ("fp8_flavour", "kv_cache: K/V cache dtype torch.float8_e4m3fnuz unsupported"),
    ("one_scale", "k_scale and v_scale must both be given"),
    ("prefix", r"request 0 has prefix_lens \d+, but its seq_len and query length give \d+ cached tokens"),
    ("cu_seqlens", "starts cu_seqlens_q at 2 instead of 0 .*must be rebased"),
    ("out_topk", r"out has shape \(2, 8, 5\), needs"),
    ("int64_table", "block_table must be int32"),
])
def test_unserved_arguments_are_named(case: str, match: str) -> None:
    s = vllm_step(P, decodes=(70, 33), prefills=((9, 40),), seed=7)
    c, b = s.case, s.case.batch
    qsl = b.query_start_loc[2:] - b.query_start_loc[2]
    attn = dict(q=c.q[2:], kv_cache=s.kv_cache, topk_idx=s.topk_view[:, 2:], block_table=s.block_table[2:],
                cu_seqlens_q=qsl, seq_lens=s.seq_lens[2:], prefix_lens=b.context_lens[2:], max_query_len=9,
                num_kv_heads=2, sm_scale=0.25, output=s.output[2:])
    dec = (c.index_q[:2], c.caches.index, s.block_table[:2], s.seq_lens[:2], b.max_seq_len, 4, 1, 1)
    _guard_every_call()   # the host checks of the lengths run where the guard runs: here, on every call
    with pytest.raises(InputError, match=match):
        if case == "heads":
            ops.minimax_m3_index_decode(*dec, 3, 1, 1)
        elif case == "tokens":
            ops.minimax_m3_index_decode(c.index_q[:3], *dec[1:], 2, 1, 1)
        elif case == "fp8_flavour":
            ops.minimax_m3_sparse_attn(**{**attn, "kv_cache": s.kv_cache.to(torch.float8_e4m3fnuz)})
        elif case == "one_scale":
            ops.minimax_m3_sparse_attn(**{**attn, "kv_cache": s.kv_cache.to(torch.float8_e4m3fn),
                                          "k_scale": torch.ones(1)})
        elif case == "prefix":
            ops.minimax_m3_sparse_attn(**{**attn, "prefix_lens": b.context_lens[2:] + 1})
        elif case == "cu_seqlens":   # the prefill slice not rebased to 0
            ops.minimax_m3_sparse_attn(**{**attn, "cu_seqlens_q": b.query_start_loc[2:]})
        elif case == "out_topk":
            ops.minimax_m3_index_decode(*dec, 2, 1, 1, out=torch.zeros(2, 8, 5, dtype=torch.int32))
        else:
            ops.minimax_m3_index_decode(c.index_q[:2], c.caches.index, s.block_table[:2].long(), *dec[3:], 2, 1, 1)


SCORE_FUNCTIONS = ("minimax_m3_index_decode", "minimax_m3_index_decode_score")
BAD_SCORE_OUT = {   # a bad score_out for 2 heads, 4 decode tokens and 7 blocks (more columns are allowed)
    "float16": (lambda: torch.zeros(2, 4, 16, dtype=torch.float16), r"score_out is torch.float16 .*float32"),
    "heads": (lambda: torch.zeros(3, 4, 16), r"score_out has shape \(3, 4, 16\), needs \[2, 4, >= 7\]"),
    "overlapping": (lambda: torch.zeros(2, 1, 16).expand(2, 4, 16), r"score_out has strides .* share memory"),
    "meta": (lambda: torch.zeros(2, 4, 16, device="meta"), r"score_out is on meta"),
}


@pytest.mark.parametrize("fn", SCORE_FUNCTIONS)
@pytest.mark.parametrize("bad", sorted(BAD_SCORE_OUT))
def test_a_bad_score_out_is_named_score_out_by_its_function(fn: str, bad: str) -> None:
    """vLLM calls the scores' argument score_out (their out is the top-k's): every refusal of it says so."""
    s = vllm_step(P, decodes=(70, 33, 100), padding=1, prefills=(), seed=9)
    c, b = s.case, s.case.batch
    make, match = BAD_SCORE_OUT[bad]
    dec = (c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len)
    with pytest.raises(InputError, match=f"^{fn}: {match}"):
        if fn == "minimax_m3_index_decode":
            ops.minimax_m3_index_decode(*dec, 4, 1, 1, 2, 1, 1, score_out=make())
        else:
            ops.minimax_m3_index_decode_score(*dec, 1, 1, 2, 1, 1, score_out=make())


@pytest.mark.parametrize("declares, kv_dtype, kv_scale, reason", [
    (dict(kv_slot_scales=False), "float8_e4m3fn", "slot", "cannot read K/V scales per token slot"),
    (dict(kv_cache_dtypes={"float32", "float8_e4m3fn"}), "float8_e5m2", "head",
     "cannot read float8_e5m2 K/V: of fp8 formats it reads float8_e4m3fn only"),
], ids=["slot_scales", "e5m2"])
def test_selection_explains_a_backend_that_cannot_read_the_kv_cache(declares: dict, kv_dtype: str, kv_scale: str,
                                                                    reason: str) -> None:
    """A backend that reads [Hkv] scales only, or e4m3 K/V only: pinned, selection says why; auto picks one
    that reads the cache."""
    from mm3.runtime.registry import Registry
    from mm3.testing.mock import MockBackend
    from mm3_backends.cpu_ref import plugin as cpu_ref

    limited = MockBackend("limited", priority=50, **declares)
    registry = Registry(plugins=[limited, cpu_ref], entry_points=False)
    targets.configure(registry=registry)
    s = vllm_step(P, decodes=(70,), prefills=(), kv_dtype=kv_dtype, kv_scale=kv_scale, seed=8)
    c = s.case
    args = (c.q, s.kv_cache, s.topk_view[:, :1], s.block_table, s.seq_lens, 2, 0.25, s.output, 1, s.k_scale,
            s.v_scale)
    with mm3.use_backend("limited", registry=registry), pytest.raises(mm3.BackendUnavailableError, match=reason):
        ops.minimax_m3_sparse_attn_decode(*args)
    with mm3.use_backend("auto", registry=registry):
        s.topk_view[:, :1] = 0
        ops.minimax_m3_sparse_attn_decode(*args)
    chosen = [x for x in targets.selections()
              if (x.requirements.kv_cache_dtype, x.requirements.kv_slot_scales) == (kv_dtype, kv_scale == "slot")]
    assert chosen and all(x.attention.name == "cpu_ref" for x in chosen)
    assert "limited  rejected: " in chosen[-1].explain() and reason in chosen[-1].explain()


def test_captured_calls_need_an_eager_first_call_and_a_graph_safe_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under capture nothing is bound (that allocates), and cpu_ref, which is not CUDA-graph safe, is refused."""
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=9)
    c, b = s.case, s.case.batch
    args = (c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len, 4, 1, 1, 2, 1, 1)
    targets.configure()
    monkeypatch.setattr(ops, "capturing", lambda t: True)
    with pytest.raises(InputError, match="inside CUDA-graph capture, where mm3 cannot select"):
        ops.minimax_m3_index_decode(*args)
    monkeypatch.setattr(ops, "capturing", lambda t: False)
    ops.minimax_m3_index_decode(*args)
    monkeypatch.setattr(ops, "capturing", lambda t: True)
    with pytest.raises(mm3.BackendUnavailableError, match="'cpu_ref', selected for this call, is not CUDA-graph"):
        ops.minimax_m3_index_decode(*args)


def test_page_faults_of_every_choice_are_reported() -> None:
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=10)
    c, b = s.case, s.case.batch
    bad = s.block_table.clone()
    bad[1, 0] = c.caches.num_pages + 3
    targets.configure()
    with pytest.raises(InputError, match=r"block_table\[1, 0\] = \d+ is not a page id"):
        ops.minimax_m3_index_decode(c.index_q, c.caches.index, bad, s.seq_lens, b.max_seq_len, 4, 1, 1, 2, 1, 1)
    targets.check_page_ids()   # a host table is checked where it is used: nothing pending


def test_the_guard_checks_the_first_call_of_each_kind_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_contracts="first": each function's first decode call is guarded, later ones run the plain hooks."""
    import mm3.debug.guard as guard_mod

    calls: list[str] = []
    real = guard_mod.checked_call
    monkeypatch.setattr(guard_mod, "checked_call", lambda be, op, args, **k: (calls.append(op), real(be, op, args, **k))[1])
    targets.configure()
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=14)
    c, b = s.case, s.case.batch
    view = s.topk_view
    for _ in range(3):
        ops.minimax_m3_index_decode(c.index_q, c.caches.index, s.block_table, s.seq_lens, b.max_seq_len, 4, 1, 1, 2,
                                    1, 1, out=view)
        ops.minimax_m3_sparse_attn_decode(c.q, s.kv_cache, view, s.block_table, s.seq_lens, 2, P.softmax_scale,
                                          s.output, 1)
    assert calls == ["index_topk", "attention"]
