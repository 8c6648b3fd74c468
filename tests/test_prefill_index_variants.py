"""The prefill indexer's optional paths select exactly what its plain path selects.

``PrefillIndexConfig.unmasked_full`` (causal mask only on the key tiles some
row sees in part), ``sorted_merge`` (fp32 chunk scores packed once per chunk,
ascending running top-K merged by a bitonic merge) and ``static_key_stride``
(the index cache's row stride compiled in) change instructions, not results:
each must give the plain path's selection bit for bit, ties included, on a
mixed decode + prefill step, and the plain path must agree with the fp64
oracle. Checked on the CPU interpreter; tests/gpu/test_prefill_index_gpu.py
runs the same comparison at MiniMax-M3 shapes on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from mm3.contract.buffers import TopkBuffer
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3.testing.oracle import check_topk

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

SENTINEL = -7
ALL = dict(unmasked_full=True, sorted_merge=True, static_key_stride=True)
#: name -> (prefill_index fields, other LaunchConfig overrides)
PATHS = {
    "unmasked": (dict(unmasked_full=True), {}),
    "sorted": (dict(sorted_merge=True), {}),
    "stride": (dict(static_key_stride=True), {}),
    "all": (ALL, {}),
    # the tiles split over programs
    "all_splits": (dict(ALL, max_splits=2), dict(target_programs=256)),
}


def _case(kind: str):  # noqa: ANN202 - (Case, params)
    # 32-key blocks read in 16-key tiles, so a diagonal block holds a tile every row sees whole
    # and one some rows see in part; chunks of 4 blocks, so every prefill merges several chunks.
    # No forced local block but in "local": a row's partly visible block is its local one, so
    # with a forced local block the causal mask could never change a selection
    p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2,
                              index_head_dim=32, block_size=32, topk=4, init_blocks=1,
                              local_blocks=1 if kind == "local" else 0)
    case = make_case(p, decodes=[90, 33], prefills=[(24, 520), (7, 7), (40, 300)], padding_decodes=1,
                     dtype="float16", index_dtype="float16", seed=13)
    idx = case.caches.index
    if kind == "ties":  # every key the same non-zero vector: all scores equal, the lowest ids must win
        idx.copy_(idx[:1, :1].expand_as(idx))
    elif kind == "nan":  # NaN scores count as -1e30 (docs/spec.md §3.3)
        idx[1::3, 5] = float("nan")
    elif kind == "strided":  # the index cache's rows 2 * Di apart: the compiled stride is the real one
        wide = torch.randn(*idx.shape[:2], 2 * idx.shape[2], generator=torch.Generator().manual_seed(3))
        wide = wide.to(idx.dtype)
        case = replace(case, caches=replace(case.caches, index=wide[:, :, :idx.shape[2]]))
    return case, p


def _select(case, p: SparseAttentionParams, fields: dict, other: dict) -> torch.Tensor:  # noqa: ANN001
    from mm3_backends.triton import indexer
    from mm3_backends.triton.launch import override
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    plain = dict(chunk=4, block_n=16, max_splits=1, unmasked_full=False, sorted_merge=False,
                 static_key_stride=False)
    cfg = override(base, prefill_index=dict(plain, **fields), **other)
    T = case.batch.num_tokens
    buf = TopkBuffer.allocate(T + 2, p.num_kv_heads, p.topk, "token_major", fill=SENTINEL)
    indexer.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T), cfg)
    got = buf.head_major()
    assert (got[:, T:] == SENTINEL).all(), "rows past the step were written"
    assert not (got[:, :T] == SENTINEL).any(), "a slot of the step was left unwritten"
    return buf.rows(0, T)


@pytest.mark.parametrize("kind, paths", [
    ("random", ["all_splits"]),   # one flag at a time and all three: the cases below
    ("local", ["sorted", "all"]),
    ("ties", ["sorted", "all_splits"]),
    ("nan", ["unmasked", "all"]),
    ("strided", ["stride", "all"]),
])
def test_optional_paths_equal_the_plain_kernel(kind: str, paths: list[str]) -> None:
    case, p = _case(kind)
    plain = _select(case, p, {}, {})
    if kind != "nan":
        errors = check_topk(plain, case.index_q, case.caches, case.batch, p)
        assert not errors, "\n".join(map(str, errors[:5]))
    for name in paths:
        fields, other = PATHS[name]
        got = _select(case, p, fields, other).head_major()
        assert torch.equal(got, plain.head_major()), f"{name} selects differently from the plain kernel ({kind})"
