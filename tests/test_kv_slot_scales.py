"""fp8 K/V scales per (KV head, token slot), vLLM's ``[num_kv_heads, num_slots]``: the contract and selection.

For both fp8 formats (e4m3, e5m2). cpu_ref and the oracle read them
(tests/test_fp8_kv.py, the conformance cases ``attention/kv_fp8_slot_*`` and
``attention/kv_e5m2_slot_*``), and so do the Triton backends
(tests/test_vllm_interpreter.py); selection must say why it passes over a
backend that does not (tests/test_vllm_dropin.py).
"""

from __future__ import annotations

import pytest
import torch

import mm3
from mm3.contract.buffers import PagedKVCache
from mm3.contract.errors import InputError
from mm3.runtime.distributed import rank_shard
from mm3.runtime.registry import Registry
from mm3.runtime.selection import requirements_for, select
from mm3.testing.factories import make_case
from mm3.testing.mock import MockBackend

FP8 = torch.float8_e4m3fn
P = mm3.SparseAttentionParams(num_heads=8, num_kv_heads=4, head_dim=32, num_index_heads=4, index_head_dim=32,
                              block_size=16, topk=4)


def _kv(layout: str = "NHD", pages: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = PagedKVCache.allocate(pages, 16, 2, 8, 8, dtype=FP8, layout=layout)
    c.k.copy_(torch.randn(c.k.shape).to(FP8))
    c.v.copy_(torch.randn(c.v.shape).to(FP8))
    return c.k, c.v, c.index


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_slot_scale_is_kept_as_given_and_dequantizes_its_slot(layout: str) -> None:
    k, v, index = _kv(layout)
    ks, vs = torch.rand(2, 48) + 0.5, torch.rand(2, 48) + 0.5
    c = PagedKVCache(k, v, index, ks, vs)
    assert c.slot_scaled and c.kv_scaled and c.k_scale.data_ptr() == ks.data_ptr()
    d = c.dequantized(torch.float64)
    for p_, b, h in ((0, 0, 0), (1, 5, 1), (2, 15, 0), (2, 3, 1)):   # slot = page * block_size + offset
        assert torch.equal(d.k[p_, b, h], k[p_, b, h].double() * ks[h, p_ * 16 + b].double())
        assert torch.equal(d.v[p_, b, h], v[p_, b, h].double() * vs[h, p_ * 16 + b].double())


def test_slot_scales_are_cache_contents_not_checked_for_values() -> None:
    k, v, index = _kv()
    zeros = torch.zeros(2, 48)       # a slot not written yet holds anything
    assert PagedKVCache(k, v, index, zeros, zeros.clone()).slot_scaled
    with pytest.raises(InputError, match="must be finite and > 0"):
        PagedKVCache(k, v, index, torch.zeros(2), torch.ones(2))     # a per-head scale is calibration: checked


@pytest.mark.parametrize("k_scale, v_scale, match", [
    (torch.ones(2, 47), torch.ones(2, 47), r"\[2, 48\] \(one per KV head and token slot"),
    (torch.ones(3, 48), torch.ones(3, 48), "has shape"),
    (torch.ones(2, 48), torch.ones(2), "must be given for both K and V, or for neither"),
    (torch.ones(2, 48, dtype=torch.float16), torch.ones(2, 48), "scales are float32"),
])
def test_bad_slot_scales_are_input_errors(k_scale: torch.Tensor, v_scale: torch.Tensor, match: str) -> None:
    k, v, index = _kv()
    with pytest.raises(InputError, match=match):
        PagedKVCache(k, v, index, k_scale, v_scale)


def test_capabilities_say_who_cannot_read_them() -> None:
    req = requirements_for(P, torch.float32, torch.bfloat16, "cpu", kv_dtype=FP8, kv_slot_scales=True)
    plain = mm3.plugin.BackendCapabilities(name="plain", ops={"index_topk", "attention"}, device_types={"cpu"},
                                    topk_layout="head_major", kv_cache_dtypes={"float32", "float8_e4m3fn"})
    assert plain.unmet(req) == ["cannot read K/V scales per token slot (k_scale/v_scale [Hkv, num_slots]): it "
                                "does not declare kv_slot_scales"]
    assert plain.unmet(req.for_ops("index_topk")) == []          # an indexer never reads K/V
    assert plain.model_copy(update={"kv_slot_scales": True}).unmet(req) == []
    # the bound backend's boundary applies the same rule to a call
    be = Registry([MockBackend("plain", kv_slot_scales=False)], entry_points=False).get("plain")
    case = make_case(P, decodes=[40], dtype="float32", kv_dtype="float8_e4m3fn", seed=0)
    c = case.caches
    slots = c.num_pages * c.block_size
    scaled = PagedKVCache(c.k, c.v, c.index, torch.ones(P.num_kv_heads, slots), torch.ones(P.num_kv_heads, slots))
    topk = mm3.TopkBuffer.allocate(case.batch.num_tokens, P.num_kv_heads, P.topk)
    with pytest.raises(InputError, match="plain.attention_forward: .*cannot read K/V scales per token slot"):
        be.attention_forward(case.q, scaled, topk, case.batch, P, torch.empty_like(case.q))


def test_selection_passes_over_a_backend_that_cannot_read_them() -> None:
    plain = MockBackend("plain_attn", priority=5, kv_slot_scales=False)
    reg = Registry([plain, MockBackend("slots", kv_slot_scales=True)], entry_points=False)
    req = requirements_for(P, torch.float32, torch.bfloat16, "cpu", kv_dtype=FP8, kv_slot_scales=True)
    sel = select(req, reg, device="cpu")
    assert sel.attention.name == "slots"
    assert "plain_attn  rejected: cannot read K/V scales per token slot" in sel.explain()
    assert "with scales per token slot" in sel.explain()


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_the_layer_refuses_caches_it_did_not_select_for(kv_dtype: torch.dtype) -> None:
    case = make_case(P, decodes=[40], dtype="float32", kv_dtype=kv_dtype, kv_scale="slot")
    layer = mm3.SparseAttention(P, dtype=torch.float32, kv_dtype=kv_dtype, max_num_tokens=4, backend="cpu_ref")
    with pytest.raises(InputError, match="which SparseAttention does not select backends for"):
        layer(case.q, case.index_q, case.caches, case.batch)


def test_a_tensor_parallel_shard_keeps_its_heads_slot_scales() -> None:
    case = make_case(P, decodes=[40], dtype="float32", kv_dtype="float8_e4m3fn", kv_scale="slot")
    local = rank_shard(P, rank=1, world_size=2).slice_caches(case.caches)
    assert local.slot_scaled and torch.equal(local.k_scale, case.caches.k_scale[2:])
    assert torch.equal(local.dequantized().v, case.caches.dequantized().v[:, :, 2:])


def test_conformance_skips_only_the_slot_cases_of_a_backend_without_them() -> None:
    from mm3.testing.conformance.suite import plan_cases

    be = Registry([MockBackend("heads_only", kv_slot_scales=False)], entry_points=False).get("heads_only")
    plan = plan_cases(be, dtypes=["float32"], index_dtypes=["bfloat16"])
    slot = [c for c in plan if "kv_fp8_slot" in c.name]
    assert slot and all("cannot read K/V scales per token slot" in c.skip for c in slot)
    assert not any(c.skip for c in plan if "kv_fp8" in c.name and c not in slot)
