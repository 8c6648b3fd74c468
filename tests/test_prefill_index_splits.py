"""The prefill indexer with each token tile's blocks split over several programs, on the CPU.

When the token tiles alone do not fill the GPU (TP8: one index head, so an
8K chunk is 64 tiles), ``LaunchConfig.prefill_index_splits`` splits each
tile's visible blocks over 2-8 programs and a merge kernel combines their
packed (score, -id) keys. The merged selection must be *exactly* the
single-pass one, ties included: checked bit for bit against the unsplit
kernel and against the fp64 oracle, with all-equal scores as the tie case.
"""

from __future__ import annotations

import os

import pytest
import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3.testing.oracle import check_topk, oracle_topk

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

SENTINEL = -7


def _config(max_splits: int):  # noqa: ANN202 - a LaunchConfig
    from mm3_backends.triton.launch import override
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    return override(base, target_programs=256, prefill_index=dict(chunk=4, max_splits=max_splits))


def _select(case, p: SparseAttentionParams, max_splits: int, layout: str) -> TopkBuffer:  # noqa: ANN001
    from mm3_backends.triton import indexer

    T = case.batch.num_tokens
    buf = TopkBuffer.allocate(T + 2, p.num_kv_heads, p.topk, layout, fill=SENTINEL)
    indexer.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T), _config(max_splits))
    assert (buf.head_major()[:, T:] == SENTINEL).all(), "rows past the step were written"
    return buf.rows(0, T)


# (two index heads with random scores and 2 splits: test_triton_interpreter.py's kernel paths)
@pytest.mark.parametrize("heads, ties", [(1, True)])
def test_split_selection_equals_single_pass_and_oracle(heads: int, ties: bool) -> None:
    p = SparseAttentionParams(num_heads=2 * heads, num_kv_heads=heads, head_dim=32, num_index_heads=heads,
                              index_head_dim=32, block_size=16, topk=4, init_blocks=1)
    # a decode first (prefill rows start after it), a long chunk with context, a short prefill
    # whose tile has fewer blocks than splits (empty ranges), and a chunk of 3 tokens
    case = make_case(p, decodes=[40], prefills=[(24, 520), (7, 7), (3, 200)], dtype="float16",
                     index_dtype="float16", seed=5 + heads + 10 * ties)
    if ties:  # every key the same non-zero vector: all scores equal, the lowest ids must win
        idx = case.caches.index
        idx.copy_(idx[:1, :1].expand_as(idx))
    m = 32 // heads  # interpreter tiles hold 32 rows = tokens x index heads
    tiles = 3 * -(-24 // m)
    for splits in (2, 4):
        assert _config(splits).prefill_index_splits(tiles, case.batch.block_table.shape[1]) == splits
    single = _select(case, p, 1, "head_major").head_major()
    for splits, layout in ((2, "token_major"), (4, "head_major")):
        got = _select(case, p, splits, layout)
        assert torch.equal(got.head_major(), single), f"{splits} splits differ from the single pass"
        errors = check_topk(got, case.index_q, case.caches, case.batch, p)
        assert not errors, "\n".join(map(str, errors[:5]))
    if ties:
        want = oracle_topk(case.index_q, case.caches, case.batch, p).head_major()
        assert torch.equal(single.sort(-1).values, want.sort(-1).values)
