"""A step in SGLang's MiniMax-M3 conventions, run through mm3.integrations.sglang, checked against the oracle.

SGLang keeps K and V token-major (``[max_slots, num_kv_heads, head_dim]``), the
index keys as ``[max_slots, 1, idx_head_dim]``, and addresses a request's
tokens through ``req_to_token[slot, position]``. With pages of ``block_size``
tokens (``--page-size``) every block is one aligned page of contiguous slots,
which is what :func:`sglang_step` builds from a random mm3 case (its pages a
random permutation, so a request's pages are scattered): each request gets a
random row of ``req_to_token`` (the other entries hold junk), and the block
table's pages become those slots. Decode calls take one row per query token
(``seq_len = position + 1``, the request's slot: SGLang's verify rows too);
extend calls take ``cu_seqlens``, ``seq_lens`` (int64, as SGLang keeps them) and
``prefix_lens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mm3.contract.buffers import TopkBuffer
from mm3.testing.factories import Case, as_token_slots, make_case
from mm3.testing.oracle import check_topk, oracle_attention

#: docs/spec.md §4: (max, mean) absolute errors against the fp64 oracle
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1.5e-4), torch.bfloat16: (2e-2, 3e-4)}


@dataclass
class SglangStep:
    """One step's tensors as SGLang's MiniMax-M3 backend holds them."""

    case: Case
    k_cache: torch.Tensor           # [slots, Hkv, D]
    v_cache: torch.Tensor
    idx_k_cache: torch.Tensor       # [slots, 1, Di]
    k_scale: Optional[float]
    v_scale: Optional[float]
    req_to_token: torch.Tensor      # [max_reqs, max_ctx] int32
    req_slots: torch.Tensor         # [R] int64: each request's row of req_to_token
    page_table: torch.Tensor        # [R, max_pages] int32: the batch-local pages

    # decode rows (one per query token)
    @property
    def row_seq_lens(self) -> torch.Tensor:
        return (self.case.batch.token_positions + 1).to(torch.int64)

    @property
    def row_slots(self) -> torch.Tensor:
        return self.req_slots[self.case.batch.token_to_request.long()]

    @property
    def row_pages(self) -> torch.Tensor:
        return self.page_table[self.case.batch.token_to_request.long()]

    @property
    def B(self) -> int:
        return self.case.params.block_size


def fill_req_to_token(r2t: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                      B: int) -> None:
    """Write each request's token slots (``B * page + offset``) into its row of ``req_to_token``."""
    for r, s in enumerate(seq_lens):
        t = torch.arange(s)
        r2t[int(slots[r]), :s] = (block_table[r, t // B].long() * B + t % B).to(r2t.dtype)


def sglang_step(params, *, decodes=(), prefills=(), dql: int = 1, padding: int = 0, dtype: str = "float32",
                kv_dtype: Optional[str] = None, spare_reqs: int = 3, extra_ctx: int = 37, seed: int = 0) -> SglangStep:
    case = make_case(params, decodes=decodes, prefills=prefills, decode_query_len=dql, padding_decodes=padding,
                     dtype=dtype, kv_dtype=kv_dtype, kv_scale="tensor", seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    c, b, B = case.caches, case.batch, params.block_size
    P, _, H, D = c.k.shape
    R = b.num_requests
    max_ctx = b.max_seq_len + extra_ctx
    r2t = torch.randint(0, P * B, (R + spare_reqs, max_ctx), generator=g, dtype=torch.int32)   # stale entries
    slots = torch.randperm(R + spare_reqs, generator=g)[:R]
    fill_req_to_token(r2t, slots, b.block_table, list(b.seq_lens_host), B)
    ks = None if c.k_scale is None else float(c.k_scale[0])
    vs = None if c.v_scale is None else float(c.v_scale[0])
    return SglangStep(case, c.k.reshape(P * B, H, D), c.v.reshape(P * B, H, D), c.index.reshape(P * B, 1, -1), ks,
                      vs, r2t, slots, b.block_table.clone())


def extend_args(s: SglangStep) -> dict:
    """The extend batch of ``s`` (every request an extend: chunked prefills, SGLang's mixed chunks)."""
    b = s.case.batch
    return dict(cu_seqlens=b.query_start_loc.clone(), seq_lens=b.seq_lens.to(torch.int64),
                prefix_lens=b.context_lens.clone(), max_seqlen_q=b.max_query_len, max_seqlen_k=b.max_seq_len)


def assert_topk_right(s: SglangStep, ids: torch.Tensor) -> None:
    """Every row a right choice (docs/spec.md §3), ascending with ``-1`` last (SGLang's order)."""
    c = s.case
    key = torch.where(ids < 0, 2 ** 31 - 1, ids)
    assert torch.equal(key, key.sort(-1).values), "ids are not ascending with -1 last"
    errors = check_topk(TopkBuffer(ids), c.index_q, c.caches, c.batch, c.params)
    assert not errors, [str(e) for e in errors[:5]]


def assert_output_right(s: SglangStep, ids: torch.Tensor, out: torch.Tensor, dtype=torch.float32) -> None:
    c = s.case
    ref = oracle_attention(c.q, c.caches, TopkBuffer(ids), c.batch, c.params)
    err = (out.double() - ref).abs()
    tmax, tmean = TOL[dtype]
    assert float(err.max()) <= tmax and float(err.mean()) <= tmean, (float(err.max()), float(err.mean()))


def sglang_slot_step(params, *, decodes=(), prefills=(), dql: int = 1, padding: int = 0, dtype: str = "float32",
                     kv_dtype: Optional[str] = None, pages: str = "permuted", seed: int = 0) -> SglangStep:
    """A step as SGLang holds it with ``--page-size 1``: every token on a slot of its own, a random
    permutation of the pool (:func:`mm3.testing.factories.as_token_slots`), ``req_to_token`` rows at
    random; ``page_table`` is the batch's rows of it (one-token pages)."""
    paged = make_case(params, decodes=decodes, prefills=prefills, decode_query_len=dql, padding_decodes=padding,
                      dtype=dtype, kv_dtype=kv_dtype, kv_scale="tensor", seed=seed, pages=pages)
    case = as_token_slots(paged, torch.Generator().manual_seed(seed + 2000))
    c, slots = case.caches, case.batch.slots
    ks = None if c.k_scale is None else float(c.k_scale[0])
    vs = None if c.v_scale is None else float(c.v_scale[0])
    return SglangStep(case, c.k[:, 0], c.v[:, 0], c.index, ks, vs, slots.table, slots.rows.long(),
                      slots.table[slots.rows.long()])
