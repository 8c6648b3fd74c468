"""mm3.integrations.vllm on the Triton backends (cuda, rocm) through Triton's interpreter, against the fp64 oracle.

The seed's case (token-major top-k storage behind a head-major view, a mixed
batch with a padding decode and prefills with a prefix) and speculative
decodes with fp8 scales per KV head and per (KV head, token slot), e4m3 and
e5m2 (with no scales, a scalar, per KV head and per slot), each backend pinned
with ``mm3.use_backend``. float32 / float16 run here and bf16
on the GPU (tests/gpu/test_vllm_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import mm3
from mm3 import SparseAttentionParams
from mm3.integrations import targets
from vllm_steps import assert_step_right, run_step, vllm_step

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]

P = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                          block_size=16, topk=4, init_blocks=1, local_blocks=1)


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_seed_case_on_the_triton_backends(backend: str) -> None:
    s = vllm_step(P, decodes=(70, 33), padding=1, prefills=((9, 40), (3, 3)), seed=11)
    targets.configure()
    with mm3.use_backend(backend):
        run_step(s)
    assert_step_right(s)
    used = {(x.indexer.name, x.attention.name) for x in targets.selections()}
    assert used == {(backend, backend)}, used


def test_speculative_decode_fp8_kv_on_cuda() -> None:
    with torch.inference_mode(), mm3.use_backend("cuda"):
        s = vllm_step(P, decodes=(60, 41), padding=1, prefills=((5, 50),), dql=2, dtype="float16",
                      kv_dtype="float8_e4m3fn", kv_scale="head", seed=12)
        run_step(s, max_dql=4)
    assert_step_right(s, torch.float16)


@pytest.mark.parametrize("backend, kv_dtype", [("cuda", "float8_e4m3fn"), ("rocm", "float8_e4m3fn"),
                                               ("cuda", "float8_e5m2"), ("rocm", "float8_e5m2")])
def test_slot_scaled_fp8_kv_mixed_batch_on_the_triton_backends(backend: str, kv_dtype: str) -> None:
    """vLLM's per-(KV head, token slot) scales, read by both plugins' decode and prefill attention."""
    targets.configure()
    with torch.inference_mode(), mm3.use_backend(backend):
        s = vllm_step(P, decodes=(60, 41), padding=1, prefills=((9, 40),), dtype="float16",
                      kv_dtype=kv_dtype, kv_scale="slot", seed=14)
        run_step(s)
    assert_step_right(s, torch.float16)
    used = {(x.indexer.name, x.attention.name) for x in targets.selections() if x.requirements.kv_slot_scales}
    assert used == {(backend, backend)}, used


@pytest.mark.parametrize("backend, kv_scale", [("cuda", "unit"), ("rocm", "tensor"), ("cuda", "head")])
def test_e5m2_kv_mixed_batch_on_the_triton_backends(backend: str, kv_scale: str) -> None:
    """vLLM's fp8_e5m2 KV cache: without scales (k_scale=v_scale=None), a scalar one, per KV head."""
    targets.configure()
    with torch.inference_mode(), mm3.use_backend(backend):
        s = vllm_step(P, decodes=(60, 41), padding=1, prefills=((9, 40),), dql=2, dtype="float16",
                      kv_dtype="float8_e5m2", kv_scale=kv_scale, seed=15)
        if kv_scale == "unit":
            s.k_scale = s.v_scale = None
        elif kv_scale == "tensor":     # vLLM's layer scale: one element
            s.k_scale, s.v_scale = s.k_scale[:1].clone().reshape(()), s.v_scale[:1].clone()
        run_step(s)
    assert_step_right(s, torch.float16)
    used = {(x.attention.name, x.requirements.kv_cache_dtype) for x in targets.selections()
            if x.requirements.kv_cache_dtype}
    assert used == {(backend, "float8_e5m2")}, used


def test_a_bad_page_id_is_reported_by_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton indexer reports bad block-table entries (reports_bad_page_ids): no fault, an InputError later.
    The CPU table stands in for a device one (a host table is checked on the host, every step)."""
    import mm3.runtime.step as step
    from mm3.integrations import vllm as ops

    monkeypatch.setattr(step, "on_host", lambda batch: False)
    s = vllm_step(P, decodes=(70, 33), prefills=(), seed=13)
    c, b = s.case, s.case.batch
    bad = s.block_table.clone()
    bad[1, 0] = c.caches.num_pages + 3
    targets.configure()
    with mm3.use_backend("cuda"):
        for table in (s.block_table, bad):   # the first call of a class is checked on the host, then the kernels
            ops.minimax_m3_index_decode(c.index_q, c.caches.index, table, s.seq_lens, b.max_seq_len, 4, 1, 1, 2, 1, 1)
    with pytest.raises(mm3.InputError, match=r"request 1, block 0: block_table\[1, 0\] is not a page id"):
        targets.check_page_ids()
