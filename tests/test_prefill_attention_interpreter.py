"""The block-grouped prefill attention (``mm3_backends.triton.prefill_attention``) on the CPU.

* the plan: every valid (KV head, token, block) pair of the prefill tokens
  lands in exactly one tile, tiles hold one segment and at most ``M``
  pairs, pages come from the block table, repeats and ids outside the
  visible range are dropped; the pairs' places number them densely, a
  tile's pairs consecutive from its first place;
* the kernels through Triton's interpreter (fp32 / fp16, tiny shapes) against
  the fp64 oracle: pipelined and not, runs of one and of several tiles,
  several runs per program, a GQA group that is not a power of two, passes
  smaller than the step, a messy selection (including a row that selects
  nothing), a mixed batch with decodes before the prefills, both page
  layouts; and the token-tile kernel it replaces on NVIDIA (the rocm
  plugin's path).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import replace

import pytest
import torch

from mm3.contract.batch import BatchMetadata
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention, oracle_topk

from mm3_backends.triton import prefill_plan
from mm3_backends.triton.prefill_plan import SCAN_KERNEL_MAX, plan_pairs

ATTN_TOL = {torch.float16: (1e-2, 1.5e-4), torch.float32: (1e-5, 1e-5)}
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead")


def _params(g: int, block_size: int = 16) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=2 * g, num_kv_heads=2, head_dim=32, num_index_heads=2,
                                 index_head_dim=32, block_size=block_size, topk=4)


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("scan_kernel_max,scan_block", [(SCAN_KERNEL_MAX, 16), (0, 16)],
                         ids=["scan_kernel", "torch_scans"])
def test_plan_puts_every_pair_in_one_tile(scan_kernel_max: int, scan_block: int, monkeypatch) -> None:
    """36 segments: the scan kernel's running sums cross 16-segment steps; or PyTorch's scans."""
    monkeypatch.setattr(prefill_plan, "SCAN_BLOCK", scan_block)
    g = torch.Generator().manual_seed(3)
    H, K, B, M, nb_max = 2, 5, 16, 3, 9
    # one decode (not planned), then two prefills: 20 tokens after 100 cached, 17 from position 0
    table = torch.randperm(3 * nb_max, generator=g).view(3, nb_max).to(torch.int32)
    batch = BatchMetadata.build([1, 20, 17], [40, 120, 17], table, block_size=B, num_decodes=1)
    T, R, nd = batch.num_tokens, 2, 1
    sel = torch.randint(-2, nb_max + 2, (T, H, K), generator=g, dtype=torch.int32).transpose(0, 1)
    sel[:, :, 1] = sel[:, :, 0]                                           # repeats
    Tc = T - nd
    max_tiles = H * Tc * K // M + H * R * nb_max
    plan = plan_pairs(sel, batch, nd, Tc, nb_max=nb_max, tokens_per_tile=M, max_tiles=max_tiles,
                      num_pages=table.numel(), scan_kernel_max=scan_kernel_max)
    n = int(plan.num_tiles)
    assert 0 < n <= max_tiles
    pos, req = batch.token_positions[nd:], batch.token_to_request[nd:] - nd
    nb = pos // B + 1
    want = {(h, t, int(b)) for h in range(H) for t in range(Tc) for b in sel[h, nd + t].tolist() if 0 <= b < nb[t]}
    at = {}  # place -> (tile, token, segment)
    for i in range(n):
        seg = int(plan.tile_seg[i])
        h, r, b = seg // (R * nb_max), seg // nb_max % R, seg % nb_max
        assert int(plan.tile_page[i]) == int(table[nd + r, b])
        pairs = int(plan.tile_pairs[i])
        assert 1 <= pairs <= M, f"tile {i}: {pairs} pairs"
        toks = plan.tile_tok[i * M:i * M + pairs].tolist()   # the slots after them are never read
        for j, tok in enumerate(toks):
            at[int(plan.tile_place[i]) + j] = (i, tok, seg)
    assert sorted(at) == list(range(len(want))), "places are not 0 .. pairs - 1, one per pair"
    got = []
    for h in range(H):
        for t in range(Tc):
            for k in range(K):
                b, place = int(plan.clean[h, t, k]), int(plan.place[h, t, k])
                assert (b < 0) == (place < 0), f"row ({h}, {t}) slot {k}: a place without a block or vice versa"
                if b >= 0:
                    _, tok, seg = at[place]
                    assert (tok, seg) == (nd + t, (h * R + int(req[t])) * nb_max + b), "place of another pair"
                    got.append((h, t, b))
    assert sorted(got) == sorted(want), "a pair is missing or served twice"
    for h in range(H):
        for t in range(Tc):
            assert sorted(x for x in plan.clean[h, t].tolist() if x >= 0) == sorted({b for (hh, tt, b) in want
                                                                                    if (hh, tt) == (h, t)})
    # 370 pairs (not a multiple of 4): each array still starts on a 16-byte boundary (the kernels'
    # alignment class, and so the fast launcher's call class, holds across step sizes)
    arrays = [getattr(plan, f.name) for f in dataclasses.fields(plan)]
    assert all(a.data_ptr() % 16 == 0 for a in arrays), [a.data_ptr() % 16 for a in arrays]


def _forward(case, sel, changes: dict | None) -> torch.Tensor:
    from mm3_backends.triton import attention
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    shipped = base.prefill_attention
    out = torch.full_like(case.q, float("nan"))
    attention.attention_forward(case.q, case.caches, sel, case.batch, case.params, out,
                                replace(base,
                                        prefill_attention=None if changes is None else replace(shipped, **changes)))
    return out


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    err = (out.double() - ref).abs()
    max_tol, mean_tol = ATTN_TOL[out.dtype]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol, (err.max().item(), err.mean().item())


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("dtype,changes,block,layout", [
    ("float32", dict(rows=16, programs_per_sm=3, stages=1, run_tiles=1), 16, "NHD"),
    ("float16", dict(rows=32, stages=2, max_tokens_per_pass=11, run_tiles=1), 16, "NHD"),
    ("float16", None, 16, "NHD"),
    ("float32", dict(rows=16, run_tiles=2, stages=1, programs_per_sm=3), 16, "NHD"),
    ("float16", dict(rows=32, run_tiles=3, max_tokens_per_pass=11), 32, "HND"),
], ids=["tiles_unpipelined_fp32", "tiles_passes_fp16", "token_tiles_fp16", "runs_fp32", "runs_passes_fp16"])
def test_block_grouped_prefill_matches_oracle(dtype: str, changes: dict | None, block: int, layout: str) -> None:
    """A mixed step (2 decodes + padding, 3 prefills, G = 3) with a messy selection.

    ``changes``: fields of the block-grouped config changed; ``None``: the token-tile kernel
    the rocm plugin keeps. ``runs``: runs of several tiles per block (one K/V load per run);
    ``tiles``: runs of one tile; one prefill row that selects nothing must come out as zeros."""
    p = _params(3, block)
    case = make_case(p, decodes=[70, 33], prefills=[(20, 130), (3, 3), (17, 60)], padding_decodes=1,
                     dtype=dtype, index_dtype=dtype, kv_layout=layout, seed=9)
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    view = sel.head_major()
    nb = (case.batch.token_positions.clamp(min=0) // p.block_size + 1).to(torch.int32)
    view[1, :, 3] = torch.where(view[1, :, 3] >= 0, view[1, :, 0], nb + 1)   # a repeat, or an id past nb
    empty = case.batch.num_decode_tokens + 5
    view[0, empty] = -1                                                      # a row that selects nothing
    ref = oracle_attention(case.q, case.caches, sel, case.batch, p)
    assert (ref[empty, :3] == 0).all() and ref[empty, 3:].abs().sum() > 0
    _assert_close(_forward(case, sel, changes), ref)
