"""Selection: rules, fallback, trace content, top-k conversion, requirements."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from plugin_fakes import FakeEntryPoint
import torch

from mm3.plugin import BackendCapabilities, Probe, SparseAttentionParams, hookimpl
from mm3.contract.errors import (
    BackendUnavailableError,
    InputError,
    NoBackendError,
    PluginError,
    UnknownBackendError,
)
from mm3.runtime.registry import Registry
from mm3.runtime.selection import Selection, requirements_for, select


class Fake:
    """A configurable fake backend plugin."""

    def __init__(self, name: str, *, priority: int = 0, ops=("index_topk", "attention"),
                 layout: str = "head_major", contiguous: bool = False, available: bool = True,
                 why: str = "", **kw: Any) -> None:
        self._caps = BackendCapabilities(name=name, priority=priority, ops=set(ops),
                                         device_types=kw.pop("device_types", {"cpu"}),
                                         topk_layout=layout, topk_requires_contiguous=contiguous, **kw)
        self._available = available
        self._why = why or f"{name} is not installed here"

    @hookimpl
    def backend_capabilities(self):
        return self._caps

    @hookimpl
    def backend_probe(self, device):
        return Probe.yes(f"{self._caps.name} ready") if self._available else Probe.no(self._why)

    @hookimpl
    def index_topk(self, index_q, caches, batch, params, out):
        pass

    @hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):
        pass


class AttentionOnly(Fake):
    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, ops=("attention",), **kw)


class IndexerOnly(Fake):
    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, ops=("index_topk",), **kw)


def make_registry(*plugins: Any) -> Registry:
    return Registry(list(plugins), entry_points=False)


@pytest.fixture
def req():
    return requirements_for(SparseAttentionParams.minimax_m3(tp_size=8), torch.bfloat16, torch.bfloat16, "cpu")


def chosen(sel: Selection, role: str) -> list[str]:
    return [e.backend for e in sel.entries(role) if e.chosen]  # type: ignore[arg-type]


def test_fakes_provide_only_their_declared_ops():
    reg = make_registry(AttentionOnly("a"), IndexerOnly("i"))
    assert reg.get("a").provides("attention") and not reg.get("a").provides("index_topk")
    assert reg.get("i").provides("index_topk") and not reg.get("i").provides("attention")


# -- auto --------------------------------------------------------------------------------------------

def test_auto_picks_highest_priority_available_and_capable(req):
    reg = make_registry(Fake("ref", priority=0), Fake("fast", priority=50),
                        Fake("gpu", priority=100, available=False, why="no GPU driver"),
                        Fake("fp16only", priority=200, dtypes={"float16"}))
    sel = select(req, reg, device="cpu")
    assert sel.attention.name == "fast" and sel.indexer.name == "fast"
    att = {e.backend: e for e in sel.entries("attention")}
    assert set(att) == {"ref", "fast", "gpu", "fp16only"}
    assert att["fast"].chosen and att["fast"].accepted
    assert att["ref"].accepted and not att["ref"].chosen
    assert not att["gpu"].accepted and any("no GPU driver" in r for r in att["gpu"].reasons)
    assert any("dtype bfloat16" in r for r in att["fp16only"].reasons)
    # the indexer role reuses the attention backend: one entry, chosen
    (ientry,) = sel.entries("index_topk")
    assert ientry.backend == "fast" and ientry.chosen and "same backend" in ientry.note
    assert sel.topk_conversion is None


def test_auto_equal_priority_breaks_ties_by_name(req):
    sel = select(req, make_registry(Fake("zeta", priority=5), Fake("alpha", priority=5)), device="cpu")
    assert sel.attention.name == "alpha"


def test_every_reason_is_listed(req):
    reg = make_registry(Fake("picky", available=False, why="driver too old", max_topk=8,
                             block_sizes={64}, device_types={"cuda"}), Fake("ref"))
    sel = select(req, reg, device="cpu")
    (picky,) = [e for e in sel.entries("attention") if e.backend == "picky"]
    text = " | ".join(picky.reasons)
    for frag in ("driver too old", "topk 16 > max_topk 8", "block_size 128 not in [64]", "device type 'cpu'"):
        assert frag in text
    assert not picky.probe.available


def test_nothing_fits_lists_request_and_every_candidate(req):
    reg = make_registry(Fake("a", dtypes={"float32"}), Fake("b", available=False, why="no device"))
    with pytest.raises(NoBackendError) as ei:
        select(req, reg, device="cpu")
    msg = str(ei.value)
    for frag in ("dtype bfloat16", "head_dim 128", "GQA group 8", "a: dtype bfloat16 not in ['float32']",
                 "b: unavailable on cpu: no device"):
        assert frag in msg


def test_empty_registry_says_so(req):
    with pytest.raises(NoBackendError, match="No backends are registered"):
        select(req, make_registry(), device="cpu")


# -- named backends ---------------------------------------------------------------------------------

def test_named_backend_wins_over_priority(req):
    reg = make_registry(Fake("ref"), Fake("fast", priority=10))
    sel = select(req, reg, backend="ref", device="cpu")
    assert sel.attention.name == "ref" and sel.indexer.name == "ref"
    assert [e.backend for e in sel.entries("attention")] == ["ref"]
    assert "named by backend" in sel.entries("attention")[0].note


def test_named_backend_that_cannot_serve_raises_with_reasons(req):
    reg = make_registry(Fake("ref"), Fake("gpu", priority=10, available=False, why="CUDA driver missing"))
    with pytest.raises(BackendUnavailableError) as ei:
        select(req, reg, backend="gpu", device="cpu")
    assert "CUDA driver missing" in str(ei.value) and "allow_fallback" in str(ei.value)


def test_allow_fallback_falls_back_to_auto_and_says_so(req):
    reg = make_registry(Fake("ref"), Fake("gpu", priority=10, available=False, why="CUDA driver missing"))
    sel = select(req, reg, backend="gpu", allow_fallback=True, device="cpu")
    assert sel.attention.name == "ref"
    gpu = [e for e in sel.entries("attention") if e.backend == "gpu"]
    assert len(gpu) == 1 and not gpu[0].accepted  # evaluated once, not again by auto
    assert any("falling back to auto" in n and "gpu" in n for n in sel.notes)
    assert "falling back" in sel.explain()


def test_unknown_name_raises_even_with_fallback(req):
    reg = make_registry(Fake("ref"), Fake("cuda"))
    for fallback in (False, True):
        with pytest.raises(UnknownBackendError) as ei:
            select(req, reg, backend="cdua", allow_fallback=fallback, device="cpu")
        assert "ref" in str(ei.value) and "cuda" in str(ei.value)


def test_duplicate_named_backend_raises_plugin_error(req, monkeypatch):
    import mm3.runtime.discovery as discovery
    from mm3.runtime.config import Settings

    monkeypatch.setattr(discovery, "list_entry_points",
                        lambda group="mm3.backends": [FakeEntryPoint("x1", Fake("x"), "dist-a", "1"),
                                                      FakeEntryPoint("x2", Fake("x"), "dist-b", "1")])
    reg = Registry(settings=Settings())
    with pytest.warns(discovery.PluginLoadWarning):
        reg.backends()
    with pytest.raises(PluginError, match="dist-a.*dist-b"):
        select(req, reg, backend="x", device="cpu")


# -- the indexer role --------------------------------------------------------------------------------

def test_attention_only_backend_gets_an_auto_indexer(req):
    reg = make_registry(AttentionOnly("vendor", priority=100), Fake("ref"), IndexerOnly("idx", priority=5))
    sel = select(req, reg, device="cpu")
    assert sel.attention.name == "vendor" and sel.indexer.name == "idx"
    assert any("does not provide index_topk" in n for n in sel.notes)
    vendor_idx = [e for e in sel.entries("index_topk") if e.backend == "vendor"]
    assert vendor_idx and "does not provide op(s) ['index_topk']" in vendor_idx[0].reasons[0]


def test_explicit_indexer_backend(req):
    reg = make_registry(Fake("a", priority=10), Fake("b"))
    sel = select(req, reg, backend="a", indexer_backend="b", device="cpu")
    assert (sel.indexer.name, sel.attention.name) == ("b", "a")
    with pytest.raises(BackendUnavailableError, match="indexer_backend"):
        select(req, make_registry(Fake("a"), AttentionOnly("att")), indexer_backend="att", device="cpu")


def test_attention_backend_incapable_as_indexer_falls_to_auto(req):
    # "a" runs attention but not the fp8 index cache; the indexer must come from elsewhere.
    req8 = req.model_copy(update={"index_cache_dtype": "float8_e4m3fn"})
    reg = make_registry(Fake("a", priority=10, index_cache_dtypes={"bfloat16"}), Fake("ref"))
    sel = select(req8, reg, device="cpu")
    assert (sel.attention.name, sel.indexer.name) == ("a", "ref")
    assert any("cannot serve as indexer" in n for n in sel.notes)


# -- top-k conversion ----------------------------------------------------------------------------------

@pytest.mark.parametrize("idx_layout, att_layout, contiguous, converts", [
    ("head_major", "token_major", True, True),
    ("token_major", "head_major", True, True),
    ("head_major", "token_major", False, False),
    ("token_major", "token_major", True, False),
])
def test_topk_conversion_sentence(req, idx_layout, att_layout, contiguous, converts):
    reg = make_registry(IndexerOnly("idx", layout=idx_layout),
                        AttentionOnly("att", layout=att_layout, contiguous=contiguous))
    sel = select(req, reg, device="cpu")
    if converts:
        assert sel.topk_conversion is not None
        assert idx_layout in sel.topk_conversion and att_layout in sel.topk_conversion
        assert "idx" in sel.topk_conversion and "att" in sel.topk_conversion
        assert "top-k conversion" in sel.explain()
    else:
        assert sel.topk_conversion is None


# -- explain and logging ----------------------------------------------------------------------------------

def test_explain_marks_chosen_and_lists_reasons(req):
    reg = make_registry(Fake("ref"), Fake("gpu", priority=10, available=False, why="no driver"))
    text = select(req, reg, device="cpu").explain()
    lines = text.splitlines()
    assert "bfloat16" in lines[0] and "cpu" in lines[0]
    assert any(line.lstrip().startswith("* ref") for line in lines)
    assert any("gpu" in line and "rejected" in line and "no driver" in line and "*" not in line
               for line in lines)
    assert lines.index("attention:") < lines.index("index_topk:")


def test_choice_logged_once_at_info(req, caplog):
    reg = make_registry(Fake("logged_backend_xyz"))
    with caplog.at_level(logging.INFO, logger="mm3"):
        select(req, reg, device="cpu")
        select(req, reg, device="cpu")
    recs = [r for r in caplog.records if "logged_backend_xyz" in r.getMessage()]
    assert len(recs) == 1 and recs[0].levelno == logging.INFO and recs[0].name == "mm3"


def test_select_is_pure_for_the_registry(req):
    reg = make_registry(Fake("a"), Fake("b", priority=1))
    before = reg.names()
    s1 = select(req, reg, device="cpu")
    s2 = select(req, reg, device="cpu")
    assert reg.names() == before
    assert (s1.attention, s1.indexer) == (s2.attention, s2.indexer)
    assert [(e.backend, e.op, e.accepted) for e in s1.trace] == [(e.backend, e.op, e.accepted) for e in s2.trace]


# -- requirements_for --------------------------------------------------------------------------------------

def test_requirements_for_maps_params_dtypes_and_device():
    p = SparseAttentionParams.minimax_m3(tp_size=2)
    r = requirements_for(p, torch.float16, torch.float8_e4m3fn, torch.device("cpu"),
                         decode_query_len=4, cuda_graph=True)
    assert (r.device_type, r.dtype, r.index_cache_dtype) == ("cpu", "float16", "float8_e4m3fn")
    assert (r.head_dim, r.index_head_dim, r.block_size, r.topk) == (128, 128, 128, 16)
    assert r.gqa_group == p.gqa_group == 16
    assert (r.decode_query_len, r.cuda_graph) == (4, True)
    assert r.ops == {"index_topk", "attention"}
    assert requirements_for(p, "bfloat16", "bfloat16", "meta").device_type == "meta"


def test_requirements_for_rejects_unsupported_dtype():
    with pytest.raises(InputError, match="float64"):
        requirements_for(SparseAttentionParams.minimax_m3(), torch.float64, torch.bfloat16, "cpu")


def test_named_only_probe_is_passed_over_by_auto_but_served_by_name() -> None:
    """A test-only path (e.g. a GPU backend under Triton's interpreter) is never picked by accident."""
    from mm3.plugin import hookimpl
    from mm3.contract.capabilities import BackendCapabilities, Probe
    from mm3.runtime.registry import Registry
    from mm3.runtime.selection import select

    class Plugin:
        def __init__(self, name: str, priority: int, probe: Probe) -> None:
            self.name, self.priority, self._probe = name, priority, probe

        @hookimpl
        def backend_capabilities(self) -> BackendCapabilities:
            return BackendCapabilities(name=self.name, priority=self.priority, device_types={"cpu"},
                                       ops={"index_topk", "attention"}, topk_layout="head_major")

        @hookimpl
        def backend_probe(self, device):  # noqa: ANN001
            return self._probe

        @hookimpl
        def index_topk(self, index_q, caches, batch, params, out):  # noqa: ANN001
            pass

        @hookimpl
        def attention_forward(self, q, caches, topk, batch, params, out):  # noqa: ANN001
            pass

    reg = Registry(plugins=[Plugin("interp", 100, Probe.named_only("interpreter")),
                            Plugin("plain", 0, Probe.yes())], entry_points=False)
    from mm3.contract.capabilities import Requirements
    req = Requirements(device_type="cpu")
    auto = select(req, reg, device="cpu")
    assert auto.attention.name == "plain" and auto.indexer.name == "plain"
    assert "only when named" in auto.explain()
    named = select(req, reg, backend="interp", device="cpu")
    assert named.attention.name == "interp" and named.indexer.name == "interp"
