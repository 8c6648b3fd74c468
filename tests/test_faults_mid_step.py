"""A backend that fails in the middle of a step (docs/errors.md §6).

Three faults, planted with :class:`~mm3.testing.mock.MockBackend` around the
reference math: a hook that raises after writing half its rows (``"raise"``),
one that returns without writing (``"no_write"``), one that writes NaN
(``"nan_output"``). Each must be reported naming the backend and the hook, and
the layer must give the right answer on its next good step: nothing of the
failed step (half-written top-k rows, rows past the next step's ``T``, a
converted copy of the buffer) may reach it. cpu_ref math only, no Triton.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3 import SparseAttentionParams
from mm3.runtime.config import Settings
from mm3.contract.errors import ContractViolation, InputError, PluginError
from mm3.runtime.layer import SparseAttention
from mm3.runtime.registry import Registry
from mm3.testing.factories import Case, make_case
from mm3.testing.mock import GARBAGE, MockBackend, MockFault
from mm3.testing.oracle import oracle_attention, oracle_topk

HOOKS = ("index_topk", "attention_forward")
MODES = ("first", "always", "never")


def _params() -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                                 index_head_dim=16, block_size=16, topk=4)


def _big(seed: int = 0) -> Case:
    """A mixed step of 44 tokens: its half-written rows reach far past the next step's."""
    return make_case(_params(), decodes=[70, 40], prefills=[(40, 60), (2, 20)], padding_decodes=1,
                     dtype="float32", seed=seed)


def _small(seed: int = 1) -> Case:
    """A decode step of 3 tokens (one a padding slot), another kind of batch than :func:`_big`."""
    return make_case(_params(), decodes=[90, 33], padding_decodes=1, dtype="float32", seed=seed)


def _layer(mode: str, *plugins: Any, backend: str, indexer: str) -> SparseAttention:
    return SparseAttention(_params(), dtype=torch.float32, max_num_tokens=64, backend=backend,
                           indexer_backend=indexer, settings=Settings(check_contracts=mode),
                           registry=Registry(plugins=list(plugins), entry_points=False))


def _faulty_layer(mode: str, hook: str, fault: Optional[str], **attention_caps: Any
                  ) -> tuple[SparseAttention, MockBackend, MockBackend]:
    """A layer whose ``hook`` runs on the mock ``boom`` (with ``fault``) and whose other hook runs on ``ok``;
    ``attention_caps`` go to the one that runs the attention."""
    on_boom = attention_caps if hook == "attention_forward" else {}
    boom = MockBackend("boom", fault=fault, **on_boom)  # type: ignore[arg-type]
    ok = MockBackend("ok", **(attention_caps if not on_boom else {}))
    names = dict(indexer="boom", backend="ok") if hook == "index_topk" else dict(indexer="ok", backend="boom")
    return _layer(mode, boom, ok, **names), boom, ok


def _run(layer: SparseAttention, case: Case, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return layer(case.q, case.index_q, case.caches, case.batch, out)


def _assert_right(layer: SparseAttention, case: Case, got: torch.Tensor) -> None:
    """``got`` and the step's top-k rows are what a layer that never failed computes, and the oracle's."""
    fresh = _layer("never", cpu_ref, backend="cpu_ref", indexer="cpu_ref")
    want = _run(fresh, case)
    T = case.batch.num_tokens
    assert torch.equal(layer.topk_buffer.rows(0, T).head_major(), fresh.topk_buffer.rows(0, T).head_major())
    assert torch.allclose(got, want, rtol=0, atol=1e-6)      # a converted buffer may round differently
    exact = oracle_attention(case.q, case.caches, oracle_topk(case.index_q, case.caches, case.batch, case.params),
                             case.batch, case.params)
    assert (got.double() - exact).abs().max() < 1e-4


# -- (a) a hook that raises -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hook", HOOKS)
def test_a_raising_hook_is_named_and_the_next_step_is_right(mode: str, hook: str) -> None:
    layer, boom, ok = _faulty_layer(mode, hook, "raise")
    big = _big()
    with pytest.raises(PluginError, match=rf"^backend 'boom' \(explicit plugin .*\) failed in {hook}: "
                                          rf".*MockFault: mock backend 'boom': injected fault") as info:
        _run(layer, big)
    e = info.value
    assert (e.backend, e.hook) == ("boom", hook) and isinstance(e.__cause__, MockFault)   # type: ignore[attr-defined]
    op = "index_topk" if hook == "index_topk" else "attention"
    assert all(o != op for o, _ in layer.op_target.guarded)   # "first": the failed op is guarded again
    half = (big.batch.num_tokens + 1) // 2
    if hook == "index_topk":       # it wrote half the step's rows before raising
        assert (layer.topk_buffer.head_major()[:, :half] == GARBAGE).all()

    boom.fault = None
    small = _small()
    got = _run(layer, small)
    _assert_right(layer, small, got)
    T = small.batch.num_tokens
    seen = ok.calls_to("attention_forward")[-1].args["topk"] if hook == "index_topk" else \
        boom.calls_to("attention_forward")[-1].args["topk"]
    assert seen.num_tokens == T                               # the attention sees the new step's rows only
    if hook == "index_topk":       # rows the new step does not own keep the failed step's garbage, unread
        assert (layer.topk_buffer.head_major()[:, T:half] == GARBAGE).all()


@pytest.mark.parametrize("mode", ["first", "never"])   # guarded and plain ("always" guards as "first" here)
@pytest.mark.parametrize("hook", HOOKS)
def test_nothing_of_a_failed_step_reaches_the_next_ones_through_a_converted_copy(mode: str, hook: str) -> None:
    """The attention needs a dense token-major copy of the head-major buffer: made afresh each step, from
    the step's own rows (the failed step's copy, when it got that far, is not reused)."""
    layer, boom, ok = _faulty_layer(mode, hook, "raise", topk_layout="token_major", topk_requires_contiguous=True)
    strict = boom if hook == "attention_forward" else ok
    assert layer.selection.converts_topk
    with pytest.raises(PluginError, match=f"failed in {hook}"):
        _run(layer, _big())
    boom.fault = None
    for small in (_small(seed=1), _small(seed=2)):
        _assert_right(layer, small, _run(layer, small))
        seen = strict.calls_to("attention_forward")[-1].args["topk"]
        T = small.batch.num_tokens
        assert seen.layout == "token_major" and seen.num_tokens == T
        assert torch.equal(seen.head_major(), layer.topk_buffer.rows(0, T).head_major())


class _Raises:
    """A delegate for MockBackend: the math raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def index_topk(self, *args: Any) -> None:
        raise self.exc


def _index_through(mock: MockBackend) -> None:
    case = _small()
    _run(_layer("never", mock, cpu_ref, backend="cpu_ref", indexer=mock.capabilities.name), case)


def test_an_input_error_from_a_plugin_stays_an_input_error_and_names_backend_and_hook() -> None:
    original = InputError("index_q must be 16-byte aligned for my kernel")
    with pytest.raises(InputError, match=r"^picky\.index_topk: index_q must be 16-byte aligned") as info:
        _index_through(MockBackend("picky", delegate=_Raises(original)))
    assert not isinstance(info.value, PluginError) and info.value.__cause__ is original
    assert (info.value.backend, info.value.hook) == ("picky", "index_topk")   # type: ignore[attr-defined]

    named = InputError("picky.index_topk: index_q must be 16-byte aligned")   # already names both: as is
    with pytest.raises(InputError) as info:
        _index_through(MockBackend("picky", delegate=_Raises(named)))
    assert info.value is named


def test_out_of_memory_keeps_its_class_and_gains_a_note() -> None:
    """Engines catch OOM to shrink the step: it is not turned into a PluginError."""
    with pytest.raises(torch.OutOfMemoryError) as info:
        _index_through(MockBackend("greedy", delegate=_Raises(torch.OutOfMemoryError("out of memory"))))
    assert any("backend 'greedy'" in n and "index_topk" in n for n in getattr(info.value, "__notes__", []))


# -- (b) a hook that returns without writing, (c) NaN output ----------------------------------------

@pytest.mark.parametrize("hook, rule", [("index_topk", "topk.unwritten"),
                                        ("attention_forward", "attention.unwritten")])
def test_unwritten_rows_are_caught_on_guarded_steps_even_when_they_hold_the_right_answer(
        hook: str, rule: str) -> None:
    """The previous step left exactly the right rows and output: only the guard's fill tells."""
    layer, boom, _ = _faulty_layer("always", hook, None)
    case = _small()
    out = torch.empty_like(case.q)
    _run(layer, case, out)
    boom.fault = "no_write"
    with pytest.raises(ContractViolation, match=rf"backend 'boom'.* in {hook}: rule {rule} .*not written") as info:
        _run(layer, case, out)
    assert (info.value.backend, info.value.hook, info.value.rule) == ("boom", hook, rule)  # type: ignore[attr-defined]
    boom.fault = None
    other = _small(seed=3)
    _assert_right(layer, other, _run(layer, other))


@pytest.mark.parametrize("fault, hook, rule", [("no_write", "index_topk", "topk.unwritten"),
                                               ("no_write", "attention_forward", "attention.unwritten"),
                                               ("nan_output", "attention_forward", "attention.nonfinite")])
def test_first_mode_catches_a_fault_on_the_first_step_of_a_kind_and_checks_again_after_it(
        fault: str, hook: str, rule: str) -> None:
    layer, boom, _ = _faulty_layer("first", hook, fault)
    small = _small()
    for _ in range(2):             # a failed first step does not count as checked: the next one is guarded too
        with pytest.raises(ContractViolation, match=rf"backend 'boom'.* in {hook}: rule {rule}"):
            _run(layer, small)
        op = "index_topk" if hook == "index_topk" else "attention"
        assert (op, small.batch.kind) not in layer.op_target.guarded   # the failed op is guarded again
    boom.fault = None
    _assert_right(layer, small, _run(layer, small))
    assert layer.op_target.guarded == {("index_topk", small.batch.kind), ("attention", small.batch.kind)}


def test_steady_state_does_not_look() -> None:
    """After a clean first step of a kind, "first" runs the plain backends: a NaN written then is not caught
    (the documented limit, docs/errors.md §6); "always" catches it on any step."""
    for mode, caught in (("first", False), ("always", True)):
        layer, boom, _ = _faulty_layer(mode, "attention_forward", None)
        case = _small()
        _run(layer, case)
        boom.fault = "nan_output"
        if caught:
            with pytest.raises(ContractViolation, match="attention.nonfinite"):
                _run(layer, case)
        else:
            assert _run(layer, case).isnan().any()
