"""MockBackend: configurable declaration, call recording, delegation, and each injected fault."""

from __future__ import annotations

import pytest
import torch

import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3 import SparseAttentionParams, TopkBuffer
from mm3.contract.errors import InputError, PluginError, UnknownBackendError
from mm3.contract.topk_order import is_ascending, sorted_ascending
from mm3.runtime.registry import Registry
from mm3.testing.factories import make_case
from mm3.testing.mock import GARBAGE, FAULTS, Call, MockBackend, MockFault
from mm3.testing.oracle import check_topk, oracle_attention


def _params(H: int = 2) -> SparseAttentionParams:
    return SparseAttentionParams(num_heads=2 * H, num_kv_heads=H, head_dim=32, num_index_heads=H,
                                 index_head_dim=32, block_size=16, topk=4)


def _case(H: int = 2, seed: int = 0):  # type: ignore[no-untyped-def]
    # >= 2 decode tokens and >= 2 prefills, T = 2 + 5 + 30 = 37
    return make_case(_params(H), decodes=[100, 70], prefills=[(5, 5), (30, 120)], seed=seed)


def _bind(mock: MockBackend):  # type: ignore[no-untyped-def]
    return Registry(plugins=[mock], entry_points=False).get(mock.capabilities.name)


def test_declaration_is_configurable() -> None:
    m = MockBackend("vendor_x", topk_layout="token_major", topk_requires_contiguous=True, priority=7,
                    ops={"attention"}, dtypes={"bfloat16"}, device_types={"cpu"})
    c = m.capabilities
    assert (c.name, c.topk_layout, c.topk_requires_contiguous, c.priority) == ("vendor_x", "token_major", True, 7)
    assert c.ops == {"attention"} and c.dtypes == {"bfloat16"}
    be = _bind(m)
    assert be.provides("attention") and not be.provides("index_topk")
    with pytest.raises(InputError, match="unknown fault"):
        MockBackend(fault="segfault")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        MockBackend("bad name!")


def test_probe_availability() -> None:
    assert _bind(MockBackend()).probe("cpu").available
    be = _bind(MockBackend("off", available=False, probe_reason="driver too old"))
    p = be.probe("cpu")
    assert not p.available and p.reason == "driver too old"


def test_records_every_call_and_delegates_to_cpu_ref() -> None:
    mock = MockBackend("rec")
    be = _bind(mock)
    case = _case()
    p, T = case.params, case.batch.num_tokens
    buf = be.alloc_topk_buffer(T + 4, 2, 4, "cpu")
    be.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T))
    out = torch.empty_like(case.q)
    be.attention_forward(case.q, case.caches, buf.rows(0, T), case.batch, p, out)
    hooks = [c.hook for c in mock.calls]
    assert hooks[0] == "backend_capabilities"  # the registry asked at registration
    assert hooks.count("backend_probe") == 1    # asked once for the device, when the first call was admitted
    assert [h for h in hooks if h != "backend_probe"][-3:] == ["alloc_topk_buffer", "index_topk", "attention_forward"]
    idx = mock.calls_to("index_topk")[0]
    assert isinstance(idx, Call) and idx.args["batch"] is case.batch and idx.args["out"].num_tokens == T
    assert mock.calls_to("alloc_topk_buffer")[0].args["num_tokens"] == T + 4
    assert mock.allocated == [buf]
    assert not check_topk(buf.rows(0, T), case.index_q, case.caches, case.batch, p)
    ref = oracle_attention(case.q, case.caches, buf.rows(0, T), case.batch, p)
    assert (out.double() - ref).abs().max() < 2e-2
    mock.reset()
    assert mock.calls == [] and mock.allocated == []


def test_explicit_delegate_and_unknown_entry_point() -> None:
    calls: list[str] = []

    class Spy:
        def index_topk(self, *args: object) -> None:
            calls.append("index")
            cpu_ref.index_topk(*args)  # type: ignore[arg-type]

        def attention_forward(self, *args: object) -> None:
            calls.append("attention")
            cpu_ref.attention_forward(*args)  # type: ignore[arg-type]

    case = _case()
    be = _bind(MockBackend("spy", delegate=Spy()))
    buf = be.alloc_topk_buffer(case.batch.num_tokens, 2, 4, "cpu")
    be.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
    be.attention_forward(case.q, case.caches, buf, case.batch, case.params, torch.empty_like(case.q))
    assert calls == ["index", "attention"]
    lost = _bind(MockBackend("lost", delegate="no_such_backend"))
    with pytest.raises(UnknownBackendError, match="no_such_backend"):
        lost.index_topk(case.index_q, case.caches, case.batch, case.params, buf)


def test_contiguous_declaration_is_enforced_by_the_bound_backend() -> None:
    case = _case()
    T = case.batch.num_tokens
    mock = MockBackend("tm", topk_layout="token_major", topk_requires_contiguous=True)
    strict = _bind(mock)
    head_major = TopkBuffer.allocate(T, 2, 4, "head_major")
    with pytest.raises(InputError, match="to_layout"):
        strict.index_topk(case.index_q, case.caches, case.batch, case.params, head_major)
    assert not mock.calls_to("index_topk")                  # refused before the plugin ran
    converted = head_major.to_layout("token_major")
    strict.index_topk(case.index_q, case.caches, case.batch, case.params, converted)
    assert len(mock.calls_to("index_topk")) == 1
    assert not check_topk(converted, case.index_q, case.caches, case.batch, case.params)


def test_delegate_that_needs_its_own_layout_gets_it() -> None:
    """A mock may delegate to a strict backend: it converts the buffer for it."""
    inner = MockBackend("inner_tm", topk_layout="token_major", topk_requires_contiguous=True)
    outer = _bind(MockBackend("outer_hm", delegate=inner))
    case = _case()
    T = case.batch.num_tokens
    buf = outer.alloc_topk_buffer(T + 2, 2, 4, "cpu")
    outer.index_topk(case.index_q, case.caches, case.batch, case.params, buf.rows(0, T))
    assert not check_topk(buf.rows(0, T), case.index_q, case.caches, case.batch, case.params)
    out = torch.empty_like(case.q)
    outer.attention_forward(case.q, case.caches, buf.rows(0, T), case.batch, case.params, out)
    for hook, arg in (("index_topk", "out"), ("attention_forward", "topk")):
        given = inner.calls_to(hook)[0].args[arg]
        assert given.layout == "token_major" and given.is_dense(), hook


# -- faults ---------------------------------------------------------------------------------------


def test_fault_raise() -> None:
    be = _bind(MockBackend("boom", fault="raise"))
    case = _case()
    T = case.batch.num_tokens
    buf = be.alloc_topk_buffer(T, 2, 4, "cpu").fill_(-1)
    out = torch.zeros_like(case.q)
    with pytest.raises(PluginError, match="failed in index_topk") as info:      # the bound backend names it
        be.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
    assert isinstance(info.value.__cause__, MockFault)
    with pytest.raises(PluginError, match="failed in attention_forward"):
        be.attention_forward(case.q, case.caches, buf, case.batch, case.params, out)
    half = (T + 1) // 2                                              # each wrote half its rows, then raised
    assert (buf.head_major()[:, :half] == GARBAGE).all() and (buf.head_major()[:, half:] == -1).all()
    assert (out[:half] == GARBAGE).all() and (out[half:] == 0).all()


def test_fault_no_write() -> None:
    be = _bind(MockBackend("lazy", fault="no_write"))
    case = _case()
    buf = be.alloc_topk_buffer(case.batch.num_tokens, 2, 4, "cpu").fill_(7)
    out = torch.full_like(case.q, 3.0)
    be.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
    be.attention_forward(case.q, case.caches, buf, case.batch, case.params, out)
    assert (buf.storage == 7).all() and (out == 3.0).all()


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_fault_wrong_layout_is_harmless_with_one_head_and_refused_with_two(layout: str) -> None:
    # one head: both layouts are one memory map, the mislabelled buffer is legal and rows come out right
    be = _bind(MockBackend(f"wl_1", topk_layout=layout, fault="wrong_layout"))
    case = _case(1)
    T = case.batch.num_tokens
    full = be.alloc_topk_buffer(T + 5, 1, 4, "cpu")
    assert full.layout == layout
    full.fill_(-7)
    be.index_topk(case.index_q, case.caches, case.batch, case.params, full.rows(0, T))
    assert not check_topk(full.rows(0, T), case.index_q, case.caches, case.batch, case.params)
    # two heads: the storage contradicts the label, so the buffer is never built
    be = _bind(MockBackend(f"wl_2", topk_layout=layout, fault="wrong_layout"))
    with pytest.raises(PluginError, match=f"as {layout!r} storage") as info:
        be.alloc_topk_buffer(T + 5, 2, 4, "cpu")
    assert isinstance(info.value.__cause__, InputError)


def test_fault_wrong_layout_writer_scrambles_a_buffer_of_the_other_layout() -> None:
    """The writer half of the fault: given an honest buffer in the other layout, rows land on other tokens."""
    be = _bind(MockBackend("wl_w", topk_layout="token_major", fault="wrong_layout"))
    case = _case(2)
    T = case.batch.num_tokens
    buf = TopkBuffer.allocate(T, 2, 4, "head_major")
    be.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
    assert check_topk(buf, case.index_q, case.caches, case.batch, case.params)


def test_fault_out_of_range() -> None:
    be = _bind(MockBackend("oor", fault="out_of_range"))
    case = _case()
    T = case.batch.num_tokens
    buf = be.alloc_topk_buffer(T, 2, 4, "cpu")
    be.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
    nb0 = int(case.batch.token_positions[0]) // 16 + 1
    assert int(buf.head_major()[0, 0, 0]) == nb0
    errors = check_topk(buf, case.index_q, case.caches, case.batch, case.params)
    assert [(e.head, e.token) for e in errors] == [(0, 0)]


def test_fault_write_past_rows() -> None:
    mock = MockBackend("past", fault="write_past_rows")
    be = _bind(mock)
    case = _case()
    T = case.batch.num_tokens
    full = be.alloc_topk_buffer(T + 3, 2, 4, "cpu").fill_(123)
    be.index_topk(case.index_q, case.caches, case.batch, case.params, full.rows(0, T))
    assert (full.head_major()[:, T:] == 0).all()
    assert not check_topk(full.rows(0, T), case.index_q, case.caches, case.batch, case.params)


def test_fault_nan_output() -> None:
    be = _bind(MockBackend("nan", fault="nan_output"))
    case = _case()
    T = case.batch.num_tokens
    buf = be.alloc_topk_buffer(T, 2, 4, "cpu")
    be.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
    out = torch.zeros(T + 1, *case.q.shape[1:], dtype=case.q.dtype)
    be.attention_forward(case.q, case.caches, buf, case.batch, case.params, out[:T])
    assert out[T - 1].isnan().all() and not out[: T - 1].isnan().any() and (out[T] == 0).all()


def test_fault_unordered_keeps_the_delegates_score_order() -> None:
    """Declared ascending, the mock sorts its delegate's rows; with fault="unordered" it leaves them as ranked."""
    case = _case(2)
    T = case.batch.num_tokens
    rows = {}
    for fault in (None, "unordered"):
        be = _bind(MockBackend(f"m_{fault}", topk_order="ascending", fault=fault))
        buf = TopkBuffer.allocate(T, 2, 4, "head_major")
        be.index_topk(case.index_q, case.caches, case.batch, case.params, buf)
        rows[fault] = buf.head_major()
    assert is_ascending(rows[None]).all() and not is_ascending(rows["unordered"]).all()
    assert torch.equal(rows[None], sorted_ascending(TopkBuffer(rows["unordered"])).storage)   # the same ids


def test_every_fault_is_covered() -> None:
    assert set(FAULTS) == {"raise", "no_write", "wrong_layout", "out_of_range", "write_past_rows", "nan_output",
                           "unordered"}


def test_registry_rejects_nothing_about_the_mock() -> None:
    reg = Registry(plugins=[MockBackend("a"), MockBackend("b", topk_layout="token_major")], entry_points=False)
    assert sorted(reg.names()) == ["a", "b"] and not reg.problems()
    with pytest.raises(PluginError):
        reg.register(MockBackend("a"))
