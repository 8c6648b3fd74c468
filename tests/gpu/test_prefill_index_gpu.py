"""The prefill indexer's split token tiles and optional paths on a real GPU at M3 shapes (skipped without CUDA).

The cuda plugin splits each token tile's visible blocks over several programs
when the tiles do not fill the GPU (TP8: 64 tiles for an 8K chunk). The merged
selection must equal the single-pass kernel's bit for bit (packed keys order
ties by block id), on the benchmark's shapes, with random and all-equal scores,
bf16 and fp8 index caches; and the step's rows outside the prefill stay
untouched. The chunked kernel's optional paths (``PrefillIndexConfig``
``unmasked_full``, ``sorted_merge``, ``static_key_stride``) must likewise
equal the plain kernel bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.params import SparseAttentionParams
from mm3_backends.cuda import plugin as cuda_plugin
from mm3_backends.triton import indexer
from mm3_backends.triton.launch import override

from gpu_reference import build_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SENTINEL = -7


def _select(case, p: SparseAttentionParams, cfg) -> torch.Tensor:  # noqa: ANN001
    T = case.batch.num_tokens
    buf = TopkBuffer.allocate(T + 3, p.num_kv_heads, p.topk, "token_major", device=case.q.device, fill=SENTINEL)
    indexer.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T), cfg)
    torch.cuda.synchronize()
    assert (buf.head_major()[:, T:] == SENTINEL).all(), "rows past the step were written"
    return buf.rows(0, T).head_major().clone()


@pytest.mark.parametrize("tp, context, index_dtype, ties", [
    (8, 32768, torch.bfloat16, False), (8, 0, torch.bfloat16, False), (8, 32768, torch.float8_e4m3fn, False),
    (8, 32768, torch.bfloat16, True), (1, 32768, torch.bfloat16, False)])
def test_split_prefill_index_equals_single_pass(tp: int, context: int, index_dtype: torch.dtype, ties: bool) -> None:
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = build_case(p, decodes=[3000, 700], prefills=[(8192, context + 8192), (300, 5000)],
                      index_dtype=index_dtype, seed=11 + tp + context)
    if ties:
        idx = case.caches.index
        idx.copy_(idx[:1, :1].expand_as(idx))
    # the grid is requests x the longest request's tiles (2 x 128 at TP8, 2 x 512 at TP1): a
    # device target of 4 x that makes the rule split them, so the split and the single pass
    # both run here
    cuda_cfg = cuda_plugin.PLATFORM.launch_config(torch.device("cuda"))
    tiles = 2 * -(-8192 // (cuda_cfg.prefill_index.rows // p.num_index_heads))
    base = override(cuda_cfg, target_programs=4 * tiles + 8)
    cfg = override(base, prefill_index=dict(max_splits=8))
    splits = cfg.prefill_index_splits(tiles, case.batch.block_table.shape[1])
    if context >= 32768:
        assert splits > 1, (tiles, case.batch.block_table.shape[1])
    single = _select(case, p, override(base, prefill_index=dict(max_splits=1)))
    split = _select(case, p, cfg)
    assert torch.equal(split, single)


#: the chunked kernel's optional paths (tests/test_prefill_index_variants.py on the CPU)
PLAIN = dict(unmasked_full=False, sorted_merge=False, static_key_stride=False)
FLAGS = dict(unmasked_full=True, sorted_merge=True, static_key_stride=True)


@pytest.mark.parametrize("tp, context, index_dtype, ties, local", [
    (1, 32768, torch.bfloat16, False, 1), (1, 0, torch.bfloat16, False, 1), (1, 32768, torch.bfloat16, False, 0),
    (1, 32768, torch.float8_e4m3fn, False, 1), (1, 32768, torch.bfloat16, True, 1),
    (8, 32768, torch.bfloat16, False, 1), (8, 32768, torch.bfloat16, False, 0)])
def test_prefill_index_paths_equal_the_plain_kernel(tp: int, context: int, index_dtype: torch.dtype, ties: bool,
                                                    local: int) -> None:
    """Unmasked full tiles, the sorted merge and the compiled key stride (each alone, all three, and all
    three on 128-row tiles of 8 warps) select what the plain chunked kernel selects, bit for bit; with
    no forced local block (``local=0``) the causal mask decides the diagonal blocks' scores."""
    p = SparseAttentionParams.minimax_m3(tp_size=tp, local_blocks=local)
    case = build_case(p, decodes=[3000, 700], prefills=[(8192, context + 8192), (300, 5000)],
                      index_dtype=index_dtype, seed=23 + tp + context + local)
    if ties:
        idx = case.caches.index
        idx.copy_(idx[:1, :1].expand_as(idx))
    cuda_cfg = cuda_plugin.PLATFORM.launch_config(torch.device("cuda"))
    plain = _select(case, p, override(cuda_cfg, prefill_index=PLAIN))
    for fields in (dict(unmasked_full=True), dict(sorted_merge=True), dict(static_key_stride=True), FLAGS,
                   dict(FLAGS, rows=128, warps=8)):
        got = _select(case, p, override(cuda_cfg, prefill_index=dict(PLAIN, **fields)))
        assert torch.equal(got, plain), fields
