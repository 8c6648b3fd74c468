"""mm3.integrations.sglang on cpu_ref: SGLang's MiniMax-M3 sparse functions against the fp64 oracle.

SGLang's layouts (token-major K/V, ``[slots, 1, Di]`` index keys,
``req_to_token[slot_ids[b], position]`` or a batch-local ``page_table``), pages
scattered at random, and its call patterns: decode rows (a padding row, verify
rows of one request), chunked prefill and mixed extend batches, the
kernel-level index/attention pairs, ``req_to_token`` rewritten in place between
steps, fp8 K/V with per-tensor scales; the ascending top-k order, ``-1`` and
repeats inside a row, non-contiguous pages, and the arguments mm3 refuses.
"""

from __future__ import annotations

import pytest
import torch

import mm3
from mm3 import InputError, SparseAttentionParams
from mm3.contract.buffers import PagedKVCache
from mm3.integrations import sglang as sg
from mm3.integrations import sglang_inputs as si
from mm3.integrations import targets
from mm3.testing.factories import Case
from sglang_steps import (SglangStep, assert_output_right, assert_topk_right, extend_args, fill_req_to_token,
                          sglang_step)

P = SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)
B = P.block_size
SEL = dict(block_size_k=B, topk=P.topk, init_blocks=P.init_blocks, local_blocks=P.local_blocks)


@pytest.fixture(autouse=True)
def _cpu_ref():
    with mm3.use_backend("cpu_ref"):
        yield
    targets.configure()


def decode(s: SglangStep, pages: str = "req_to_token", **kw):
    """``minimax_sparse_decode`` on every query token of ``s`` (one row each), the selection in ``topk_out``."""
    c = s.case
    ids = torch.full((P.num_kv_heads, c.batch.num_tokens, P.topk), -7, dtype=torch.int32)
    addr = dict(page_table=s.row_pages) if pages == "page_table" else {}
    r2t, slots = (None, None) if pages == "page_table" else (s.req_to_token, s.row_slots)
    args = dict(page_size=B, disable_index_value=True, topk_out=ids, k_scale=s.k_scale, v_scale=s.v_scale, **addr)
    _, o = sg.minimax_sparse_decode(c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None, r2t,
                                    slots, s.row_seq_lens, c.batch.max_seq_len, 1, B, P.topk, P.init_blocks,
                                    P.local_blocks, **{**args, **kw})
    return ids, o


def extend(s: SglangStep, pages: str = "req_to_token", **kw):
    c = s.case
    addr = dict(page_table=s.page_table) if pages == "page_table" else {}
    r2t, slots = (None, None) if pages == "page_table" else (s.req_to_token, s.req_slots)
    out = sg.minimax_sparse_prefill(c.q, s.k_cache, s.v_cache, None, c.index_q, s.idx_k_cache, None, None, r2t,
                                    slots, **extend_args(s), block_size_q=1, **SEL, disable_index_value=True,
                                    page_size=B, return_topk_idx=True, k_scale=s.k_scale, v_scale=s.v_scale,
                                    **{**addr, **kw})
    assert len(out) == 3 and out[0] is None
    return out[2], out[1]


@pytest.mark.parametrize("pages", ["req_to_token", "page_table"])
def test_decode_rows_with_a_padding_row(pages: str) -> None:
    s = sglang_step(P, decodes=(70, 33, 100), padding=1, seed=1)
    ids, o = decode(s, pages)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)
    assert (ids[:, 1] == -1).all() and (o[1] == 0).all()       # the padding row (seq_len 0)


def test_verify_rows_share_their_request_in_inference_mode() -> None:
    """Speculative verify through the decode entry point: a request's draft rows, each with its own seq_len."""
    with torch.inference_mode():
        s = sglang_step(P, decodes=(90, 40), padding=1, dql=3, seed=2)
        assert s.row_slots.tolist()[:3] == [int(s.req_slots[0])] * 3
        ids, o = decode(s, packed_queries=3)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)


@pytest.mark.parametrize("pages", ["req_to_token", "page_table"])
def test_chunked_prefill_and_a_mixed_extend(pages: str) -> None:
    """Chunks with a prefix, a fresh prompt, and decodes as SGLang's mixed chunk runs them (1-token extends)."""
    s = sglang_step(P, prefills=((9, 40), (1, 70), (5, 5), (1, 33), (12, 75)), seed=3)
    ids, o = extend(s, pages)
    assert ids.shape == (2, s.case.batch.num_tokens, 4)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)


def test_kernel_level_pairs_match_the_entry_points() -> None:
    s = sglang_step(P, decodes=(70, 33, 100), seed=4)
    c = s.case
    _, ids, rest = sg.flash_decode_with_topk_idx(c.index_q, None, s.idx_k_cache, None, s.req_to_token, s.row_seq_lens,
                                                 c.batch.max_seq_len, s.row_slots, B, 4, 1, 1,
                                                 disable_index_value=True, page_size=B)
    assert rest is None
    o = sg.flash_decode_with_gqa_share_sparse(c.q, None, s.k_cache, s.v_cache, s.req_to_token, s.row_seq_lens,
                                              s.row_slots, B, ids, page_size=B)
    ref_ids, ref_o = decode(s)
    assert torch.equal(ids, ref_ids) and torch.equal(o, ref_o)
    e = sglang_step(P, prefills=((9, 40), (1, 70), (12, 75)), seed=5)
    c, a = e.case, extend_args(e)
    idx_o, ids = sg.flash_prefill_with_topk_index(c.index_q, e.idx_k_cache, None, None, e.req_to_token, e.req_slots,
                                                  *a.values(), 1, B, 4, 1, 1, disable_index_value=True, page_size=B)
    o = sg.flash_prefill_with_gqa_share_sparse(c.q, e.k_cache, e.v_cache, None, e.req_to_token, e.req_slots, ids, 1,
                                               B, a["cu_seqlens"], a["seq_lens"], a["prefix_lens"], a["max_seqlen_q"])
    ref_ids, ref_o = extend(e)
    assert idx_o is None and torch.equal(ids, ref_ids) and torch.equal(o, ref_o)
    assert_output_right(e, ids, o)


def test_cached_topk_idx_attends_without_selecting() -> None:
    s = sglang_step(P, prefills=((9, 40), (3, 20)), seed=6)
    ids, o = extend(s)
    c = s.case
    _, again, same = sg.minimax_sparse_prefill(c.q, s.k_cache, s.v_cache, None, c.index_q, None, None, None,
                                               s.req_to_token, s.req_slots, **extend_args(s), block_size_q=1, **SEL,
                                               disable_index_value=True, page_size=B, cached_topk_idx=ids,
                                               return_topk_idx=True)
    assert same is ids and torch.equal(again, o)


def test_minus_one_and_repeats_inside_a_row_select_nothing_more() -> None:
    """mm3 reads a row's valid ids as a set (SGLang's kernels read the first count(ids >= 0) entries)."""
    s = sglang_step(P, decodes=(70, 33, 100), seed=7)
    c = s.case
    ids, o = decode(s)
    dirty = ids.clone()
    dirty[:, :, 1:] = torch.stack([ids[:, :, 1], torch.full_like(ids[:, :, 1], -1), ids[:, :, 2]], dim=2)
    dirty = torch.cat([dirty, ids[:, :, 3:], ids[:, :, :1]], dim=2)    # 5 slots: a -1 inside, a repeat at the end
    got = sg.flash_decode_with_gqa_share_sparse(c.q, None, s.k_cache, s.v_cache, s.req_to_token, s.row_seq_lens,
                                                s.row_slots, B, dirty, page_size=B)
    assert torch.allclose(got, o, atol=1e-6)
    assert_output_right(s, dirty, got)


def _move_pages(s: SglangStep, perm: torch.Tensor) -> Case:
    """Page ``p``'s K/V/index data moves to page ``perm[p]``, in place in SGLang's tensors, and req_to_token's
    rows with them: the case the oracle reads after the move."""
    c, b = s.case, s.case.batch
    for t in (s.k_cache, s.v_cache, s.idx_k_cache):
        pages = t.view(-1, B, *t.shape[1:])
        pages[perm] = pages.clone()
    bt = torch.where(b.block_table >= 0, perm[b.block_table.clamp(min=0).long()].to(torch.int32), -1)
    fill_req_to_token(s.req_to_token, s.req_slots, bt, list(b.seq_lens_host), B)
    caches = PagedKVCache(s.k_cache.view(-1, B, *s.k_cache.shape[1:]), s.v_cache.view(-1, B, *s.v_cache.shape[1:]),
                          s.idx_k_cache[:, 0].view(-1, B, s.idx_k_cache.shape[2]))
    batch = mm3.BatchMetadata.build(b.query_lens, b.seq_lens_host, bt, block_size=B, num_decodes=b.num_decodes,
                                    decode_query_len=b.decode_query_len)
    return Case(c.params, c.q, c.index_q, caches, batch)


def test_req_to_token_rewritten_in_place_between_steps() -> None:
    s = sglang_step(P, decodes=(70, 33, 100), seed=8)
    r2t = s.req_to_token
    ids, o = decode(s)
    assert_output_right(s, ids, o)
    s.case = _move_pages(s, torch.randperm(s.k_cache.shape[0] // B, generator=torch.Generator().manual_seed(8)))
    assert s.req_to_token is r2t
    again, o2 = decode(s)
    assert_topk_right(s, again)
    assert_output_right(s, again, o2)


def test_non_contiguous_pages_are_named_with_the_advice() -> None:
    s = sglang_step(P, decodes=(70, 33), seed=9)
    slot = int(s.req_slots[1])
    s.req_to_token[slot, 5], s.req_to_token[slot, 6] = s.req_to_token[slot, 6].clone(), s.req_to_token[slot, 5].clone()
    with pytest.raises(InputError, match=rf"minimax_sparse_decode: req_to_token\[{slot}, 0:16\] \(request 1's block "
                                         r"0\) is not one aligned 16-slot page.*--page-size 16"):
        decode(s)


def test_non_contiguous_pages_on_the_device_path_raise_at_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device table is checked with torch ops into the target's fault word (the CPU tensors stand in)."""
    monkeypatch.setattr(si, "on_host", lambda t: False)
    s = sglang_step(P, decodes=(70, 33), seed=10)
    decode(s)                                        # a good step: nothing pending
    slot = int(s.req_slots[0])
    s.req_to_token[slot, 40] += 1                    # block 2 of request 0 no longer one page
    with pytest.raises(InputError, match=r"request 0, block 2: the page ids of req_to_token\[slot_ids\] .*"
                                         r"--page-size 16"):
        decode(s)
        decode(s)
    targets.check_page_ids()                         # reported once


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_kv_with_per_tensor_scales_and_q_scale(kv_dtype: str) -> None:
    s = sglang_step(P, prefills=((9, 40), (1, 70)), kv_dtype=kv_dtype, seed=11)
    assert isinstance(s.k_scale, float) and s.k_scale != 1.0
    ids, o = extend(s)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)
    # q_scale folds into sm_scale, as SGLang's kernels fold it
    _, o2 = extend(s, sm_scale=P.softmax_scale / 4, q_scale=4.0)
    assert torch.allclose(o, o2, atol=1e-6)


def test_fp8_queries_are_widened_and_the_output_is_bfloat16() -> None:
    s = sglang_step(P, decodes=(70, 33), dtype="bfloat16", seed=12)
    c = s.case
    q8 = c.q.to(torch.float8_e4m3fn)
    ids = torch.empty(2, 2, 4, dtype=torch.int32)
    _, o = sg.minimax_sparse_decode(q8, None, s.k_cache, s.v_cache, c.index_q.to(torch.float8_e4m3fn), None,
                                    s.idx_k_cache, None, s.req_to_token, s.row_slots, s.row_seq_lens, 100, 1,
                                    *SEL.values(), disable_index_value=True, page_size=B, topk_out=ids)
    assert o.dtype == torch.bfloat16
    s.case = Case(c.params, q8.to(torch.bfloat16), c.index_q, c.caches, c.batch)
    assert_output_right(s, ids, o, torch.bfloat16)


REFUSED = [
    ("score_type", dict(score_type="lse"), "score_type='lse' is not served.*score_type='max'"),
    ("sink", dict(sink=torch.zeros(8, 16)), "sink='<tensor>' is not served.*attention-sink.*pass sink=None"),
    ("idx_sink", dict(idx_sink=torch.zeros(2, 16)), "idx_sink='<tensor>' is not served"),
    ("index_value", dict(disable_index_value=False), "disable_index_value=False is not served.*index value branch"
                                                       ".*disable_value_layer_ids"),
    ("block_size_q", dict(block_size_q=2), "block_size_q=2 is not served.*pass block_size_q=1"),
    ("page_size_negative", dict(page_size=-1), "page_size=-1 is not served.*a multiple of block_size_k=16 "
                                               r"\(pages\), or 1 \(token slots\)"),
    ("fnuz", dict(fnuz=True), r"k_cache.dtype=torch.float8_e4m3fnuz is not served.*no fnuz path.*#45562.*"
                              r"--kv-cache-dtype fp8_e4m3"),
    ("dense_main", dict(dense_main_attn_fn=print), "dense_main_attn_fn='<given>' is not served"),
    ("hisparse", dict(hisparse_swap_in_fn=print), "hisparse_swap_in_fn='<given>' is not served"),
    ("idx_heads", dict(idx_heads=4), r"idx_q.shape\[1\]=4 is not served.*one index head per KV head"),
]


@pytest.mark.parametrize("case, kw, match", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_by_name_with_sglangs_advice(case: str, kw: dict, match: str) -> None:
    s = sglang_step(P, decodes=(70, 33), seed=13)
    c = s.case
    args = [c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None, s.req_to_token, s.row_slots,
            s.row_seq_lens, 100, 1, B, 4, 1, 1]
    kw = {"disable_index_value": True, "page_size": B, **kw}
    if kw.pop("fnuz", False):
        args[2], args[3] = (t.to(torch.float8_e4m3fnuz) for t in args[2:4])
    if "sink" in kw:
        args[1] = kw.pop("sink")
    if "idx_sink" in kw:
        args[5] = kw.pop("idx_sink")
    if "block_size_q" in kw:
        args[12] = kw.pop("block_size_q")
    if "idx_heads" in kw:
        args[4] = torch.cat([c.index_q, c.index_q], dim=1)
        kw.pop("idx_heads")
    with pytest.raises(InputError, match=rf"^minimax_sparse_decode \(SGLang 0.5.23\): {match}"):
        sg.minimax_sparse_decode(*args, **kw)


def test_kernel_level_refusals_name_their_function() -> None:
    s = sglang_step(P, prefills=((9, 40),), seed=14)
    c, a = s.case, extend_args(s)
    ids = torch.zeros(2, 9, 4, dtype=torch.int32)
    with pytest.raises(InputError, match=r"flash_decode_with_gqa_share_sparse \(SGLang 0.5.23\): hisparse_slots"):
        sg.flash_decode_with_gqa_share_sparse(c.q, None, s.k_cache, s.v_cache, s.req_to_token,
                                              a["seq_lens"].repeat(9)[:9], s.req_slots.repeat(9), B, ids,
                                              hisparse_slots=torch.zeros(1))
    with pytest.raises(InputError, match=r"flash_decode_with_topk_idx \(SGLang 0.5.23\): use_dense_main_attn=True"):
        sg.flash_decode_with_topk_idx(c.index_q, None, s.idx_k_cache, None, s.req_to_token, a["seq_lens"], 40,
                                      s.req_slots, B, 4, 1, 1, disable_index_value=True, use_dense_main_attn=True,
                                      page_size=B)
    with pytest.raises(InputError, match=r"flash_prefill_with_topk_index \(SGLang 0.5.23\): disable_index_value"):
        sg.flash_prefill_with_topk_index(c.index_q, s.idx_k_cache, None, None, s.req_to_token, s.req_slots,
                                         *a.values(), 1, B, 4, page_size=B)
    with pytest.raises(InputError, match=r"flash_prefill_with_gqa_share_sparse \(SGLang 0.5.23\): loc_mapping="):
        sg.flash_prefill_with_gqa_share_sparse(c.q, s.k_cache, s.v_cache, None, s.req_to_token, s.req_slots, ids, 1,
                                               B, a["cu_seqlens"], a["seq_lens"], a["prefix_lens"], 9,
                                               loc_mapping=torch.zeros(1))


@pytest.mark.parametrize("case, match", [
    ("rows", r"seq_lens has 3 rows, q 2: one query token per row"),
    ("slots", r"slot_ids has 1 rows for 2 requests"),
    ("topk_out", r"topk_out is \(2, 2, 5\) torch.int32, needs \[2, 2, 4\] int32"),
    ("pool", r"k_cache has \d+ slots, not a multiple of block_size_k=16.*--page-size 16"),
    ("k_scale", r"k_scale must be a finite float > 0 or None, got -1.0"),
    ("float_ids", r"req_to_token \(torch.float32\) and slot_ids \(torch.int64\) must be integer tensors"),
])
def test_errors_name_sglangs_arguments(case: str, match: str) -> None:
    s = sglang_step(P, decodes=(70, 33), seed=15)
    c = s.case
    kw: dict = dict(disable_index_value=True, page_size=B)
    args = [c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None, s.req_to_token, s.row_slots,
            s.row_seq_lens, 100, 1, B, 4, 1, 1]
    if case == "rows":
        args[10] = torch.tensor([70, 33, 5])
    elif case == "slots":
        args[9] = s.row_slots[:1]
    elif case == "topk_out":
        kw["topk_out"] = torch.zeros(2, 2, 5, dtype=torch.int32)
    elif case == "pool":
        args[2], args[3] = s.k_cache[:-3], s.v_cache[:-3]
    elif case == "k_scale":
        kw["k_scale"] = -1.0
    else:
        args[8] = s.req_to_token.float()
    with pytest.raises(InputError, match=rf"^minimax_sparse_decode: {match}"):
        sg.minimax_sparse_decode(*args, **kw)


def test_int64_req_to_token_and_int32_seq_lens_are_read_as_they_are() -> None:
    s = sglang_step(P, decodes=(70, 33), seed=16)
    ids, o = decode(s)
    s.req_to_token = s.req_to_token.long()
    c = s.case
    got = torch.empty_like(ids)
    _, o2 = sg.minimax_sparse_decode(c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None,
                                     s.req_to_token, s.row_slots.int(), s.row_seq_lens.int(), 100, 1, *SEL.values(),
                                     disable_index_value=True, page_size=B, topk_out=got)
    assert torch.equal(ids, got) and torch.equal(o, o2)


def test_a_scale_on_a_device_is_refused_and_a_host_one_read() -> None:
    """A one-element scale tensor on a device would be read by the host at every call (a sync in the step):
    refused with the float to pass instead; on the host it is read without a wait."""
    s = sglang_step(P, decodes=(70, 33), seed=15)
    with pytest.raises(mm3.InputError, match=r"minimax_sparse_decode: q_scale is a one-element tensor on meta.*"
                                             r"layer\.k_scale_float"):
        decode(s, q_scale=torch.ones(1, device="meta"))
    ids, o = decode(s, q_scale=torch.ones(1))
    assert_output_right(s, ids, o)


def test_the_page_check_keeps_constants_by_powers_of_two_of_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_seqlen`` follows the longest context, a new value almost every step: the device check's constants
    must not be kept once per value (their sizes would add up with every one), and a fault past the
    kept width's slice must still be found."""
    from mm3.integrations import vllm_inputs

    monkeypatch.setattr(si, "on_host", lambda t: False)
    monkeypatch.setattr(vllm_inputs, "_KEPT", {})
    B, R = 16, 2
    r2t = torch.arange(R * 40 * B, dtype=torch.int32).view(R, 40 * B)
    sid, sl = torch.tensor([1, 0]), torch.tensor([40 * B, 40 * B], dtype=torch.int32)
    for cols in range(1, 41):
        bt, word = si.block_table("f", r2t, sid, None, B, B, cols * B, sl, R * 40)
        assert torch.equal(bt, r2t[[1, 0], :cols * B:B] // B) and int(word) == si.NO_FAULT, cols
    assert len([k for k in vllm_inputs._KEPT if k[0] == "pages"]) == 7     # 1, 2, 4, ..., 64 blocks
    r2t[0, 37 * B + 5] += 1                         # request 1's block 37 (slot_ids[1] is row 0)
    _, word = si.block_table("f", r2t, sid, None, B, B, 38 * B, sl, R * 40)
    assert int(word) == (1 << 32 | 37)
