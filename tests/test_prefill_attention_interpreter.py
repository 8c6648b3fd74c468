"""The block-grouped prefill attention (``mm3_backends.triton.prefill_attention``) on the CPU.

* the plan (plain tensor code, no Triton): every valid (KV head, token,
  block) pair lands in exactly one tile, tiles hold one segment and at most
  ``M`` pairs, pages come from the block table, repeats and ids outside the
  visible range are dropped;
* the kernels through Triton's interpreter (fp32 / fp16, tiny shapes) against
  the fp64 oracle: one program per tile and the persistent pipelined walk, a
  GQA group that is not a power of two, passes smaller than the step, a
  messy selection, a mixed batch with decodes before the prefills; and the
  token-tile kernel it replaces on NVIDIA (the rocm plugin's path).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from mm3.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention, oracle_topk

from mm3_backends.triton.prefill_attention import plan_pairs
from mm3_backends.triton.prefill_config import PrefillAttentionConfig

ATTN_TOL = {torch.float16: (1e-2, 1.5e-4), torch.float32: (1e-5, 1e-5)}


def _params(g: int) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=2 * g, num_kv_heads=2, head_dim=32, num_index_heads=2,
                                 index_head_dim=32, block_size=16, topk=4)


def test_plan_puts_every_pair_in_one_tile() -> None:
    g = torch.Generator().manual_seed(3)
    H, T, K, B, M, R, nb_max = 2, 37, 5, 16, 3, 2, 9
    requests = torch.tensor([0] * 20 + [1] * 17, dtype=torch.int32)
    positions = torch.cat([torch.arange(100, 120), torch.arange(0, 17) * 8]).to(torch.int32)
    positions[5] = -1                                                     # nothing visible
    sel = torch.randint(-2, nb_max + 2, (H, T, K), generator=g, dtype=torch.int32)
    sel[:, :, 1] = sel[:, :, 0]                                           # repeats
    table = torch.randperm(R * nb_max, generator=g).view(R, nb_max).to(torch.int32)
    max_tiles = H * T * K // M + H * R * nb_max
    plan = plan_pairs(sel, positions, requests, table, block_size=B, nb_max=nb_max, num_requests=R,
                      tokens_per_tile=M, max_tiles=max_tiles)
    n = int(plan.num_tiles)
    assert 0 < n <= max_tiles
    nb = torch.where(positions >= 0, positions // B + 1, 0)
    want = {(h, t, int(b)) for h in range(H) for t in range(T) for b in sel[h, t].tolist() if 0 <= b < nb[t]}
    got = []
    for i in range(n):
        seg = int(plan.tile_seg[i])
        h, r, b = seg // (R * nb_max), seg // nb_max % R, seg % nb_max
        assert int(plan.tile_page[i]) == int(table[r, b])
        slots = [s for s in plan.tile_slot[i * M:(i + 1) * M].tolist() if s >= 0]
        assert slots, f"tile {i} is empty"
        for s in slots:
            hs, t, k = s // (T * K), s // K % T, s % K
            assert (hs, int(requests[t])) == (h, r) and int(plan.clean[hs, t, k]) == b
            got.append((h, t, b))
    assert sorted(got) == sorted(want), "a pair is missing or served twice"
    assert (plan.tile_slot[n * M:max_tiles * M] == -1).all()      # the last entry is a sink
    for h in range(H):
        for t in range(T):
            assert sorted(x for x in plan.clean[h, t].tolist() if x >= 0) == sorted({b for (hh, tt, b) in want
                                                                                    if (hh, tt) == (h, t)})


interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead")


def _forward(case, sel, cfg: PrefillAttentionConfig | None) -> torch.Tensor:
    from mm3_backends.triton import attention
    from mm3_backends.triton.plugin_factory import INTERPRETER_CONFIG

    out = torch.full_like(case.q, float("nan"))
    attention.attention_forward(case.q, case.caches, sel, case.batch, case.params, out,
                                replace(INTERPRETER_CONFIG, prefill_attention=cfg))
    return out


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    err = (out.double() - ref).abs()
    max_tol, mean_tol = ATTN_TOL[out.dtype]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol, (err.max().item(), err.mean().item())


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("dtype,cfg", [
    ("float32", PrefillAttentionConfig(rows=16, block_n=16, programs_per_sm=0)),
    ("float16", PrefillAttentionConfig(rows=32, block_n=16, max_tokens_per_pass=11)),
    ("float16", None),
], ids=["one_per_tile_fp32", "persistent_passes_fp16", "token_tiles_fp16"])
def test_block_grouped_prefill_matches_oracle(dtype: str, cfg: PrefillAttentionConfig | None) -> None:
    """A mixed step (2 decodes + padding, 3 prefills, G = 3) with a messy selection.

    ``None``: the token-tile kernel the rocm plugin keeps (the interpreter config takes the
    block-grouped path for both plugins, so this is where the other one runs in CI)."""
    p = _params(3)
    case = make_case(p, decodes=[70, 33], prefills=[(20, 130), (3, 3), (17, 60)], padding_decodes=1,
                     dtype=dtype, index_dtype=dtype, seed=9)
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    view = sel.head_major()
    nb = (case.batch.token_positions.clamp(min=0) // p.block_size + 1).to(torch.int32)
    view[1, :, 3] = torch.where(view[1, :, 3] >= 0, view[1, :, 0], nb + 1)   # a repeat, or an id past nb
    _assert_close(_forward(case, sel, cfg), oracle_attention(case.q, case.caches, sel, case.batch, p))
