"""The block-grouped prefill attention on a real GPU at M3 shapes, against fp64 (skipped without CUDA).

The shapes of the prefill benchmark: one 8K-token chunk after 0 and 32K cached
tokens, TP1 (64/4/4 heads) and TP8 (8/1/1), with independent and with
correlated index queries (long segments, full tiles, segments cut into many
tiles), selections from the cuda indexer; and a selection made messy by hand
(repeats, ``-1`` and out-of-range ids). Each case poisons the output, checks
sampled tokens against the fp64 reference (``gpu_reference``) and every
prefill token against the token-tile kernel (the rocm plugin's path).
The messy selection runs with the memory the workspace is carved from
filled with NaN first, so a partial the merge reads but no run wrote shows
as NaN.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3_backends.cuda import plugin as cuda_plugin
from mm3_backends.triton import attention
from mm3_backends.triton.prefill_config import PrefillAttentionConfig

from gpu_reference import attention_reference, build_case, sample_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K8, K32 = 8192, 32768
# docs/spec.md §4 vs the fp64 reference, bf16: (max, mean)
TOL = (2e-2, 3e-4)


def _config(prefill: PrefillAttentionConfig | None):
    return replace(cuda_plugin.PLATFORM.launch_config(torch.device("cuda")), prefill_attention=prefill)


#: the cuda plugin's block-grouped prefill config (the shapes below change some of its fields)
SHIPPED = cuda_plugin.PLATFORM.launch.prefill_attention


def _step(tp: int, context: int, correlated: bool, seed: int):
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=[3000, 700], prefills=[(K8, context + K8)], seed=seed)
    if correlated:  # the benchmark's "shared 0.9": every token's index query leans one way
        g = torch.Generator(device="cuda").manual_seed(seed)
        c = torch.randn(1, p.num_index_heads, p.index_head_dim, device="cuda", generator=g)
        iq = case.index_q.float()
        case.index_q.copy_((0.9 * c + math.sqrt(1 - 0.81) * iq).to(case.index_q.dtype))
    T = case.batch.num_tokens
    buf = cuda_plugin.alloc_topk_buffer(T, p.num_kv_heads, p.topk, case.q.device)
    cuda_plugin.index_topk(case.index_q, case.caches, case.batch, p, buf)
    return p, case, buf


def _run(p, case, buf, prefill: PrefillAttentionConfig | None) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))
    attention.attention_forward(case.q, case.caches, buf, case.batch, p, out, _config(prefill))
    torch.cuda.synchronize()
    return out


def _poison_free_memory() -> None:
    """Make the next workspaces (``torch.empty``) come out of NaN-filled memory, not out of an earlier
    run's partials: the allocator's cached blocks go back to the driver first (the best fit would
    otherwise be the last run's workspace), then one NaN block (at most 8 GB, half the free memory:
    other test workers share the GPU) is the only cached one."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    junk = torch.full((min(free // 2, 8 << 30) // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk


def _check(p, case, buf, out: torch.Tensor, incumbent: torch.Tensor) -> None:
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output rows"
    toks = sample_tokens(case.batch)
    ref = attention_reference(case.q, case.caches, buf, case.batch, p, toks)
    err = (out[toks].double() - torch.stack([ref[t] for t in toks])).abs()
    assert err.max().item() <= TOL[0] and err.mean().item() <= TOL[1], (err.max().item(), err.mean().item())
    d = (out.double() - incumbent.double()).abs()[case.batch.num_decode_tokens:]
    assert d.max().item() <= TOL[0] and d.mean().item() <= TOL[1], (d.max().item(), d.mean().item())


@pytest.mark.parametrize("tp,context,correlated", [(1, 0, False), (1, K32, False), (1, K32, True),
                                                   (8, 0, True), (8, K32, False)])
def test_block_grouped_prefill_at_m3_shapes(tp: int, context: int, correlated: bool) -> None:
    p, case, buf = _step(tp, context, correlated, seed=tp + context // 1024 + correlated)
    out = _run(p, case, buf, SHIPPED)
    _check(p, case, buf, out, _run(p, case, buf, None))


@pytest.mark.parametrize("tp,cfg", [
    (1, replace(SHIPPED, run_tiles=1)), (8, replace(SHIPPED, run_tiles=1)), (1, replace(SHIPPED, run_tiles=16)),
    (1, replace(SHIPPED, rows=128, warps=8, programs_per_sm=1, stages=5)),
], ids=["runs1", "runs1_tp8", "runs16", "runs_rows128"])
def test_block_grouped_prefill_tile_shapes(tp: int, cfg: PrefillAttentionConfig) -> None:
    """Other tile shapes: runs of one tile (K/V loaded per tile); longer runs; 128-row runs (8 warps)."""
    p, case, buf = _step(tp, K32, True, seed=11)
    _check(p, case, buf, _run(p, case, buf, cfg), _run(p, case, buf, None))


def test_block_grouped_prefill_messy_selection_and_small_passes() -> None:
    """Repeats, -1 and ids past the visible range select nothing extra; a row of only -1 gives
    zeros; passes of 3000 tokens agree."""
    p, case, buf = _step(1, 2000, False, seed=7)
    view = buf.head_major()
    pos = case.batch.token_positions.to(torch.int64)
    nb = torch.where(pos >= 0, pos // p.block_size + 1, 0).to(torch.int32)
    view[:, :, 3] = view[:, :, 0]
    view[:, :, 5] = nb + 2
    view[:, :, 7] = -1
    empty = case.batch.num_decode_tokens  # the prefill's first token: sampled by _check
    view[1, empty] = -1
    _poison_free_memory()
    out = _run(p, case, buf, replace(SHIPPED, max_tokens_per_pass=3000))
    torch.cuda.empty_cache()
    G = p.gqa_group
    assert (out[empty, G:2 * G] == 0).all(), "a row that selects nothing must be zeros"
    _check(p, case, buf, out, _run(p, case, buf, None))
