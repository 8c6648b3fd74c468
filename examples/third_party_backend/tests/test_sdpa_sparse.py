"""The tests a backend vendor keeps next to their plugin.

They use mm3's pytest fixtures (``mm3_registry``, ``mm3_case``,
``mm3_conformance``...), which ``conftest.py`` loads. Run them with ``pytest``
after ``pip install -e examples/third_party_backend``.
"""

from __future__ import annotations

import pytest
import torch

from mm3 import InputError, SparseAttention, TopkBuffer
from mm3.testing.oracle import oracle_attention, oracle_topk

import mm3_sdpa_sparse.attention as attention
import mm3_sdpa_sparse.plugin as plugin

NAME = "torch_sdpa_sparse"


def test_passes_mm3_conformance(mm3_registry, mm3_conformance):
    backend = mm3_registry(plugin).get(NAME)
    report = mm3_conformance(backend, dtypes=["float32", "bfloat16"])
    assert any(r.name.startswith("attention/") and r.passed for r in report)


def test_composes_with_another_backends_indexer(mm3_registry, mm3_params, mm3_case):
    mm3_registry(plugin, installed=["cpu_ref"])          # isolated, and the default for this test
    layer = SparseAttention(mm3_params, dtype=torch.float32, max_num_tokens=64, backend=NAME)
    case = mm3_case(mm3_params)
    out = layer(case.q, case.index_q, case.caches, case.batch)

    sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
    ref = oracle_attention(case.q, case.caches, sel, case.batch, mm3_params)
    assert (out.double() - ref).abs().max() < 1e-5
    assert layer.selection.indexer.name == "cpu_ref"
    assert "token_major" in layer.selection.topk_conversion   # cpu_ref writes head-major


@pytest.mark.parametrize("strategy", ["gather", "dense"])
def test_both_formulations_match_the_oracle(mm3_params, mm3_case, strategy):
    case = mm3_case(mm3_params, decodes=(90, 17), prefills=((12, 100), (30, 30)), decode_query_len=2)
    sel = oracle_topk(case.index_q, case.caches, case.batch, mm3_params)
    out = torch.full_like(case.q, float("nan"))
    attention.attention_forward(case.q, case.caches, sel.to_layout("token_major"), case.batch,
                                mm3_params, out, strategy=strategy, max_elements=4096)
    ref = oracle_attention(case.q, case.caches, sel, case.batch, mm3_params)
    assert (out.double() - ref).abs().max() < 1e-5


def test_garbage_in_unwritten_cache_slots_does_not_leak(mm3_params, mm3_case):
    case = mm3_case(mm3_params)
    sel = oracle_topk(case.index_q, case.caches, case.batch, mm3_params)
    # Slots past each request's seq_len were never written by the engine: make them NaN.
    B = mm3_params.block_size
    for r, seq in enumerate(case.batch.seq_lens_host):
        if seq % B:
            page = int(case.batch.block_table[r, seq // B])
            case.caches.k[page, seq % B:] = float("nan")
            case.caches.v[page, seq % B:] = float("nan")
    out = torch.empty_like(case.q)
    plugin.attention_forward(case.q, case.caches, sel.to_layout("token_major"), case.batch, mm3_params, out)
    assert not out.isnan().any()
    padding = case.batch.token_positions < 0
    assert padding.any() and (out[padding] == 0).all()


def test_mm3_refuses_it_a_buffer_it_would_misread(mm3_registry, mm3_params, mm3_case):
    """The declaration is enough: mm3's bound backend checks the layout before our hook runs."""
    backend = mm3_registry(plugin).get(NAME)
    case = mm3_case(mm3_params)
    T = case.batch.num_tokens
    head_major = TopkBuffer.allocate(T, mm3_params.num_kv_heads, mm3_params.topk, "head_major")
    with pytest.raises(InputError, match="to_layout"):
        backend.attention_forward(case.q, case.caches, head_major, case.batch, mm3_params,
                                  torch.empty_like(case.q))
