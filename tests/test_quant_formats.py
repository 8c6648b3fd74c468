"""The model authors' formats (docs/spec.md §1): fp8 queries, e4m3 K/V without a scale, NVFP4 K/V
and index keys. Their contract (named errors when a cache is built, capabilities, selection that refuses
with the reason), the reference's exact reading against the fp64 oracle, and the conformance cases."""

from __future__ import annotations

import pytest
import torch

import mm3
from mm3.contract.quant import dequantize_nvfp4, quantize_nvfp4, round_e4m3, unpack_e2m1
from mm3.runtime.registry import default_registry
from mm3.runtime.selection import requirements_for
from mm3.testing.conformance.quant_cases import QUANT_CASES
from mm3.testing.conformance.suite import plan_cases
from mm3.testing.conformance.verdicts import CaseFailure, check_attention
from mm3.testing.factories import make_case, quantize_caches
from mm3.testing.oracle import oracle_attention, oracle_topk

P = mm3.SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                              block_size=16, topk=8)
U8, E4 = torch.uint8, torch.float8_e4m3fn


def nvfp4_parts(pages: int = 3, D: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = torch.zeros(pages, 16, 2, D // 2, dtype=U8)
    return k, torch.ones(pages, 16, 2, D // 16).to(E4), torch.zeros(pages, 16, 32)


# -- the values ---------------------------------------------------------------------------------------


def test_the_low_nibble_is_the_even_element_and_every_code_has_its_e2m1_value() -> None:
    packed = torch.arange(256, dtype=U8).view(16, 16)
    v = unpack_e2m1(packed)
    # e2m1 (OCP microscaling spec): sign bit 3, two exponent bits, one mantissa bit, no inf or NaN; written out
    # here, not read from mm3's table
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert v[..., 0::2].flatten().tolist() == [table[b & 15] for b in range(256)]
    assert v[..., 1::2].flatten().tolist() == [table[b >> 4] for b in range(256)]


def test_nvfp4_dequantizes_exactly_and_quantizes_to_the_nearest_code_ties_to_even() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.1, -0.3, -5.0, 0.5, -6.0, -2.9, 0.0, 0.0])
    packed, scales = quantize_nvfp4(x)
    assert float(scales.float()) == 1.0
    assert dequantize_nvfp4(packed, scales).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0, -0.5, -4, 0.5, -6, -3, 0, 0]
    scales = torch.tensor([448.0, 0.015625]).to(E4)        # largest e4m3, and a small one
    packed = torch.full((16,), 0x77, dtype=U8)              # 6.0 everywhere
    assert dequantize_nvfp4(packed, scales, torch.float64).tolist() == [2688.0] * 16 + [0.09375] * 16


# -- the contract: a cache says what it holds -------------------------------------------------------------


def test_an_nvfp4_cache_carries_its_scales_and_its_logical_head_dim() -> None:
    k, s, idx = nvfp4_parts()
    c = mm3.PagedKVCache(k, k.clone(), idx, k_block_scale=s, v_block_scale=s.clone())
    assert (c.kv_format, c.head_dim, c.k_scale, c.kv_scaled) == ("nvfp4", 32, None, False)
    hnd = c.to_layout("HND")
    assert hnd.kv_layout == "HND" and hnd.k_block_scale.stride(2) > hnd.k_block_scale.stride(1)
    assert torch.equal(hnd.dequantized().k, c.dequantized().k)
    u = mm3.PagedKVCache(torch.zeros(3, 16, 2, 32).to(E4), torch.zeros(3, 16, 2, 32).to(E4), idx,
                         kv_format="float8_e4m3fn_unscaled")
    assert u.kv_format == "float8_e4m3fn_unscaled" and u.k_scale is None


BAD_CACHES = {
    "wrong scale shape": (lambda k, s, i: dict(k_block_scale=s[..., :1], v_block_scale=s), r"needs \(3, 16, 2, 2\)"),
    "scale dtype": (lambda k, s, i: dict(k_block_scale=s.float(), v_block_scale=s), "NVFP4 scales are float8_e4m3fn"),
    "NaN scale": (lambda k, s, i: dict(k_block_scale=s.float().index_fill(0, torch.tensor([1]), float("nan")).to(E4),
                                       v_block_scale=s), "finite and >= 0"),
    "negative scale": (lambda k, s, i: dict(k_block_scale=s, v_block_scale=(-s.float()).to(E4)), "finite and >= 0"),
    "no scales": (lambda k, s, i: dict(), "needs k_block_scale"),
    "a global scale too": (lambda k, s, i: dict(k_scale=1.0, v_scale=1.0, k_block_scale=s, v_block_scale=s),
                           "no global scale"),
}


@pytest.mark.parametrize("case", list(BAD_CACHES))
def test_a_bad_nvfp4_cache_is_a_named_error_when_built(case: str) -> None:
    k, s, idx = nvfp4_parts()
    kwargs, words = BAD_CACHES[case]
    with pytest.raises(mm3.InputError, match=words):
        mm3.PagedKVCache(k, k.clone(), idx, **kwargs(k, s, idx))


def test_head_dims_that_nvfp4_cannot_hold_are_named() -> None:
    k = torch.zeros(3, 16, 2, 4, dtype=U8)            # head_dim 8: not a multiple of 16
    with pytest.raises(mm3.InputError, match="multiple of 16"):
        mm3.PagedKVCache(k, k, torch.zeros(3, 16, 32), k_block_scale=torch.ones(3, 16, 2, 0).to(E4),
                         v_block_scale=torch.ones(3, 16, 2, 0).to(E4))
    for dim in (33, 40):                               # odd, and even but not a multiple of 16
        with pytest.raises(mm3.InputError, match="multiple of 16"):
            mm3.PagedKVCache.allocate(3, 16, 2, dim, 32, kv_format="nvfp4")
    with pytest.raises(mm3.InputError, match="multiple of 16"):
        mm3.PagedKVCache.allocate(3, 16, 2, 32, 24, index_format="nvfp4")


def test_fp8_without_scales_is_still_an_error_unless_the_cache_says_unscaled() -> None:
    k = torch.zeros(3, 16, 2, 32).to(E4)
    with pytest.raises(mm3.InputError, match="need k_scale and v_scale"):
        mm3.PagedKVCache(k, k, torch.zeros(3, 16, 32))
    with pytest.raises(mm3.InputError, match="without k_scale/v_scale"):
        mm3.PagedKVCache(k, k, torch.zeros(3, 16, 32), 1.0, 1.0, kv_format="float8_e4m3fn_unscaled")
    with pytest.raises(mm3.InputError, match="block scales belong to NVFP4"):
        mm3.PagedKVCache(k.float(), k.float(), torch.zeros(3, 16, 32), k_block_scale=torch.ones(3, 16, 2, 2).to(E4))
    with pytest.raises(mm3.InputError, match="index_block_scale"):
        mm3.PagedKVCache(k.float(), k.float(), torch.zeros(3, 16, 16, dtype=U8))


# -- cpu_ref reads them exactly: the fp64 oracle of the dequantized values ---------------------------------


@pytest.mark.parametrize("kv", ["nvfp4", "float8_e4m3fn_unscaled", None])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cpu_ref_reads_each_format_as_the_oracle_does(kv: str, layout: str) -> None:
    case = make_case(P, decodes=[90, 40], prefills=[(9, 70), (5, 5)], decode_query_len=2, padding_decodes=1,
                     dtype="float32", kv_dtype=kv, index_dtype="nvfp4", q_dtype="float8_e4m3fn", kv_layout=layout,
                     pages="shared_prefix", seed=3)
    be = default_registry().get("cpu_ref")
    sel = mm3.TopkBuffer.allocate(case.batch.num_tokens, 2, P.topk)
    be.index_topk(case.index_q, case.caches, case.batch, P, sel)
    assert torch.equal(sel.head_major(), oracle_topk(case.index_q, case.caches, case.batch, P).head_major())
    out = torch.empty(case.batch.num_tokens, 8, 32)
    be.attention_forward(case.q, case.caches, sel, case.batch, P, out)
    ref = oracle_attention(case.q, case.caches, sel, case.batch, P)
    assert (out.double() - ref).abs().max() < 1e-5      # float32's tolerance: the reading is exact


def test_the_layer_serves_nvfp4_and_fp8_queries_eagerly_and_compiled() -> None:
    case = make_case(P, decodes=[70, 40], prefills=[(9, 30)], dtype="bfloat16", kv_dtype="nvfp4",
                     index_dtype="nvfp4", q_dtype="float8_e4m3fn")
    layer = mm3.SparseAttention(P, dtype=torch.bfloat16, index_dtype="nvfp4", kv_dtype="nvfp4",
                                q_dtype=torch.float8_e4m3fn, max_num_tokens=64, backend="cpu_ref")
    assert "KV cache nvfp4, float8_e4m3fn queries" in layer.explain()
    with torch.inference_mode():
        eager = layer(case.q, case.index_q, case.caches, case.batch)
        compiled = torch.compile(layer.forward, fullgraph=True, backend="eager")(
            case.q, case.index_q, case.caches, case.batch)
    assert eager.dtype == torch.bfloat16 and torch.equal(eager, compiled)
    plain = mm3.SparseAttention(P, dtype=torch.bfloat16, q_dtype=torch.float8_e4m3fn, max_num_tokens=64,
                                backend="cpu_ref")
    with pytest.raises(mm3.InputError, match="cache is nvfp4 but this layer was built for torch.bfloat16"):
        plain(case.q, case.index_q, case.caches, case.batch)


# -- selection: a backend that does not declare a format is never handed it ------------------------------


@pytest.mark.parametrize("name", ["cuda", "rocm"])
def test_the_triton_plugins_declare_every_format_of_the_authors(name: str) -> None:
    """NVFP4 K/V and index keys, unscaled e4m3 K/V and fp8 queries: selection hands them all to both plugins,
    and the conformance plan runs every case of them on a GPU (here: waits for the probe, never for a
    missing declaration)."""
    caps = default_registry().get(name).capabilities
    for kv, idx, q in (("nvfp4", "bfloat16", None), (None, "nvfp4", None), ("nvfp4", "nvfp4", "float8_e4m3fn"),
                       ("float8_e4m3fn_unscaled", "bfloat16", "float8_e4m3fn")):
        req = requirements_for(P, "bfloat16", idx, "cuda", kv_dtype=kv, query_dtype=q)
        assert not caps.unmet(req), (kv, idx, q, caps.unmet(req))
    planned = {c.name.split("/")[1].split(":")[0]: c for c in plan_cases(name, device="cuda")
               if c.name.split("/")[1].split(":")[0] in QUANT_CASES}
    assert len(planned) == len(QUANT_CASES)
    for case_name in QUANT_CASES:
        assert "cannot read" not in (planned[case_name].skip or ""), (case_name, planned[case_name].skip)


def test_the_bench_rows_of_nvfp4_select_the_cuda_plugin() -> None:
    """``mm3 bench``'s kv-nvfp4 rows (decode and prefill, NVFP4 index keys too) ask for what the cuda plugin
    declares, so on a GPU its automatic selection measures the Triton kernels, not a refusal."""
    from mm3_benchmarks.harness import SHAPES_FULL, full_grid

    rows = [c for c in full_grid() if "nvfp4" in (c.kv_dtype, getattr(c, "index_dtype", ""))]
    assert {"decode", "prefill"} <= {c.name.split()[0] for c in rows} and all("kv-nvfp4" in c.name for c in rows)
    caps = default_registry().get("cuda").capabilities
    for c in rows:
        req = requirements_for(SHAPES_FULL[c.shape], "bfloat16", getattr(c, "index_dtype", "bfloat16"), "cuda",
                               kv_dtype=c.kv_dtype, query_dtype=None if c.q_dtype == "bfloat16" else c.q_dtype)
        assert not caps.unmet(req), (c.name, caps.unmet(req))


def test_a_bound_backend_without_the_format_refuses_the_call_by_name() -> None:
    from mm3.testing.helpers import RegistryFactory
    from mm3.testing.mock import MockBackend

    plain = MockBackend(name="plain_kv", device_types={"cpu"}, topk_layout="head_major", priority=50,
                        kv_cache_dtypes={"bfloat16", "float16", "float32"})
    reg = RegistryFactory()(plain)
    case = make_case(P, decodes=[40], dtype="bfloat16", kv_dtype="nvfp4")
    out = torch.empty(case.batch.num_tokens, 8, 32, dtype=torch.bfloat16)
    sel = mm3.TopkBuffer.allocate(case.batch.num_tokens, 2, P.topk)
    with pytest.raises(mm3.InputError, match="KV cache dtype nvfp4 not in .*cannot read NVFP4 K/V"):
        reg.get("plain_kv").attention_forward(case.q, case.caches, sel, case.batch, P, out)


# -- conformance: every quantized case against the oracle, and the authors' rounding within tolerance ------


def test_cpu_ref_passes_every_case_of_the_authors_formats() -> None:
    plan = [c for c in plan_cases("cpu_ref", dtypes=["bfloat16"]) if c.name.split("/")[1].split(":")[0] in QUANT_CASES]
    results = [c.run() for c in plan]
    assert len(results) == len(QUANT_CASES)
    assert all(r.status == "pass" for r in results), [(r.name, r.message) for r in results if r.status != "pass"]


def _authors(case, sel) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The authors' arithmetic (docs/spec.md §1): NVFP4 products rounded to e4m3, P * 448 rounded to e4m3 for
    the P.V product, the normaliser from the unrounded P; fp32 elsewhere."""
    c = case.caches
    k, v = (round_e4m3(dequantize_nvfp4(t, s)) for t, s in ((c.k, c.k_block_scale), (c.v, c.v_block_scale)))
    q, bt = case.q.float(), case.batch.block_table.long()
    out = torch.zeros(case.batch.num_tokens, 8, 32)
    for t, (r, pos) in enumerate(zip(case.batch.token_to_request.tolist(), case.batch.token_positions.tolist())):
        if pos < 0:
            continue
        for h in range(2):
            blocks = [b for b in set(sel.head_major()[h, t].tolist()) if 0 <= b <= pos // 16]
            j = torch.tensor([b * 16 + s for b in blocks for s in range(16) if b * 16 + s <= pos])
            kk, vv = k[bt[r, j // 16], j % 16, h], v[bt[r, j // 16], j % 16, h]
            logits = q[t, h * 4:(h + 1) * 4] @ kk.T * P.softmax_scale
            p = torch.exp(logits - logits.amax(-1, keepdim=True))
            out[t, h * 4:(h + 1) * 4] = (round_e4m3(p * 448) @ vv) / 448 / p.sum(-1, keepdim=True)
    return out


def test_the_authors_rounding_passes_the_quantized_tolerance_and_a_misread_does_not() -> None:
    case = make_case(P, decodes=[420, 300], prefills=[(6, 380)], dtype="bfloat16", kv_dtype="nvfp4",
                     q_dtype="float8_e4m3fn", seed=5)
    sel = oracle_topk(case.index_q, case.caches, case.batch, P)
    out = torch.cat([_authors(case, sel).to(torch.bfloat16), torch.full((3, 8, 32), 7777.0, dtype=torch.bfloat16)])
    details: dict = {}
    check_attention(case, sel, out, details)
    assert details["mean_err"] > 3 * details["floor_mean"]   # the rounding shows, and stays within tolerance
    c = case.caches          # nibbles swapped: the odd element read as the even one
    swapped = mm3.PagedKVCache((c.k << 4) | (c.k >> 4), c.v, c.index, k_block_scale=c.k_block_scale,
                               v_block_scale=c.v_block_scale)
    wrong = oracle_attention(case.q, swapped, sel, case.batch, P).to(torch.bfloat16)
    with pytest.raises(CaseFailure, match="attention error vs fp64 oracle"):
        check_attention(case, sel, torch.cat([wrong, out[-3:]]), {})


def test_quantize_caches_keeps_the_layout_and_the_values_the_oracle_reads() -> None:
    case = make_case(P, decodes=[40], prefills=[(5, 20)], dtype="float32", kv_layout="HND")
    q4 = quantize_caches(case.caches, "nvfp4", "nvfp4")
    assert q4.kv_layout == "HND" and q4.index_format == "nvfp4"
    assert (q4.dequantized().k - case.caches.k).abs().mean() < 0.1
    u8 = quantize_caches(case.caches, "float8_e4m3fn_unscaled")
    assert torch.equal(u8.dequantized().k, case.caches.k.to(E4).float())


def test_the_engines_kv_cache_dtype_names_map_or_are_refused_with_the_reason() -> None:
    from mm3.integrations.kv_names import kv_format

    assert kv_format("vllm", "fp8", "bfloat16") == "float8_e4m3fn"
    assert kv_format("vllm", "auto", "float16") == "float16"
    assert kv_format("sglang", "fp8_e5m2", "bfloat16") == "float8_e5m2"
    with pytest.raises(mm3.InputError, match="global per-tensor scale"):
        kv_format("vllm", "nvfp4", "bfloat16")
    with pytest.raises(mm3.InputError, match="MXFP4-style.*serve with --kv-cache-dtype fp8_e4m3,"):
        kv_format("sglang", "fp4_e2m1", "bfloat16")     # SGLang's own name in the advice (it has no "fp8")
    with pytest.raises(mm3.InputError, match="serve with --kv-cache-dtype fp8,"):
        kv_format("vllm", "fp4", "bfloat16")


@pytest.mark.parametrize("contiguous", [False, True])
def test_a_rank_shard_keeps_the_format_and_its_heads_block_scales(contiguous: bool) -> None:
    from mm3.runtime.distributed import rank_shard

    full = mm3.SparseAttentionParams(num_heads=8, num_kv_heads=4, head_dim=32, num_index_heads=4, index_head_dim=32,
                                     block_size=16, topk=4)
    c = make_case(full, decodes=[40], dtype="float32", kv_dtype="nvfp4", index_dtype="nvfp4", kv_layout="HND").caches
    mine = rank_shard(full, rank=1, world_size=2).slice_caches(c, contiguous=contiguous)
    assert (mine.kv_format, mine.num_kv_heads, mine.index_format) == ("nvfp4", 2, "nvfp4")
    assert torch.equal(mine.dequantized().k, c.dequantized().k[:, :, 2:4])


def test_an_unknown_format_name_is_refused_with_the_names_the_layer_takes() -> None:
    with pytest.raises(mm3.InputError, match=r"kv_dtype must be a torch.dtype .*or one of the format names "
                                             r"\['float8_e4m3fn_unscaled', 'nvfp4'\], got str 'fp4'"):
        mm3.SparseAttention(P, dtype=torch.bfloat16, kv_dtype="fp4", backend="cpu_ref")  # type: ignore[arg-type]
    with pytest.raises(mm3.InputError, match=r"index_dtype .*or one of the format names \['nvfp4'\]"):
        mm3.SparseAttention(P, dtype=torch.bfloat16, index_dtype="fp8", backend="cpu_ref")  # type: ignore[arg-type]
    with pytest.raises(mm3.InputError, match=r"dtype must be a torch.dtype \(e.g. torch.half if 'half' is a dtype "
                                             r"name\), got str"):
        mm3.SparseAttention(P, dtype="half", backend="cpu_ref")  # type: ignore[arg-type]
