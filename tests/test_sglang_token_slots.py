"""mm3.integrations.sglang with ``--page-size 1``: SGLang's token slots read through mm3's slot addressing.

Every token on a slot of its own (a random permutation of the pool, shared
prefixes on the same slots), ``req_to_token`` rows at random, or a batch-local
``page_table`` of one-token pages: decode rows with a padding row, speculative
verify rows, chunked prefill and mixed extends, the kernel-level pairs, fp8 K/V,
all against the fp64 oracle on cpu_ref, with SGLang's ascending top-k order.
The sparse block stays ``block_size_k`` positions (the selection is of blocks,
not tokens). ``req_to_token`` rewritten in place between steps is read as it is
then; a bad entry is named in SGLang's terms; a backend that cannot read token
slots is passed over by the selection, with the reason.
"""

from __future__ import annotations

import pytest
import torch

import mm3
from mm3 import InputError
from mm3.integrations import sglang as sg
from mm3.integrations import targets
from mm3.runtime.registry import Registry
from mm3.testing.mock import MockBackend
from sglang_steps import SglangStep, assert_output_right, assert_topk_right, extend_args, sglang_slot_step
from test_sglang_dropin import P, SEL

B = P.block_size


@pytest.fixture(autouse=True)
def _cpu_ref():
    with mm3.use_backend("cpu_ref"):
        yield
    targets.configure()


def decode(s: SglangStep, pages: str = "req_to_token", page_size: int = 1, **kw):
    c = s.case
    ids = torch.full((P.num_kv_heads, c.batch.num_tokens, P.topk), -7, dtype=torch.int32)
    rows = c.batch.token_to_request.long()
    addr = dict(page_table=s.page_table[rows]) if pages == "page_table" else {}
    r2t, slots = (None, None) if pages == "page_table" else (s.req_to_token, s.req_slots[rows])
    seq = (c.batch.token_positions + 1).to(torch.int64)
    _, o = sg.minimax_sparse_decode(c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None, r2t,
                                    slots, seq, c.batch.max_seq_len, 1, B, P.topk, P.init_blocks, P.local_blocks,
                                    disable_index_value=True, topk_out=ids, k_scale=s.k_scale, v_scale=s.v_scale,
                                    page_size=page_size, **addr, **kw)
    return ids, o


def extend(s: SglangStep, pages: str = "req_to_token"):
    c = s.case
    addr = dict(page_table=s.page_table) if pages == "page_table" else {}
    r2t, slots = (None, None) if pages == "page_table" else (s.req_to_token, s.req_slots)
    _, o, ids = sg.minimax_sparse_prefill(c.q, s.k_cache, s.v_cache, None, c.index_q, s.idx_k_cache, None, None, r2t,
                                          slots, **extend_args(s), block_size_q=1, **SEL, disable_index_value=True,
                                          page_size=1, return_topk_idx=True, k_scale=s.k_scale, v_scale=s.v_scale,
                                          **addr)
    return ids, o


@pytest.mark.parametrize("pages", ["req_to_token", "page_table"])
def test_decode_rows_with_a_padding_row(pages: str) -> None:
    s = sglang_slot_step(P, decodes=(70, 33, 100), padding=1, seed=1)
    ids, o = decode(s, pages)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)
    assert (ids[:, 1] == -1).all() and (o[1] == 0).all()


def test_verify_rows_and_shared_prefixes() -> None:
    s = sglang_slot_step(P, decodes=(90, 40), dql=3, pages="shared_prefix", seed=2)
    ids, o = decode(s, packed_queries=3)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)


@pytest.mark.parametrize("pages", ["req_to_token", "page_table"])
def test_chunked_prefill_and_a_mixed_extend(pages: str) -> None:
    s = sglang_slot_step(P, prefills=((9, 40), (1, 70), (5, 5), (1, 33), (12, 75)), seed=3)
    ids, o = extend(s, pages)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)


def test_fp8_kv_through_token_slots() -> None:
    s = sglang_slot_step(P, decodes=(70, 100), prefills=((9, 40),), kv_dtype="float8_e4m3fn", seed=4)
    ids, o = extend(s)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)


def test_kernel_level_pairs_match_the_entry_points() -> None:
    s = sglang_slot_step(P, decodes=(70, 33, 100), seed=5)
    c = s.case
    rows, seq = s.req_slots[c.batch.token_to_request.long()], (c.batch.token_positions + 1).to(torch.int64)
    _, ids, _ = sg.flash_decode_with_topk_idx(c.index_q, None, s.idx_k_cache, None, s.req_to_token, seq,
                                              c.batch.max_seq_len, rows, B, 4, 1, 1, disable_index_value=True)
    o = sg.flash_decode_with_gqa_share_sparse(c.q, None, s.k_cache, s.v_cache, s.req_to_token, seq, rows, B, ids)
    ref_ids, ref_o = decode(s)
    assert torch.equal(ids, ref_ids) and torch.equal(o, ref_o)   # defaults: page_size 1 and 0, token slots
    e = sglang_slot_step(P, prefills=((9, 40), (1, 70), (12, 75)), seed=6)
    c, a = e.case, extend_args(e)
    _, ids = sg.flash_prefill_with_topk_index(c.index_q, e.idx_k_cache, None, None, e.req_to_token, e.req_slots,
                                              *a.values(), 1, B, 4, 1, 1, disable_index_value=True)
    o = sg.flash_prefill_with_gqa_share_sparse(c.q, e.k_cache, e.v_cache, None, e.req_to_token, e.req_slots, ids, 1,
                                               B, a["cu_seqlens"], a["seq_lens"], a["prefix_lens"], a["max_seqlen_q"],
                                               page_size=1)
    ref_ids, ref_o = extend(e)
    assert torch.equal(ids, ref_ids) and torch.equal(o, ref_o)


def test_page_size_1_selects_blocks_not_tokens() -> None:
    """sglang-jax #1376: a page size other than the block selected tokens. Here the ids are blocks of
    block_size_k positions whatever the page size, and the keys they cover are those blocks' tokens."""
    s = sglang_slot_step(P, decodes=(150, 90), seed=7)
    ids, o = decode(s)
    nb = -(-(s.case.batch.token_positions.long() + 1) // B)
    assert int(ids.max()) < int(nb.max()) and int(ids.max()) >= 4        # block ids, not token positions
    assert_output_right(s, ids, o)


def test_pages_and_token_slots_agree_on_a_pool_of_whole_pages() -> None:
    """A table whose blocks are whole pages reads alike as pages (page_size=16) and as slots (page_size=1)."""
    from sglang_steps import sglang_step

    s = sglang_step(P, decodes=(70, 33), prefills=((9, 40),), seed=8)
    c = s.case
    seq = (c.batch.token_positions + 1).to(torch.int64)
    rows = s.row_slots
    got = [sg.minimax_sparse_decode(c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None,
                                    s.req_to_token, rows, seq, c.batch.max_seq_len, 1, B, P.topk, 1, 1,
                                    disable_index_value=True, page_size=ps)[1] for ps in (B, 1)]
    assert torch.equal(got[0], got[1])


def test_req_to_token_edited_in_place_between_steps() -> None:
    """An engine moves a request's tokens to other slots and rewrites req_to_token in place: the next call
    reads the new slots; an entry past the pool is named at the next call, in SGLang's terms."""
    s = sglang_slot_step(P, decodes=(70, 100), seed=9)
    ids, o = decode(s)
    row = int(s.req_slots[1])
    old = s.req_to_token[row, :100].long().clone()
    spare = torch.tensor(sorted(set(range(s.k_cache.shape[0])) - set(s.req_to_token[s.req_slots].flatten().tolist())))
    new = old.clone()
    new[:len(spare)] = spare[:100][:len(new)]
    for t in (s.k_cache, s.v_cache, s.idx_k_cache):
        t[new] = t[old].clone()
        t[old[:len(spare)]] = 1e3                 # the old slots now hold another request's tokens
    s.req_to_token[row, :100] = new.to(torch.int32)
    ids2, o2 = decode(s)
    assert torch.equal(ids2, ids) and torch.allclose(o2, o, atol=1e-6)
    s.req_to_token[row, 7] = s.k_cache.shape[0] + 5
    with pytest.raises(InputError, match=r"minimax_sparse_decode: request 1, position 7: "
                                         r"req_to_token\[slot_ids\[1\], 7\] = \d+ is not a slot of the cache"):
        decode(s)


def test_a_bad_slot_row_is_named() -> None:
    s = sglang_slot_step(P, decodes=(70, 100), seed=10)
    s.req_slots[0] = s.req_to_token.shape[0] + 2
    with pytest.raises(InputError, match=r"request 0 has slot row \d+ \(slot_ids\), which is not a row of "
                                         r"req_to_token"):
        decode(s)


def test_a_backend_without_token_slots_is_passed_over_with_the_reason() -> None:
    """The backend named (here a stand-in that reads pages only, under the name this module selects) is
    refused for a call of token slots, and the error says why."""
    s = sglang_slot_step(P, decodes=(70, 100), seed=11)
    targets.configure(registry=Registry(plugins=[MockBackend("cpu_ref", addressings={"pages"})], entry_points=False))
    with pytest.raises(mm3.BackendUnavailableError, match=r"cpu_ref.*cannot find tokens through slots"):
        decode(s)
