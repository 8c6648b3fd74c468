"""mm3.integrations.sglang on the Triton backends (cuda, rocm) through Triton's interpreter, against the fp64 oracle.

SGLang's layouts and calls at tiny shapes, each backend pinned with
``mm3.use_backend``: decode rows with a padding row and verify rows, a chunked
prefill mixed with 1-token extends, through ``req_to_token`` and through a
``page_table`` (pages scattered at random), the kernel-level pairs, and fp8
K/V with per-tensor scales. float32 / float16 run here; bf16 on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

import mm3
from mm3 import SparseAttentionParams
from mm3.integrations import sglang as sg
from mm3.integrations import targets
from sglang_steps import assert_output_right, assert_topk_right, extend_args, sglang_step

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

P = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)
B = P.block_size


def _decode(s, pages: str):
    c = s.case
    ids = torch.full((2, c.batch.num_tokens, 4), -7, dtype=torch.int32)
    addr = dict(page_table=s.row_pages) if pages == "page_table" else {}
    r2t, slots = (None, None) if addr else (s.req_to_token, s.row_slots)
    _, o = sg.minimax_sparse_decode(c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None, r2t,
                                    slots, s.row_seq_lens, c.batch.max_seq_len, 1, B, 4, 1, 1,
                                    disable_index_value=True, page_size=B, topk_out=ids, k_scale=s.k_scale,
                                    v_scale=s.v_scale, **addr)
    return ids, o


def _extend(s, pages: str):
    c = s.case
    addr = dict(page_table=s.page_table) if pages == "page_table" else {}
    r2t, slots = (None, None) if addr else (s.req_to_token, s.req_slots)
    _, o, ids = sg.minimax_sparse_prefill(c.q, s.k_cache, s.v_cache, None, c.index_q, s.idx_k_cache, None, None, r2t,
                                          slots, **extend_args(s), block_size_q=1, block_size_k=B, topk=4,
                                          init_blocks=1, local_blocks=1, disable_index_value=True, page_size=B,
                                          return_topk_idx=True, k_scale=s.k_scale, v_scale=s.v_scale, **addr)
    return ids, o


@pytest.mark.parametrize("backend, pages", [("cuda", "req_to_token"), ("rocm", "page_table")])
def test_decode_and_verify_rows_on_the_triton_backends(backend: str, pages: str) -> None:
    targets.configure()
    with mm3.use_backend(backend):
        s = sglang_step(P, decodes=(60, 41), padding=1, dql=2, seed=21)
        ids, o = _decode(s, pages)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)
    used = {(x.indexer.name, x.attention.name) for x in targets.selections()}
    assert used == {(backend, backend)}, used


@pytest.mark.parametrize("backend, pages", [("cuda", "page_table"), ("rocm", "req_to_token")])
def test_chunked_and_mixed_extend_on_the_triton_backends(backend: str, pages: str) -> None:
    targets.configure()
    with mm3.use_backend(backend):
        s = sglang_step(P, prefills=((9, 40), (1, 50), (3, 3)), seed=22)
        ids, o = _extend(s, pages)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_kernel_level_pairs_with_fp8_kv_on_the_triton_backends(backend: str) -> None:
    """flash_decode_with_topk_idx -> flash_decode_with_gqa_share_sparse, e4m3 K/V with per-tensor scales."""
    targets.configure()
    with torch.inference_mode(), mm3.use_backend(backend):
        s = sglang_step(P, decodes=(60, 41), dtype="float16", kv_dtype="float8_e4m3fn", seed=23)
        c = s.case
        _, ids, _ = sg.flash_decode_with_topk_idx(c.index_q, None, s.idx_k_cache, None, s.req_to_token,
                                                  s.row_seq_lens, c.batch.max_seq_len, s.row_slots, B, 4, 1, 1,
                                                  disable_index_value=True, page_size=B)
        o = sg.flash_decode_with_gqa_share_sparse(c.q, None, s.k_cache, s.v_cache, s.req_to_token, s.row_seq_lens,
                                                  s.row_slots, B, ids, page_size=B, k_scale=s.k_scale,
                                                  v_scale=s.v_scale)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o, torch.float16)


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_prefill_kernel_level_pair_e5m2_on_the_triton_backends(backend: str) -> None:
    targets.configure()
    with torch.inference_mode(), mm3.use_backend(backend):
        s = sglang_step(P, prefills=((9, 40), (1, 70), (12, 75)), dtype="float16", kv_dtype="float8_e5m2", seed=24)
        c, a = s.case, extend_args(s)
        _, ids = sg.flash_prefill_with_topk_index(c.index_q, s.idx_k_cache, None, None, s.req_to_token, s.req_slots,
                                                  *a.values(), 1, B, 4, 1, 1, disable_index_value=True, page_size=B)
        o = sg.flash_prefill_with_gqa_share_sparse(c.q, s.k_cache, s.v_cache, None, s.req_to_token, s.req_slots, ids,
                                                   1, B, a["cu_seqlens"], a["seq_lens"], a["prefix_lens"],
                                                   a["max_seqlen_q"], k_scale=s.k_scale, v_scale=s.v_scale)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o, torch.float16)


# -- page_size=1: SGLang's token slots, read by the Triton kernels through the slot table -----------------------
@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_page_size_1_decode_and_verify_rows_run_on_the_triton_backends(backend: str) -> None:
    """``req_to_token`` rows of random slots (and a ``page_table`` of one-token pages): the backend named, not
    cpu_ref, serves the call, checked against the oracle."""
    from test_sglang_token_slots import P as SLOT_P, decode
    from sglang_steps import sglang_slot_step

    targets.configure()
    with mm3.use_backend(backend):
        for pages, kw in (("req_to_token", dict(decodes=(70, 33, 100), padding=1, seed=31)),
                          ("page_table", dict(decodes=(90, 40), dql=3, pages="shared_prefix", seed=32))):
            s = sglang_slot_step(SLOT_P, **kw)
            ids, o = decode(s, pages, **({"packed_queries": 3} if "dql" in kw else {}))
            assert_topk_right(s, ids)
            assert_output_right(s, ids, o)
    used = {(x.indexer.name, x.attention.name) for x in targets.selections()}
    assert used == {(backend, backend)}, used


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_page_size_1_chunked_and_mixed_extend_with_fp8_kv_on_the_triton_backends(backend: str) -> None:
    from test_sglang_token_slots import P as SLOT_P, extend
    from sglang_steps import sglang_slot_step

    targets.configure()
    with mm3.use_backend(backend):
        s = sglang_slot_step(SLOT_P, decodes=(70, 100), prefills=((9, 40), (1, 70), (12, 75)),
                             kv_dtype="float8_e4m3fn", seed=33)
        ids, o = extend(s)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)
    used = {(x.indexer.name, x.attention.name) for x in targets.selections()}
    assert used == {(backend, backend)}, used


def test_page_size_1_req_to_token_edited_in_place_on_the_triton_backends() -> None:
    """The Triton kernels read ``req_to_token`` as it is at each call; a slot past the pool is named in SGLang's
    terms (CPU tensors are judged on the host; the plugins' one-launch device check of slot tables is
    tests/test_token_slots_triton.py's)."""
    from test_sglang_token_slots import decode
    from test_sglang_token_slots import P as SLOT_P
    from sglang_steps import sglang_slot_step

    targets.configure()
    with mm3.use_backend("cuda"):
        s = sglang_slot_step(SLOT_P, decodes=(70, 100), seed=34)
        ids, o = decode(s)
        row = int(s.req_slots[1])
        old = s.req_to_token[row, :100].long().clone()
        used = set(s.req_to_token[s.req_slots].flatten().tolist())
        spare = torch.tensor(sorted(set(range(s.k_cache.shape[0])) - used))
        new = old.clone()
        new[:len(spare)] = spare[:len(new)]
        for t in (s.k_cache, s.v_cache, s.idx_k_cache):
            t[new] = t[old].clone()
            t[old[:len(spare)]] = 1e3             # the old slots now hold another request's tokens
        s.req_to_token[row, :100] = new.to(torch.int32)
        ids2, o2 = decode(s)
        assert torch.equal(ids2, ids) and torch.equal(o2, o)
        s.req_to_token[row, 7] = s.k_cache.shape[0] + 5
        with pytest.raises(mm3.InputError, match=r"minimax_sparse_decode: request 1, position 7: "
                                                 r"req_to_token\[slot_ids\[1\], 7\].* is not a slot of the cache"):
            decode(s)
    assert {(x.indexer.name, x.attention.name) for x in targets.selections()} == {("cuda", "cuda")}
