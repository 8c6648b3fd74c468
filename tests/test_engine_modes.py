"""The modes engines run models in: eager and compiled steps under ``torch.inference_mode()``,
``torch.no_grad()`` and plain, with the engine's tensors made inside the mode or outside it.

vLLM and SGLang run models under ``torch.inference_mode()``; tensors made there
(inference tensors) have no version counter, so nothing of mm3 may key a memo on
one. Every step runs the production default (``check_contracts="first"``: the
first step of a kind guarded, the next plain) and is checked against the fp64
oracle; a bad page id is still reported. CUDA graphs of the same modes are in
tests/gpu/test_engine_gpu.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch

import mm3
from mm3.runtime.config import Settings
from mm3.testing.factories import make_case
from mm3.testing.oracle import oracle_attention, oracle_topk

P = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                              index_head_dim=16, block_size=16, topk=4)
STEPS = [dict(decodes=[70, 40], prefills=[(5, 30)], seed=1), dict(decodes=[33, 80], prefills=[(5, 20)], seed=2)]

MODES: dict[str, Callable[[], Any]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "plain": contextlib.nullcontext,
}


def _cases(made_inside: bool, mode: str) -> list[Any]:
    ctx = MODES[mode]() if made_inside else contextlib.nullcontext()
    with ctx:
        return [make_case(P, dtype="float32", **kw) for kw in STEPS]


def _want(case: Any) -> torch.Tensor:
    sel = oracle_topk(case.index_q, case.caches, case.batch, P)
    return oracle_attention(case.q, case.caches, sel, case.batch, P)


def _layer(backend: str) -> mm3.SparseAttention:
    return mm3.SparseAttention(P, dtype=torch.float32, max_num_tokens=16, backend=backend,
                               settings=Settings(check_contracts="first"))


@pytest.mark.parametrize("made_inside", [True, False], ids=["made-inside", "made-outside"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_steps_in_every_engine_mode_match_the_oracle(path: str, mode: str, made_inside: bool) -> None:
    if path == "compiled":
        torch._dynamo.reset()
    layer = _layer("cpu_ref")
    step = layer.forward if path == "eager" else torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    with MODES[mode]():
        for case in _cases(made_inside, mode):
            out = torch.full_like(case.q, float("nan"))
            got = step(case.q, case.index_q, case.caches, case.batch, out)
            torch.testing.assert_close(got.double(), _want(case), rtol=1e-5, atol=1e-5)
    assert layer._resolve().checked == {"mixed"}      # the first step was guarded, as in production


@pytest.mark.parametrize("backend", ["cpu_ref", "cuda"])
def test_a_bad_page_id_is_reported_under_inference_mode(backend: str) -> None:
    """cpu_ref's table lives in host memory: checked on the host, raised by the step itself; the
    Triton indexer reports it from its own loads, raised at the next step."""
    layer = _layer(backend)
    with torch.inference_mode():
        good, other = _cases(True, "inference_mode")
        layer(good.q, good.index_q, good.caches, good.batch)
        b = other.batch
        bt = b.block_table.clone()
        bt[1, 1] = other.caches.num_pages + 3
        bad = mm3.BatchMetadata.build(b.query_lens, b.seq_lens_host, bt, block_size=b.block_size,
                                      num_decodes=b.num_decodes)
        match = r"request 1, block 1: block_table\[1, 1\]"
        if backend == "cpu_ref":
            with pytest.raises(mm3.InputError, match=match):
                layer(other.q, other.index_q, other.caches, bad)
        else:
            layer(other.q, other.index_q, other.caches, bad)      # clamped, never faults
            with pytest.raises(mm3.InputError, match=match + ".*earlier step"):
                layer(good.q, good.index_q, good.caches, good.batch)
        got = layer(good.q, good.index_q, good.caches, good.batch)   # usable again
        torch.testing.assert_close(got.double(), _want(good), rtol=1e-5, atol=1e-5)
