"""A mixed step in vLLM's MiniMax-M3 conventions, run through mm3.integrations.vllm, checked against the oracle.

vLLM's layer splits a decode-first step in two: the decodes (``seq_lens.shape[0]``
requests of ``decode_query_len`` tokens) go to ``minimax_m3_index_decode`` and
``minimax_m3_sparse_attn_decode``, the prefills (``cu_seqlens_q`` rebased to 0,
``prefix_lens``) to ``minimax_m3_index_score`` -> ``minimax_m3_index_topk`` and
``minimax_m3_sparse_attn``. Both halves write one shared top-k buffer: here
token-major ``[T, H, K]`` storage seen through a head-major ``[H, T, K]`` view
(the seed's bug), with spare rows past the step that must stay untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mm3.contract.buffers import TopkBuffer
from mm3.integrations import vllm as ops
from mm3.testing.factories import Case, make_case
from mm3.testing.oracle import check_topk, oracle_attention

SENTINEL = -77
#: docs/spec.md §4: (max, mean) absolute errors against the fp64 oracle
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1.5e-4), torch.bfloat16: (2e-2, 3e-4)}


@dataclass
class VllmStep:
    """One step's tensors as vLLM's M3 layer holds them."""

    case: Case
    kv_cache: torch.Tensor          # [N, Hkv, B, 2D]
    k_scale: Optional[torch.Tensor]
    v_scale: Optional[torch.Tensor]
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_decodes: int                # requests
    decode_tokens: int
    dql: int
    topk_storage: torch.Tensor      # [T + spare, H, K] token-major
    output: torch.Tensor

    @property
    def topk_view(self) -> torch.Tensor:
        """The logical [H, T + spare, K] view vLLM's ops are given."""
        return self.topk_storage.permute(1, 0, 2)


def combined_kv(case: Case) -> torch.Tensor:
    """vLLM's one KV cache: K then V in the last axis of [num_blocks, Hkv, B, 2D]."""
    k, v = case.caches.k, case.caches.v
    N, B, H, D = k.shape
    kv = torch.empty((N, H, B, 2 * D), dtype=k.dtype, device=k.device)
    kv[..., :D].copy_(k.permute(0, 2, 1, 3))
    kv[..., D:].copy_(v.permute(0, 2, 1, 3))
    return kv


def vllm_step(params, *, decodes, prefills, dql: int = 1, padding: int = 0, dtype: str = "float32",
              kv_dtype: Optional[str] = None, kv_scale: str = "head", spare: int = 3, seed: int = 0) -> VllmStep:
    case = make_case(params, decodes=decodes, prefills=prefills, decode_query_len=dql, padding_decodes=padding,
                     dtype=dtype, kv_dtype=kv_dtype, kv_scale=kv_scale, seed=seed)
    b = case.batch
    T, H, K = b.num_tokens, params.num_kv_heads, params.topk
    storage = torch.full((T + spare, H, K), SENTINEL, dtype=torch.int32)
    return VllmStep(case, combined_kv(case), case.caches.k_scale, case.caches.v_scale, b.seq_lens, b.block_table,
                    b.num_decodes, b.num_decode_tokens, dql, storage, torch.full_like(case.q, float("nan")))


def run_step(s: VllmStep, *, max_dql: Optional[int] = None, k_scale=None, v_scale=None) -> None:
    """The step through the six functions' decode and prefill paths, as vLLM's layer calls them."""
    c, p, b = s.case, s.case.params, s.case.batch
    nd, td, H = s.num_decodes, s.decode_tokens, p.num_kv_heads
    ks = s.k_scale if k_scale is None else k_scale
    vs = s.v_scale if v_scale is None else v_scale
    view = s.topk_view
    if nd:
        got = ops.minimax_m3_index_decode(c.index_q[:td], c.caches.index, s.block_table[:nd], s.seq_lens[:nd],
                                          b.max_seq_len, p.topk, p.init_blocks, p.local_blocks, H, s.dql,
                                          max_dql or s.dql, out=view[:, :td])
        assert got.data_ptr() == view.data_ptr() and got.shape == (H, td, p.topk)
        ops.minimax_m3_sparse_attn_decode(c.q[:td], s.kv_cache, view[:, :td], s.block_table[:nd], s.seq_lens[:nd],
                                          H, p.softmax_scale, s.output[:td], s.dql, ks, vs)
    if b.num_prefills:
        qsl = b.query_start_loc[nd:] - b.query_start_loc[nd]
        sl, ctx, bt = s.seq_lens[nd:], b.context_lens[nd:], s.block_table[nd:]
        mq = b.max_prefill_query_len
        score = ops.minimax_m3_index_score(c.index_q[td:], c.caches.index, bt, qsl, sl, ctx, mq, b.max_seq_len, H)
        got = ops.minimax_m3_index_topk(score, qsl, ctx, mq, p.topk, p.init_blocks, p.local_blocks,
                                        out=view[:, td:], block_size=p.block_size)
        assert got.data_ptr() == view[:, td:].data_ptr()
        ops.minimax_m3_sparse_attn(c.q[td:], s.kv_cache, view[:, td:], bt, qsl, sl, ctx, mq, H, p.softmax_scale,
                                   s.output[td:], ks, vs)


def assert_step_right(s: VllmStep, dtype: torch.dtype = torch.float32) -> None:
    """Every top-k row a right choice (docs/spec.md §3), spare rows untouched, the output the oracle's."""
    c, T = s.case, s.case.batch.num_tokens
    assert (s.topk_storage[T:] == SENTINEL).all(), "rows past the step were written"
    sel = TopkBuffer(s.topk_view[:, :T])
    assert sel.layout == "token_major"
    errors = check_topk(sel, c.index_q, c.caches, c.batch, c.params)
    assert not errors, [str(e) for e in errors[:5]]
    ref = oracle_attention(c.q, c.caches, sel, c.batch, c.params)
    err = (s.output.double() - ref).abs()
    tmax, tmean = TOL[dtype]
    assert float(err.max()) <= tmax and float(err.mean()) <= tmean, (float(err.max()), float(err.mean()))
