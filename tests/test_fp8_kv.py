"""fp8 (e4m3, e5m2) K/V caches with scales: the contract, selection, the reference backend and the layer.

Each fp8 format is declared on its own (``kv_cache_dtypes``): a backend that reads e4m3 only is
passed over for e5m2, with the reason. The Triton kernels' fp8 paths run in
tests/test_fp8_kv_interpreter.py (CPU) and tests/gpu (H200).
"""

from __future__ import annotations

import pytest
import torch

import mm3
from mm3.contract.buffers import PagedKVCache
from mm3.contract.errors import InputError, NoBackendError
from mm3.runtime.distributed import rank_shard
from mm3.runtime.registry import Registry
from mm3.testing.factories import full_range_fp8, make_case
from mm3.testing.mock import MockBackend
from mm3.testing.oracle import oracle_attention, oracle_topk
from mm3_backends.cpu_ref import attention as cpu_attention
from mm3_backends.cpu_ref import plugin as cpu_ref

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = ["float8_e4m3fn", "float8_e5m2"]
PLAIN = {"bfloat16", "float16", "float32"}  # what a backend written before fp8 K/V declares (the default)
E4M3_ONLY = PLAIN | {"float8_e4m3fn"}       # what a backend written before e5m2 declares


def _params(h: int = 2, g: int = 2) -> mm3.SparseAttentionParams:
    return mm3.SparseAttentionParams(num_heads=h * g, num_kv_heads=h, head_dim=32, num_index_heads=h,
                                     index_head_dim=32, block_size=16, topk=4)


def _fp8_pair(h: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = torch.zeros(3, 16, h, 32, dtype=FP8)
    return k, k.clone(), torch.zeros(3, 16, 32)


# -- the contract ---------------------------------------------------------------------------------

@pytest.mark.parametrize("k_scale, match", [
    (None, "need k_scale and v_scale"),
    (torch.tensor([0.5, 0.5], dtype=torch.bfloat16), r"bfloat16; scales are float32"),
    (torch.ones(3), r"shape \(3,\); use \[\] or \[1\]"),
    (torch.ones(1, 2), r"shape \(1, 2\)"),
    (torch.tensor([0.5, 0.0]), r"finite and > 0 .* got \[0.5, 0.0\]"),
    (torch.tensor(float("nan")), "finite and > 0"),
    (-1.0, "finite and > 0"),
    (True, "must be a positive number or a float32 tensor"),
    (torch.ones(2, device="meta"), "is on meta but the K/V caches are on cpu"),
])
def test_bad_scales_are_input_errors(k_scale: object, match: str) -> None:
    k, v, index = _fp8_pair()
    with pytest.raises(InputError, match=match):
        PagedKVCache(k, v, index, k_scale, 1.0)


def test_scales_belong_to_fp8_caches_only() -> None:
    k, v, index = _fp8_pair()
    with pytest.raises(InputError, match="k_scale given for a torch.bfloat16 K/V cache"):
        PagedKVCache(k.to(torch.bfloat16), v.to(torch.bfloat16), index, k_scale=0.5)
    fnuz = torch.float8_e5m2fnuz      # an fp8 flavour vLLM's ops take and mm3 does not read
    with pytest.raises(InputError, match="float8_e5m2fnuz unsupported; fp8 K/V caches are torch.float8_e4m3fn "
                                         "or torch.float8_e5m2"):
        PagedKVCache(k.to(fnuz), v.to(fnuz), index, 1.0, 1.0)


def test_scales_are_head_views_of_what_was_given() -> None:
    """A per-tensor scale is expanded without a copy: an in-place recalibration reaches every reader."""
    k, v, index = _fp8_pair()
    per_tensor, per_head = torch.tensor([0.5]), torch.tensor([0.25, 2.0])
    c = PagedKVCache(k, v, index, per_tensor, per_head)
    assert c.kv_scaled and c.k_scale.shape == (2,) and c.k_scale.stride() == (0,)
    per_tensor.fill_(0.125)
    assert c.k_scale.tolist() == [0.125, 0.125] and c.v_scale.data_ptr() == per_head.data_ptr()
    moved = c.to_layout("HND")
    assert moved.kv_layout == "HND" and moved.v_scale.tolist() == [0.25, 2.0]
    assert not PagedKVCache(k.float(), v.float(), index).kv_scaled


def test_dequantized_applies_each_heads_scale() -> None:
    k, v, index = _fp8_pair()
    k[:, :, 0], k[:, :, 1] = 2.0, 3.0
    c = PagedKVCache(k, v, index, torch.tensor([0.5, 4.0]), 1.0)
    d = c.dequantized(torch.float64)
    assert d.k[..., 0, :].unique().tolist() == [1.0] and d.k[..., 1, :].unique().tolist() == [12.0]
    assert d.dtype == torch.float64 and not d.kv_scaled


def test_fp8_kv_needs_no_q_in_fp8_but_other_mismatches_fail() -> None:
    p = _params()
    case = make_case(p, decodes=[40], dtype="float32", kv_dtype="float8_e4m3fn")
    be = Registry([cpu_ref], entry_points=False).get("cpu_ref")
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    be.attention_forward(case.q, case.caches, sel, case.batch, p, torch.empty_like(case.q))   # fine
    c = case.caches.dequantized(torch.float16)
    with pytest.raises(InputError, match="KV cache dtype torch.float16 differs from q's torch.float32"):
        be.attention_forward(case.q, c, sel, case.batch, p, torch.empty_like(case.q))


# -- selection ------------------------------------------------------------------------------------

@pytest.mark.parametrize("declared, kv_dtype, reason", [
    (PLAIN, FP8, "['bfloat16', 'float16', 'float32'] (cannot read fp8 K/V with scales)"),
    # the fp8 formats are declared one by one: e4m3 does not imply e5m2, and the trace says which it reads
    (E4M3_ONLY, E5M2, "['bfloat16', 'float16', 'float32', 'float8_e4m3fn'] (cannot read float8_e5m2 K/V: of fp8 "
                      "formats it reads float8_e4m3fn only)"),
], ids=["plain-e4m3", "e4m3_only-e5m2"])
def test_selection_explains_a_backend_that_cannot_read_fp8_kv(declared: set[str], kv_dtype: torch.dtype,
                                                              reason: str) -> None:
    plain = MockBackend("plain_attn", ops={"attention", "index_topk"}, topk_layout="head_major", priority=5,
                        kv_cache_dtypes=declared)
    reg = Registry([plain, cpu_ref], entry_points=False)
    name = str(kv_dtype).removeprefix("torch.")
    if "float8_e4m3fn" in declared:     # for the fp8 format it reads, it is chosen
        assert mm3.SparseAttention(_params(), dtype=torch.float32, kv_dtype=FP8, max_num_tokens=16,
                                   registry=reg).selection.attention.name == "plain_attn"
    layer = mm3.SparseAttention(_params(), dtype=torch.float32, kv_dtype=kv_dtype, max_num_tokens=16, registry=reg)
    assert layer.selection.attention.name == "cpu_ref"
    text = layer.explain()
    assert f"KV cache {name}" in text
    assert f"plain_attn  rejected: KV cache dtype {name} not in {reason}" in text
    with pytest.raises(mm3.BackendUnavailableError, match=f"KV cache dtype {name} not in"):
        mm3.SparseAttention(_params(), dtype=torch.float32, kv_dtype=kv_dtype, registry=reg, backend="plain_attn")
    with pytest.raises(NoBackendError, match=f"plain_attn: KV cache dtype {name}"):
        mm3.SparseAttention(_params(), dtype=torch.float32, kv_dtype=kv_dtype, registry=Registry([plain],
                                                                                                 entry_points=False))


@pytest.mark.parametrize("declared, kv_dtype", [(PLAIN, "float8_e4m3fn"), (E4M3_ONLY, "float8_e5m2")])
def test_bound_backend_refuses_fp8_kv_outside_its_declaration(declared: set[str], kv_dtype: str) -> None:
    plain = MockBackend("plain_attn", ops={"attention"}, topk_layout="head_major", kv_cache_dtypes=declared)
    be = Registry([plain], entry_points=False).get("plain_attn")
    p = _params()
    case = make_case(p, decodes=[40], dtype="float32", kv_dtype=kv_dtype)
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    with pytest.raises(InputError, match=f"plain_attn.attention_forward: KV cache dtype {kv_dtype} not in"):
        be.attention_forward(case.q, case.caches, sel, case.batch, p, torch.empty_like(case.q))


# -- the reference backend and the layer ----------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("strategy", ["gather", "dense"])
@pytest.mark.parametrize("kv_scale, layout", [("head", "NHD"), ("tensor", "HND"), ("slot", "NHD"), ("slot", "HND")])
def test_cpu_ref_matches_the_oracle_on_the_dequantized_cache(strategy: str, kv_scale: str, layout: str,
                                                             kv_dtype: str) -> None:
    p = _params(h=2, g=3)
    case = make_case(p, decodes=[70, 33], prefills=[(9, 60), (3, 3)], padding_decodes=1, decode_query_len=2,
                     dtype="float32", kv_dtype=kv_dtype, kv_scale=kv_scale, kv_layout=layout, seed=5)
    sel = oracle_topk(case.index_q, case.caches, case.batch, p)
    out = torch.full_like(case.q, float("nan"))
    cpu_attention.attention_forward(case.q, case.caches, sel, case.batch, p, out, strategy=strategy)
    ref = oracle_attention(case.q, case.caches, sel, case.batch, p)
    assert (out.double() - ref).abs().max() < 1e-5
    # the oracle's input is the dequantized cache: same answer, and far from the unscaled one
    deq = oracle_attention(case.q, case.caches.dequantized(torch.float64), sel, case.batch, p)
    assert torch.equal(ref, deq)
    raw = PagedKVCache(case.caches.k.float(), case.caches.v.float(), case.caches.index)
    assert (oracle_attention(case.q, raw, sel, case.batch, p) - ref).abs().max() > 1.0


@pytest.mark.parametrize("kv_dtype, kv_scale", [(FP8, "head"), (E5M2, "head"), (E5M2, "tensor"), (E5M2, "unit")],
                         ids=["e4m3-head", "e5m2-head", "e5m2-tensor", "e5m2-unit"])
def test_layer_end_to_end_with_fp8_index_and_fp8_kv(kv_dtype: torch.dtype, kv_scale: str) -> None:
    """Through mm3.SparseAttention: scales per KV head, one per tensor, and 1.0 (values stored as they are)."""
    p = _params()
    case = make_case(p, decodes=[90, 40], prefills=[(12, 80)], decode_query_len=2, dtype="float32",
                     index_dtype="float8_e4m3fn", kv_dtype=kv_dtype, kv_scale=kv_scale, seed=9)
    layer = mm3.SparseAttention(p, dtype=torch.float32, index_dtype=FP8, kv_dtype=kv_dtype, max_num_tokens=32,
                                max_decode_query_len=2, backend="cpu_ref")
    out = layer(case.q, case.index_q, case.caches, case.batch)
    sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
    assert (out.double() - oracle_attention(case.q, case.caches, sel, case.batch, p)).abs().max() < 1e-5
    with pytest.raises(InputError, match="k/v cache is torch.float32 but this layer was built for .*float8"):
        layer(case.q, case.index_q, case.caches.dequantized(torch.float32), case.batch)
    other = E5M2 if kv_dtype == FP8 else FP8      # the other fp8 format is another dtype, not the same cache
    with pytest.raises(InputError, match=f"k/v cache is {other} but this layer was built for {kv_dtype}"):
        layer(case.q, case.index_q, PagedKVCache(case.caches.k.to(other), case.caches.v.to(other),
                                                 case.caches.index, case.caches.k_scale, case.caches.v_scale),
              case.batch)


@pytest.mark.parametrize("kv_dtype", [FP8, E5M2], ids=["e4m3", "e5m2"])
def test_stored_values_across_the_whole_fp8_range(kv_dtype: torch.dtype) -> None:
    """Stored values up to the format's largest (e4m3: 448; e5m2: 57344, past e4m3's range) read back
    exactly, scaled, by the reference and the oracle (the Triton kernels: tests/test_fp8_kv_interpreter.py,
    tests/gpu)."""
    p = _params(h=2, g=3)
    case = make_case(p, decodes=[70, 33], prefills=[(9, 60)], dtype="float32", kv_dtype=kv_dtype, seed=6)
    caches = full_range_fp8(case.caches, torch.Generator().manual_seed(6))
    assert caches.k.float().abs().max() == torch.finfo(kv_dtype).max and torch.isfinite(caches.v.float()).all()
    if kv_dtype == E5M2:
        assert (caches.k.float().abs() > torch.finfo(FP8).max).float().mean() > 0.5   # mostly past e4m3's 448
    assert torch.equal(caches.dequantized(torch.float64).k, caches.k.double() * caches.k_scale[0].item())
    sel = oracle_topk(case.index_q, caches, case.batch, p)
    out = torch.full_like(case.q, float("nan"))
    cpu_attention.attention_forward(case.q, caches, sel, case.batch, p, out)
    assert (out.double() - oracle_attention(case.q, caches, sel, case.batch, p)).abs().max() < 1e-5


def test_tensor_parallel_shard_keeps_its_heads_scales() -> None:
    full = mm3.SparseAttentionParams(num_heads=8, num_kv_heads=4, head_dim=32, num_index_heads=4,
                                     index_head_dim=32, block_size=16, topk=4)
    case = make_case(full, decodes=[40], dtype="float32", kv_dtype="float8_e4m3fn", kv_scale="head")
    shard = rank_shard(full, rank=1, world_size=2)
    for contiguous in (False, True):
        local = shard.slice_caches(case.caches, contiguous=contiguous)
        assert local.k_scale.tolist() == case.caches.k_scale[2:].tolist()
        assert torch.equal(local.dequantized().v, case.caches.dequantized().v[:, :, 2:])


def test_conformance_skips_fp8_kv_cases_a_backend_does_not_declare() -> None:
    from mm3.testing.conformance.suite import plan_cases

    plain = Registry([MockBackend("plain_attn", ops={"attention"}, topk_layout="head_major", kv_cache_dtypes=PLAIN)],
                     entry_points=False).get("plain_attn")
    plan = {c.name: c for c in plan_cases(plain, dtypes=["float32"], index_dtypes=["bfloat16"])}
    fp8 = [c for n, c in plan.items() if "kv_fp8" in n]
    assert fp8 and all("KV cache dtype float8_e4m3fn not in" in c.skip for c in fp8)
    ref = plan_cases(Registry([cpu_ref], entry_points=False).get("cpu_ref"), dtypes=["float32"],
                     index_dtypes=["bfloat16"])
    results = [c.run() for c in ref if "kv_fp8" in c.name]
    assert len(results) == 4 and all(r.status == "pass" for r in results), [r.message for r in results]


def test_conformance_runs_e5m2_cases_only_on_backends_that_declare_e5m2() -> None:
    from mm3.testing.conformance.suite import plan_cases

    e4m3 = Registry([MockBackend("e4m3_only", ops={"attention"}, topk_layout="head_major",
                                 kv_cache_dtypes=E4M3_ONLY)], entry_points=False).get("e4m3_only")
    plan = {c.name: c for c in plan_cases(e4m3, dtypes=["float32"], index_dtypes=["bfloat16"])}
    e5m2 = [c for n, c in plan.items() if "kv_e5m2" in n]
    assert e5m2 and all("cannot read float8_e5m2 K/V: of fp8 formats it reads float8_e4m3fn only" in c.skip
                        for c in e5m2)
    assert not any(c.skip for n, c in plan.items() if "kv_fp8" in n)
    ref = plan_cases(Registry([cpu_ref], entry_points=False).get("cpu_ref"), dtypes=["float32"],
                     index_dtypes=["bfloat16"])
    results = [c.run() for c in ref if "kv_e5m2" in c.name]
    assert len(results) == 4 and all(r.status == "pass" for r in results), [r.message for r in results]
