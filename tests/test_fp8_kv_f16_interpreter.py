"""fp8 K/V with bf16 queries dotted in fp16 (``numerics.kv_fp8_as_f16``), through Triton's interpreter.

In the decode kernels every dot is fp16 (keys and values widened e4m3 or e5m2 -> fp16
exactly, query rows scaled per row by a power of two, ``P`` in fp16) with fp32
accumulation: their rows are held to fp16's tolerances (docs/spec.md §4). The
prefill kernels widen K/V to bf16 and dot in bf16 (bf16's tolerances; the
interpreter's bf16 is made right by backends/triton/interpreter.py). The
kernels write an fp32 ``out`` here (the launchers store in ``out``'s dtype),
so no rounding of the result hides an error of the dots.

Every case is a mixed batch (speculative decodes, a padding decode, a chunked
and a fresh prefill) on a NaN-poisoned output, against the fp64 oracle on the
dequantized cache, fresh random inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import full_range_fp8, make_case
from mm3.testing.oracle import oracle_attention, oracle_topk
from mm3_backends.triton.launch import override

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

#: docs/spec.md §4 (max, mean) for fp16 (the decode kernels' dots) and bf16 (the prefill kernels')
F16_TOL = (1e-2, 1.5e-4)
BF16_TOL = (2e-2, 3e-4)


def _configs() -> dict[str, object]:
    from mm3_backends.cuda.plugin import PLATFORM

    base = PLATFORM.launch_config(torch.device("cpu"))   # the cuda plugin's, interpreted

    # the fp16 path in both decode kernels (the cuda plugin's persistent one, the grid one)
    assert base.numerics.kv_fp8_as_f16
    return {
        "persistent_decode+block_grouped_prefill": base,
        "grid_decode+token_tile_prefill": override(base, algorithms=dict(decode_attention_flat=False),
                                                   prefill_attention=None),
    }


def _run(path: str, *, layout: str = "NHD", kv_scale: str = "head", row_scales: object = None,
         scale: object = None, seed: int = 0, cfg: object = None, kv_dtype: str = "float8_e4m3fn",
         full_range: bool = False) -> None:
    """One mixed step with bf16 queries (rows times ``row_scales``) on fp8 K/V, checked against the oracle
    (``full_range``: K/V stored across the whole fp8 range, :func:`~mm3.testing.factories.full_range_fp8`)."""
    from mm3_backends.triton import attention

    p = SparseAttentionParams(num_heads=6, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=4, scale=scale)
    case = make_case(p, decodes=[70, 33], prefills=[(9, 60), (3, 3)], padding_decodes=1, decode_query_len=2,
                     dtype="float16", index_dtype="float16", kv_dtype=kv_dtype, kv_scale=kv_scale,
                     kv_layout=layout, seed=seed)
    if full_range:
        case.caches = full_range_fp8(case.caches, torch.Generator().manual_seed(seed))
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
    td = case.batch.num_decode_tokens
    for rows, (max_tol, mean_tol) in ((err[:td], F16_TOL), (err[td:], BF16_TOL)):
        assert rows.max().item() <= max_tol and rows.mean().item() <= mean_tol, (td, rows.max().item(),
                                                                                  rows.mean().item())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("path", sorted(_configs()))
def test_bf16_queries_on_fp8_kv_match_oracle(path: str, layout: str) -> None:
    """Every attention kernel on the fp16 path (the undo factor of the query scaling is 2^-13 here,
    so a kernel that dropped it would be far off), per-KV-head and per-tensor scales."""
    _run(path, layout=layout, kv_scale="head" if layout == "HND" else "tensor", seed=len(path) + len(layout))


@pytest.mark.parametrize("path, layout, kv_scale", [("persistent_decode+block_grouped_prefill", "HND", "tensor"),
                                                    ("grid_decode+token_tile_prefill", "NHD", "head")])
def test_bf16_queries_on_e5m2_kv_match_oracle(path: str, layout: str, kv_scale: str) -> None:
    """The fp16 dots on e5m2 K/V (widened e5m2 -> fp16 exactly: the same exponent range), both decode kernels."""
    _run(path, layout=layout, kv_scale=kv_scale, seed=len(path) + len(layout) + 1, kv_dtype="float8_e5m2")


@pytest.mark.parametrize("path", sorted(_configs()))
def test_bf16_queries_on_e5m2_values_past_e4m3s_range(path: str) -> None:
    """e5m2 K/V stored up to 57344 (fp16's largest is 65504): the fp16 dots hold them exactly, and the
    scaled query rows (up to 2^15) times them stay far inside fp32's range."""
    _run(path, seed=9, kv_dtype="float8_e5m2", full_range=True)


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
