"""fp8 K/V with bf16 queries dotted in fp16 (``numerics.kv_fp8_as_f16``), through Triton's interpreter.

The path under test touches bf16 only to widen the query rows to fp32 before
their per-row power-of-two scaling, which the interpreter computes correctly;
every dot is fp16 (keys and values widened e4m3 -> fp16 exactly, ``P`` in
fp16) with fp32 accumulation. The kernels write an fp32 ``out`` here (the
launchers store in ``out``'s dtype): the interpreter rounds fp32 -> bf16 by
truncation where a GPU rounds to nearest, and that store is the only bf16
arithmetic left; the bf16 store runs on the H200 (tests/gpu/test_fp8_kv_gpu.py).
The tolerances are fp16's (docs/spec.md §4): the dots are fp16.

Every case is a mixed batch (speculative decodes, a padding decode, a chunked
and a fresh prefill) on a NaN-poisoned output, against the fp64 oracle on the
dequantized cache, fresh random inputs.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention, oracle_topk
from mm3_backends.triton.launch import override

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

#: docs/spec.md §4 for fp16 (max, mean)
F16_TOL = (1e-2, 1.5e-4)


def _configs() -> dict[str, object]:
    from mm3_backends.triton.plugin_factory import INTERPRETER_CONFIG as base

    # the fp16 path in every kernel: the cuda plugin's decode, and its prefill as an option
    assert base.numerics.kv_fp8_as_f16 and base.numerics.kv_fp8_as_f16_prefill
    assert base.decode_attention_fp8 is None   # the shared kernels with decode_attention's tiles
    return {
        "persistent_decode+block_grouped_prefill": base,
        "shared_persistent_decode+block_tiles_prefill": override(
            base, decode_attention_fp8=None, prefill_attention=replace(base.prefill_attention, run_tiles=0)),
        "grid_decode+token_tile_prefill": override(base, algorithms=dict(decode_attention_flat=False),
                                                   decode_attention_fp8=None, prefill_attention=None),
        "branching_decode+union_prefill": override(base, prefill_attention=None, decode_attention_fp8=None,
                                                   algorithms=dict(decode_attention_flat=False,
                                                                   decode_attention_branchless=False,
                                                                   prefill_attention_union=True)),
    }


def _run(path: str, *, layout: str = "NHD", kv_scale: str = "head", row_scales: object = None,
         scale: object = None, seed: int = 0, cfg: object = None) -> None:
    """One mixed step with bf16 queries (rows times ``row_scales``) on fp8 K/V, checked against the oracle."""
    from mm3_backends.triton import attention

    p = SparseAttentionParams(num_heads=6, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4, scale=scale)
    case = make_case(p, decodes=[70, 33], prefills=[(9, 60), (3, 3)], padding_decodes=1, decode_query_len=2,
                     dtype="float16", index_dtype="float16", kv_dtype="float8_e4m3fn", kv_scale=kv_scale,
                     kv_layout=layout, seed=seed)
    q = case.q.float()
    if row_scales is not None:
        rows = torch.arange(q.shape[0] * p.num_heads) % len(row_scales)
        q = (q.reshape(-1, p.head_dim) * torch.tensor(row_scales)[rows, None]).reshape(q.shape)
    q = q.to(torch.bfloat16)
    T = case.batch.num_tokens
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    out = torch.full((T + 2, p.num_heads, p.head_dim), float("nan"), dtype=torch.float32)
    attention.attention_forward(q, case.caches, sel, case.batch, p, out[:T], cfg or _configs()[path])
    assert out[T:].isnan().all(), "rows past the step were written"
    assert not out[:T].isnan().any(), "unwritten (NaN-poisoned) output elements"
    err = (out[:T].double() - oracle_attention(q, case.caches, sel, case.batch, p)).abs()
    assert err.max().item() <= F16_TOL[0] and err.mean().item() <= F16_TOL[1], (err.max().item(), err.mean().item())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("path", sorted(_configs()))
def test_bf16_queries_on_fp8_kv_match_oracle(path: str, layout: str) -> None:
    """Every attention kernel on the fp16 path (the undo factor of the query scaling is 2^-13 here,
    so a kernel that dropped it would be far off), per-KV-head and per-tensor scales."""
    _run(path, layout=layout, kv_scale="head" if layout == "HND" else "tensor", seed=len(path) + len(layout))


@pytest.mark.parametrize("magnitude", [1e6, 1e-6, "mixed"])
@pytest.mark.parametrize("path", ["persistent_decode+block_grouped_prefill", "grid_decode+token_tile_prefill"])
def test_query_rows_outside_fp16_range(path: str, magnitude: object) -> None:
    """bf16 query rows fp16 cannot hold unscaled: 1e6 overflows to inf, 1e-6 is an fp16 subnormal with
    a few bits left. The softmax scale is set so the logits stay of order one (a kernel that lost
    the rows' bits would be visibly off, not just rounded); "mixed" spans 1e-6 .. 1e6 across the
    rows of one tile at the default scale (a 1e6 row is a near one-hot softmax)."""
    if magnitude == "mixed":
        _run(path, row_scales=[1e-6, 1e6, 3e4, 1e5, 7e-5, 1.0, 2.0 ** -20, 250.0], seed=3)
    else:
        # rows vary by up to 2^3 around the magnitude, so each row gets its own power of two
        _run(path, row_scales=[magnitude * f for f in (1.0, 0.3, 7.0, 0.125, 2.5)],
             scale=32 ** -0.5 / magnitude, seed=4)


def test_fp8_decode_config_is_used_for_fp8_kv_only() -> None:
    """``decode_attention_fp8`` (more splits and another pipeline depth here) drives the fp8 step, whose result
    still matches the oracle; a bf16 K/V step keeps ``decode_attention``."""
    from mm3_backends.triton.plugin_factory import INTERPRETER_CONFIG as base

    cfg = override(base, decode_attention_fp8=replace(base.decode_attention, flat_programs_per_sm=8,
                                                      stages=2))
    assert cfg.decode_attention_splits(2, 2, 4, fp8_kv=True) == 4 != cfg.decode_attention_splits(2, 2, 4)
    assert cfg.decode_attention_for(False) is base.decode_attention
    _run("persistent_decode+block_grouped_prefill", cfg=cfg, seed=11)
