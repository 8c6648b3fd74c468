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
    # the first step was guarded, as in production
    assert layer.op_target.guarded == {("index_topk", "mixed"), ("attention", "mixed")}


@pytest.mark.parametrize("backend", ["cpu_ref", "cuda"])
def test_a_bad_page_id_is_reported_under_inference_mode(backend: str) -> None:
    """A table in host memory is checked on the host every step, whichever backend runs: the step
    itself raises (on a GPU the Triton indexer reports it from its own loads: tests/gpu)."""
    layer = _layer(backend)
    with torch.inference_mode():
        good, other = _cases(True, "inference_mode")
        layer(good.q, good.index_q, good.caches, good.batch)
        b = other.batch
        bt = b.block_table.clone()
        bt[1, 1] = other.caches.num_pages + 3
        bad = mm3.BatchMetadata.build(b.query_lens, b.seq_lens_host, bt, block_size=b.block_size,
                                      num_decodes=b.num_decodes)
        match = r"request 1, block 1: batch.block_table\[1, 1\]"
        with pytest.raises(mm3.InputError, match=match):
            layer(other.q, other.index_q, other.caches, bad)
        got = layer(good.q, good.index_q, good.caches, good.batch)   # usable again
        torch.testing.assert_close(got.double(), _want(good), rtol=1e-5, atol=1e-5)


def test_the_triton_indexer_takes_page_faults_by_keyword() -> None:
    """The Triton hook takes ``page_faults`` with a default (direct callers of the plugin need not
    pass it); the bound backend finds it in pluggy's ``HookImpl.kwargnames`` and passes it by name."""
    from mm3.contract.hookspecs import Op
    from mm3.runtime.backend import Backend
    from mm3.runtime.registry import default_registry

    be = default_registry().get("cuda")
    impl = be._ops[Op.INDEX_TOPK]
    assert tuple(impl.argnames) == ("index_q", "caches", "batch", "params", "out")
    assert tuple(impl.kwargnames) == ("page_faults",)
    seen: list[Any] = []

    def hook(index_q: Any, caches: Any, batch: Any, params: Any, out: Any, page_faults: Any = None) -> None:
        seen.append(page_faults)
    spy = type(impl)(impl.plugin, impl.plugin_name, hook, impl.opts)
    word = torch.zeros(1, dtype=torch.int64)
    Backend(be.plugin, be.capabilities, be.source, {**be._impls, "index_topk": spy}).invoke(
        Op.INDEX_TOPK, (None, None, None, None, None, word))
    assert seen == [word]


def test_a_device_table_of_a_backend_that_does_not_report_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_ref reads ids as addresses and reports nothing: for a table in device memory the layer
    records the check itself (torch ops, no sync) and raises at the next step. CPU tensors stand in
    for device ones here."""
    import mm3.runtime.step as step

    monkeypatch.setattr(step, "on_host", lambda batch: False)
    layer = _layer("cpu_ref")
    good, other = _cases(True, "plain")
    layer(good.q, good.index_q, good.caches, good.batch)
    b = other.batch
    bt = b.block_table.clone()
    bt[0, 2] = -1
    bad = mm3.BatchMetadata.build(b.query_lens, b.seq_lens_host, bt.clamp(min=0), block_size=b.block_size,
                                  num_decodes=b.num_decodes)
    bad.block_table[0, 2] = -1      # after build (which would catch it): cpu_ref's gather accepts -1
    layer(other.q, other.index_q, other.caches, bad)
    with pytest.raises(mm3.InputError, match=r"request 0, block 2: batch.block_table\[0, 2\] .*earlier step"):
        layer(good.q, good.index_q, good.caches, good.batch)


def test_the_bound_backend_refuses_an_out_of_another_dtype() -> None:
    """Backend.attention_forward is a boundary of its own (plugins, tests and tools call it directly)."""
    from mm3.runtime.registry import default_registry

    case = make_case(P, dtype="float32", **STEPS[0])
    be = default_registry().get("cpu_ref")
    buf = be.alloc_topk_buffer(case.batch.num_tokens, P.num_kv_heads, P.topk, "cpu")
    be.index_topk(case.index_q, case.caches, case.batch, P, buf)
    out = torch.empty(case.q.shape, dtype=torch.float64)
    with pytest.raises(mm3.InputError, match="out dtype torch.float64 differs from q's torch.float32"):
        be.attention_forward(case.q, case.caches, buf, case.batch, P, out)
