"""Bugs engines shipped in MiniMax-M3's sparse path, each replayed on mm3 (docs/engines.md, SGLang's table).

The rest of that table points at tests that already hold each case; these are
the ones no other test covered: contexts past 2**19 tokens through SGLang's
drop-in, the unwritten tail of a request's last block, and four index heads
(M3's at TP1).
"""

from __future__ import annotations

import os

import pytest
import torch

import mm3
from mm3.integrations import sglang as sg
from mm3.testing.oracle import check_topk, oracle_attention
from sglang_steps import assert_output_right, assert_topk_right, sglang_step

B = 16
TINY = mm3.SparseAttentionParams(num_heads=2, num_kv_heads=1, head_dim=16, num_index_heads=1, index_head_dim=16,
                                 block_size=B, topk=4, init_blocks=1, local_blocks=1)


def test_contexts_past_524288_tokens_through_sglangs_decode() -> None:
    """SGLang #36560: its decode top-k capped a row at 4096 blocks (524,288 tokens at 128), failing capture above.
    mm3 has no such cap: positions are int32 (2**31 tokens) and the kernels loop over a row's blocks. Here a
    tiny cache of 8 pages backs a table of ~33k blocks (the pages repeat), rows at positions past 2**19."""
    g = torch.Generator().manual_seed(0)
    pages, slots = 8, 8 * B
    k, v = (torch.randn(slots, 1, 16, generator=g) for _ in range(2))
    index = torch.randn(slots, 1, 16, generator=g)
    seq = [2 ** 19 + 37, 2 ** 19 + 3 * B, 600_001]
    width = max(seq)
    pos = torch.arange(width)
    page_of_block = (pos // B * 5 + 3) % pages            # every block one aligned page, pages reused
    r2t = (page_of_block * B + pos % B).to(torch.int32).repeat(len(seq), 1)
    q, iq = torch.randn(len(seq), 2, 16, generator=g), torch.randn(len(seq), 1, 16, generator=g)
    ids = torch.empty(1, len(seq), 4, dtype=torch.int32)
    with mm3.use_backend("cpu_ref"):
        _, o = sg.minimax_sparse_decode(q, None, k, v, iq, None, index, None, r2t, torch.arange(len(seq)),
                                        torch.tensor(seq), width, 1, B, 4, 1, 1, disable_index_value=True,
                                        page_size=B, topk_out=ids)
    nb = -(-width // B)
    bt = page_of_block[::B][:nb].to(torch.int32).repeat(len(seq), 1)
    caches = mm3.PagedKVCache(k.view(pages, B, 1, 16), v.view(pages, B, 1, 16), index.view(pages, B, 16))
    batch = mm3.BatchMetadata.build([1] * len(seq), seq, bt, block_size=B, num_decodes=len(seq))
    assert int(batch.token_positions.min()) > 2 ** 19
    assert not check_topk(mm3.TopkBuffer(ids), iq, caches, batch, TINY)
    assert (o.double() - oracle_attention(q, caches, mm3.TopkBuffer(ids), batch, TINY)).abs().max() < 1e-5


def test_the_unwritten_tail_of_the_last_block_selects_nothing() -> None:
    """vllm-ascend #13391 (tail blocks): keys past a token's position in its own, partly filled block must not
    score it. Huge index keys there (what a stale page holds) leave the selection and the output as they were."""
    P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                                  block_size=B, topk=4, init_blocks=1, local_blocks=0)
    s = sglang_step(P, decodes=(70, 33, 100), seed=21)
    c = s.case

    def decode() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.empty(2, c.batch.num_tokens, 4, dtype=torch.int32)
        with mm3.use_backend("cpu_ref"):
            _, o = sg.minimax_sparse_decode(c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None,
                                            s.req_to_token, s.row_slots, s.row_seq_lens, c.batch.max_seq_len, 1, B,
                                            4, 1, 0, disable_index_value=True, page_size=B, topk_out=ids)
        return ids, o

    ids, o = decode()
    assert_topk_right(s, ids)
    for r, n in enumerate(c.batch.seq_lens_host):
        if n % B:
            page = int(c.batch.block_table[r, (n - 1) // B])
            tail = torch.arange(page * B + n % B, (page + 1) * B)          # the own block past the token
            s.idx_k_cache[tail] = float(1e4 * c.index_q.abs().amax())
    again, o2 = decode()
    assert torch.equal(again, ids) and torch.equal(o2, o)


def _four_heads(backend: str) -> None:
    P = mm3.SparseAttentionParams(num_heads=16, num_kv_heads=4, head_dim=32, num_index_heads=4, index_head_dim=32,
                                  block_size=B, topk=4, init_blocks=0, local_blocks=1)
    s = sglang_step(P, decodes=(70, 33), prefills=(), seed=22)
    c = s.case
    ids = torch.empty(4, c.batch.num_tokens, 4, dtype=torch.int32)
    with mm3.use_backend(backend):
        _, o = sg.minimax_sparse_decode(c.q, None, s.k_cache, s.v_cache, c.index_q, None, s.idx_k_cache, None,
                                        s.req_to_token, s.row_slots, s.row_seq_lens, c.batch.max_seq_len, 1, B, 4,
                                        0, 1, disable_index_value=True, page_size=B, topk_out=ids)
    assert_topk_right(s, ids)
    assert_output_right(s, ids, o)


def test_four_index_heads_as_m3_at_tp1() -> None:
    """ROCm/aiter #5464: M3's 4 index heads had no score kernel built for them, aborting at load. mm3's
    indexers take any head count (here the reference; the Triton kernels below)."""
    assert mm3.SparseAttentionParams.minimax_m3(tp_size=1).num_index_heads == 4
    _four_heads("cpu_ref")


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter only")
def test_four_index_heads_on_the_triton_kernels() -> None:
    _four_heads("cuda")
