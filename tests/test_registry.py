"""Registry: discovery, validation, provenance, problems, binding, thread-safety."""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from plugin_fakes import FakeEntryPoint

import mm3.runtime.discovery as discovery
from mm3.plugin import BackendCapabilities, Probe, hookimpl
from mm3.contract.buffers import TopkBuffer
from mm3.runtime.config import Settings
from mm3.contract.errors import BackendUnavailableError, InputError, PluginError, UnknownBackendError
from mm3.runtime.backend import Backend
from mm3.runtime.discovery import PluginLoadWarning, PluginSource
from mm3.runtime.registry import Registry, default_registry, reset_default_registry
from mm3.testing.factories import make_case
from mm3.testing.helpers import default_params

# One small valid step: the bound backend checks every call's arguments before the plugin runs.
_CASE = make_case(default_params(num_kv_heads=1, num_index_heads=1), decodes=[40], prefills=[(3, 20)],
                  dtype="float32")
_TOPK = TopkBuffer.allocate(_CASE.batch.num_tokens, 1, 4)
INDEX_ARGS = (_CASE.index_q, _CASE.caches, _CASE.batch, _CASE.params, _TOPK)
ATTENTION_ARGS = (_CASE.q, _CASE.caches, _TOPK, _CASE.batch, _CASE.params, torch.empty_like(_CASE.q))


# -- fakes ---------------------------------------------------------------------------------------

def caps(name: str, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(name=name, ops=["index_topk", "attention"], device_types=["cpu"],
                                topk_layout="head_major")
    base.update(kw)
    return base


class FullPlugin:
    """A backend providing both ops; records every call."""

    def __init__(self, name: str, probe: Optional[Callable[[Any], Any]] = None, **cap_kw: Any) -> None:
        self._caps = caps(name, **cap_kw)
        self._probe = probe or (lambda device: Probe.yes(f"{name} ok"))
        self.calls: list[tuple[str, tuple]] = []
        self.probe_calls = 0

    @hookimpl
    def backend_capabilities(self):
        return self._caps

    @hookimpl
    def backend_probe(self, device):
        self.probe_calls += 1
        return self._probe(device)

    @hookimpl
    def index_topk(self, index_q, caches, batch, params, out):
        self.calls.append(("index_topk", (index_q, caches, batch, params, out)))
        return ("index", self._caps["name"])

    @hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):
        self.calls.append(("attention_forward", (q, caches, topk, batch, params, out)))
        return ("attention", self._caps["name"])


class AttentionOnly:
    @hookimpl
    def backend_capabilities(self):
        return BackendCapabilities(name="att_only", ops={"attention"}, device_types={"cpu"},
                                   topk_layout="token_major")

    @hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):
        return "att_only"


class SubsetArgs:
    """A hookimpl may take a subset of the spec's arguments, in any order."""

    @hookimpl
    def backend_capabilities(self):
        return caps("subset", ops=["attention"])

    got: tuple = ()

    @hookimpl
    def attention_forward(self, out, q):
        self.got = (q, out)


class MisspelledArg:
    @hookimpl
    def backend_capabilities(self):
        return caps("misspelled", ops=["index_topk"])

    @hookimpl
    def index_topk(self, index_q, cache, batch, params, out):  # "cache" is not in the spec
        pass


class UnknownHook:
    @hookimpl
    def backend_capabilities(self):
        return caps("unknown_hook")

    @hookimpl
    def index_topk(self, index_q, caches, batch, params, out):
        pass

    @hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):
        pass

    @hookimpl
    def backend_prob(self, device):  # typo of backend_probe
        pass


class BadCaps:
    @hookimpl
    def backend_capabilities(self):
        return caps("bad_caps", topk_layout="diagonal", max_topk=0)


class CapsRaise:
    @hookimpl
    def backend_capabilities(self):
        raise RuntimeError("driver exploded")


class CapsWrongType:
    @hookimpl
    def backend_capabilities(self):
        return ["not", "capabilities"]


class NoCaps:
    @hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):
        pass


class DeclaresMissingOp:
    @hookimpl
    def backend_capabilities(self):
        return caps("missing_op")  # declares both ops

    @hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):
        pass


def fake_eps(monkeypatch: pytest.MonkeyPatch, eps: list, calls: Optional[list] = None) -> None:
    def lister(group: str = discovery.ENTRY_POINT_GROUP):
        assert group == "mm3.backends"
        if calls is not None:
            calls.append(group)
        return list(eps)

    monkeypatch.setattr(discovery, "list_entry_points", lister)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import os

    for k in list(os.environ):
        if k.upper().startswith("MM3_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    reset_default_registry()
    yield
    reset_default_registry()


def load(reg: Registry) -> list:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        reg.backends()
    return [x for x in w if issubclass(x.category, PluginLoadWarning)]


# -- explicit registration and binding --------------------------------------------------------------

def test_isolated_registry_lists_and_sorts_backends():
    reg = Registry([FullPlugin("b_low", priority=1), FullPlugin("a_high", priority=5),
                    FullPlugin("c_low", priority=1)], entry_points=False)
    assert reg.names() == ["a_high", "b_low", "c_low"]
    assert [b.priority for b in reg.backends()] == [5, 1, 1]
    assert reg.problems() == []
    assert "a_high" in reg and "zzz" not in reg and len(reg) == 3


def test_isolated_registry_never_touches_entry_points(monkeypatch):
    def boom(group="mm3.backends"):
        raise AssertionError("entry points listed")

    monkeypatch.setattr(discovery, "list_entry_points", boom)
    reg = Registry([FullPlugin("x")], entry_points=False)
    assert reg.names() == ["x"]


def test_bound_call_checks_once_then_calls_the_plugins_own_function_not_pm_hook():
    plugin = FullPlugin("direct")
    reg = Registry([plugin, FullPlugin("other")], entry_points=False)
    be = reg.get("direct")
    assert isinstance(be, Backend) and be.plugin is plugin
    hook_calls: list[str] = []
    undo = reg.plugin_manager.add_hookcall_monitoring(
        lambda name, impls, kw: hook_calls.append(name), lambda *a: None)
    try:
        be.index_topk(*INDEX_ARGS)
        be.attention_forward(*ATTENTION_ARGS)
    finally:
        undo()
    assert hook_calls == []                                  # no pluggy in between
    assert [c[0] for c in plugin.calls] == ["index_topk", "attention_forward"]
    assert all(a is b for a, b in zip(plugin.calls[1][1], ATTENTION_ARGS))   # the very objects
    with pytest.raises(InputError, match="direct.index_topk: index_q has shape"):
        be.index_topk(_CASE.q, *INDEX_ARGS[1:])              # q where index_q belongs
    assert len(plugin.calls) == 2                            # refused before the plugin ran


def test_hooks_of_different_backends_never_mix():
    a, b = FullPlugin("a"), FullPlugin("b")
    reg = Registry([a, b], entry_points=False)
    reg.get("b").index_topk(*INDEX_ARGS)
    assert a.calls == [] and len(b.calls) == 1


def test_subset_and_reordered_hookimpl_arguments_are_adapted():
    plugin = SubsetArgs()
    be = Registry([plugin], entry_points=False).get("subset")
    q, out = ATTENTION_ARGS[0], ATTENTION_ARGS[-1]
    be.attention_forward(*ATTENTION_ARGS)
    assert plugin.got[0] is q and plugin.got[1] is out
    plugin.got = ()
    be.attention_forward(**dict(zip(("q", "caches", "topk", "batch", "params", "out"), ATTENTION_ARGS)))
    assert plugin.got[0] is q and plugin.got[1] is out


def test_capabilities_may_be_model_or_dict_and_source_is_explicit():
    reg = Registry([AttentionOnly(), FullPlugin("dicty", priority=3)], entry_points=False)
    att = reg.get("att_only")
    assert isinstance(att.capabilities, BackendCapabilities)
    assert reg.get("dicty").capabilities.priority == 3
    assert att.source.entry_point == "explicit" and att.source.distribution is None
    assert "AttentionOnly" in str(att.source)


def test_missing_op_raises_backend_unavailable():
    be = Registry([AttentionOnly()], entry_points=False).get("att_only")
    assert be.provides("attention") and not be.provides("index_topk")
    with pytest.raises(BackendUnavailableError, match="att_only.*index_topk"):
        be.index_topk(None, None, None, None, None)
    with pytest.raises(ValueError, match="unknown op"):
        be.provides("softmax")


def test_register_returns_backend_and_rejects_duplicates_and_broken_plugins():
    reg = Registry([FullPlugin("dup")], entry_points=False)
    be = reg.register(AttentionOnly())
    assert be is reg.get("att_only")
    with pytest.raises(PluginError) as ei:
        reg.register(FullPlugin("dup"), source=PluginSource("other-dist", "2.0", "dup_ep", "x:y"))
    assert "other-dist" in str(ei.value) and "explicit" in str(ei.value)
    assert reg.get("dup").source.entry_point == "explicit"  # the first one still serves
    with pytest.raises(PluginError, match="topk_layout"):
        reg.register(BadCaps())
    assert sorted(reg.names()) == ["att_only", "dup"]
    # the rejected plugins left no hookimpls behind in the plugin manager
    assert len(reg.plugin_manager.get_plugins()) == 2


def test_register_same_object_twice_is_an_error():
    p = FullPlugin("once")
    reg = Registry([p], entry_points=False)
    with pytest.raises(PluginError, match="already registered"):
        reg.register(p)


def test_plugins_given_as_import_paths_and_broken_import_path():
    reg = Registry(["mm3.contract.capabilities", "no_such_mm3_module_xyz"], entry_points=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        probs = {p.name: p for p in reg.problems()}
    # mm3.contract.capabilities has no hookimpls at all -> no backend_capabilities
    assert probs["mm3.contract.capabilities"].stage == "hooks"
    assert probs["no_such_mm3_module_xyz"].stage == "import"
    assert "ModuleNotFoundError" in probs["no_such_mm3_module_xyz"].error


# -- failure matrix -----------------------------------------------------------------------------------

@pytest.mark.parametrize("plugin, stage, fragments", [
    (MisspelledArg(), "register", ["cache", "index_topk"]),
    (UnknownHook(), "hooks", ["backend_prob", "did you mean 'backend_probe'"]),
    (BadCaps(), "capabilities", ["topk_layout", "max_topk", "diagonal"]),
    (CapsRaise(), "capabilities", ["RuntimeError: driver exploded"]),
    (CapsWrongType(), "capabilities", ["list"]),
    (NoCaps(), "hooks", ["backend_capabilities"]),
    (DeclaresMissingOp(), "hooks", ["index_topk", "missing_op"]),
])
def test_broken_plugins_are_excluded_reported_and_warned(plugin, stage, fragments, monkeypatch):
    good = FullPlugin("good")
    fake_eps(monkeypatch, [FakeEntryPoint("broken_ep", plugin, dist="vendor-x", version="9.9"),
                           FakeEntryPoint("good", good)])
    reg = Registry(settings=Settings())
    warned = load(reg)
    assert reg.names() == ["good"]
    (p,) = reg.problems()
    assert (p.name, p.distribution, p.version, p.stage) == ("broken_ep", "vendor-x", "9.9", stage)
    for frag in fragments:
        assert frag in p.error
    assert len(warned) == 1 and "vendor-x" in str(warned[0].message)
    # nothing of the broken plugin stays registered in pluggy
    assert plugin not in reg.plugin_manager.get_plugins()
    reg.get("good").index_topk(*INDEX_ARGS)
    assert [c[0] for c in good.calls] == ["index_topk"]


def test_import_error_reports_last_traceback_line_and_distribution(monkeypatch):
    fake_eps(monkeypatch, [
        FakeEntryPoint("vendor", ModuleNotFoundError("No module named 'vendor_kernels'"),
                       dist="vendor-attn", version="1.2.3"),
        FakeEntryPoint("ok", FullPlugin("ok")),
    ])
    reg = Registry(settings=Settings())
    warned = load(reg)
    (p,) = reg.problems()
    assert p.stage == "import" and p.distribution == "vendor-attn" and p.version == "1.2.3"
    assert p.error.startswith("ModuleNotFoundError: No module named 'vendor_kernels'")
    assert "Traceback" in p.details
    assert "MM3_DISABLE_PLUGINS=vendor" in p.error
    assert len(warned) == 1
    assert reg.names() == ["ok"]
    with pytest.raises(UnknownBackendError) as ei:
        reg.get("vendor")
    assert "vendor_kernels" in str(ei.value) and "ok" in str(ei.value)


def test_entry_point_provenance(monkeypatch):
    fake_eps(monkeypatch, [FakeEntryPoint("ep_name", FullPlugin("be_name"), dist="acme-mm3", version="4.5")])
    be = Registry(settings=Settings()).get("be_name")
    assert be.source == PluginSource("acme-mm3", "4.5", "ep_name", "fake_pkg.ep_name")
    assert be.source.dist_label == "acme-mm3 4.5"


def test_duplicate_names_exclude_both_and_name_both_distributions(monkeypatch):
    fake_eps(monkeypatch, [FakeEntryPoint("one", FullPlugin("same"), dist="dist-one"),
                           FakeEntryPoint("two", FullPlugin("same"), dist="dist-two"),
                           FakeEntryPoint("other", FullPlugin("other"))])
    reg = Registry(settings=Settings())
    warned = load(reg)
    assert reg.names() == ["other"]
    probs = reg.problems()
    assert [p.stage for p in probs] == ["duplicate", "duplicate"]
    assert {p.distribution for p in probs} == {"dist-one", "dist-two"}
    for p in probs:
        assert "dist-one" in p.error and "dist-two" in p.error and p.backend == "same"
    assert len(warned) == 2
    with pytest.raises(PluginError) as ei:
        reg.get("same")
    assert "dist-one" in str(ei.value) and "dist-two" in str(ei.value)
    # registering a third one with that name is refused too
    with pytest.raises(PluginError, match="dist-one"):
        reg.register(FullPlugin("same"))


def test_probe_exception_becomes_probe_no_and_probes_are_cached_per_device():
    def probe(device):
        if device.type == "cpu":
            raise OSError("no driver")
        return Probe.yes("meta fine")

    plugin = FullPlugin("probey", probe=probe, device_types=["cpu", "meta"])
    be = Registry([plugin], entry_points=False).get("probey")
    r = be.probe("cpu")
    assert not r.available and r.reason == "probe raised OSError: no driver"
    assert be.probe(torch.device("cpu")) is r
    assert plugin.probe_calls == 1
    assert be.probe("meta").available and plugin.probe_calls == 2


def test_probe_returning_garbage_or_missing_probe():
    plugin = FullPlugin("garbage", probe=lambda d: True)
    be = Registry([plugin, AttentionOnly()], entry_points=False).get("garbage")
    assert not be.probe("cpu").available and "expected mm3.plugin.Probe" in be.probe("cpu").reason
    assert Registry([AttentionOnly()], entry_points=False).get("att_only").probe("cpu").available


def test_alloc_topk_buffer_default_and_hook():
    be = Registry([AttentionOnly()], entry_points=False).get("att_only")
    buf = be.alloc_topk_buffer(5, 2, 4, "cpu")
    assert buf.layout == "token_major" and (buf.num_tokens, buf.num_heads, buf.topk) == (5, 2, 4)
    assert bool((buf.storage == -1).all())

    class Allocates(FullPlugin):
        def __init__(self, layout: str) -> None:
            super().__init__("alloc", topk_layout="head_major")
            self.layout = layout

        @hookimpl
        def alloc_topk_buffer(self, num_tokens, num_heads, topk, device):
            return TopkBuffer.allocate(num_tokens, num_heads, topk, layout=self.layout, device=device, fill=7)

    be = Registry([Allocates("head_major")], entry_points=False).get("alloc")
    assert int(be.alloc_topk_buffer(3, 1, 2, "cpu").storage[0, 0, 0]) == 7
    bad = Registry([Allocates("token_major")], entry_points=False).get("alloc")
    with pytest.raises(PluginError, match="declare topk_layout='head_major'"):
        bad.alloc_topk_buffer(3, 2, 2, "cpu")    # one head would be both layouts' memory: two heads


# -- allow / deny / no-autoload --------------------------------------------------------------------------

def _three(monkeypatch, calls=None):
    eps = [FakeEntryPoint("cpu_ref", FullPlugin("cpu_ref"), dist="mm3", counter=calls),
           FakeEntryPoint("vendor", FullPlugin("vendor"), dist="vendor-dist", counter=calls),
           FakeEntryPoint("gpu_ep", FullPlugin("gpu_backend"), dist="mm3", counter=calls)]
    fake_eps(monkeypatch, eps)


def test_deny_list_skips_import_and_reports(monkeypatch):
    loaded: list[str] = []
    _three(monkeypatch, loaded)
    reg = Registry(settings=Settings(disable_plugins=["vendor", "gpu_backend"]))
    assert load(reg) == []  # a requested exclusion is not a warning
    assert reg.names() == ["cpu_ref"]
    assert "vendor" not in loaded  # denied by entry-point name: never imported
    probs = {p.name: p for p in reg.problems()}
    assert probs["vendor"].stage == "disabled" and "MM3_DISABLE_PLUGINS" in probs["vendor"].error
    assert probs["gpu_ep"].stage == "disabled" and probs["gpu_ep"].backend == "gpu_backend"


def test_deny_list_by_distribution_name(monkeypatch):
    _three(monkeypatch)
    reg = Registry(settings=Settings(disable_plugins="vendor-dist"))
    assert reg.names() == ["cpu_ref", "gpu_backend"]


def test_allow_list_and_unknown_allowed_name(monkeypatch):
    loaded: list[str] = []
    _three(monkeypatch, loaded)
    reg = Registry(settings=Settings(plugins=["vendor", "nonexistent"]))
    assert reg.names() == ["vendor"]
    assert loaded == ["vendor"]
    probs = {p.name: p for p in reg.problems()}
    assert probs["cpu_ref"].stage == "disabled" and "MM3_PLUGINS" in probs["cpu_ref"].error
    assert probs["nonexistent"].stage == "not_found" and "cpu_ref" in probs["nonexistent"].error


def test_no_autoload_keeps_builtins_only_unless_allowed(monkeypatch):
    _three(monkeypatch)
    reg = Registry(settings=Settings(no_plugin_autoload=True))
    assert reg.names() == ["cpu_ref", "gpu_backend"]
    (p,) = reg.problems()
    assert p.name == "vendor" and "MM3_NO_PLUGIN_AUTOLOAD" in p.error
    reg = Registry(settings=Settings(no_plugin_autoload=True, plugins=["vendor"]))
    assert reg.names() == ["vendor"]


def test_settings_default_to_environment(monkeypatch):
    _three(monkeypatch)
    monkeypatch.setenv("MM3_DISABLE_PLUGINS", "cpu_ref, vendor")
    assert Registry().names() == ["gpu_backend"]


def test_explicit_plugins_ignore_deny_list(monkeypatch):
    _three(monkeypatch)
    reg = Registry([FullPlugin("mine")], settings=Settings(disable_plugins=["mine", "cpu_ref"]))
    assert "mine" in reg.names() and "cpu_ref" not in reg.names()


# -- laziness and thread-safety ---------------------------------------------------------------------------

def test_loading_is_lazy_and_once(monkeypatch):
    calls: list[str] = []
    loads: list[str] = []
    fake_eps(monkeypatch, [FakeEntryPoint("lazy", FullPlugin("lazy"), counter=loads)], calls)
    reg = Registry(settings=Settings())
    assert calls == [] and loads == []
    reg.names(), reg.problems(), reg.get("lazy"), reg.backends()
    assert calls == ["mm3.backends"] and loads == ["lazy"]


def test_concurrent_first_access_loads_exactly_once(monkeypatch):
    calls: list[str] = []
    loads: list[str] = []
    gate = threading.Event()

    class SlowPlugin(FullPlugin):
        @hookimpl
        def backend_capabilities(self):
            gate.wait(0.05)  # widen the race window: other threads arrive meanwhile
            return self._caps

    fake_eps(monkeypatch, [FakeEntryPoint("slow", SlowPlugin("slow"), counter=loads),
                           FakeEntryPoint("fast", FullPlugin("fast"), counter=loads)], calls)
    reg = Registry(settings=Settings())
    barrier = threading.Barrier(32)
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            results.append([b.name for b in reg.backends()])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(calls) == 1 and sorted(loads) == ["fast", "slow"]
    assert len(results) == 32 and all(r == ["fast", "slow"] for r in results)


def test_default_registry_is_a_singleton_until_reset(monkeypatch):
    fake_eps(monkeypatch, [FakeEntryPoint("d", FullPlugin("d"))])
    a = default_registry()
    assert default_registry() is a
    reset_default_registry()
    b = default_registry()
    assert b is not a and b.names() == ["d"]


def test_get_unknown_lists_known_names_and_suggests():
    reg = Registry([FullPlugin("cpu_ref"), FullPlugin("cuda")], entry_points=False)
    with pytest.raises(UnknownBackendError) as ei:
        reg.get("cdua")
    msg = str(ei.value)
    assert "cpu_ref" in msg and "cuda" in msg and "did you mean 'cuda'" in msg


def test_a_judge_of_contents_without_the_fault_word_is_refused_at_register():
    """``judges_contents`` without ``reports_bad_page_ids``: its index_topk would never be handed the word, and the
    layer would judge nothing; the capabilities refuse it, naming the fix."""
    from mm3.testing.mock import MockBackend

    reg = Registry([], entry_points=False)
    with pytest.raises(PluginError, match="judges_contents needs reports_bad_page_ids"):
        reg.register(_Declares(judges_contents=True))
    assert reg.register(_Declares(judges_contents=True, reports_bad_page_ids=True)).capabilities.judges_contents
    assert MockBackend("judge", judges_contents=True, reports_bad_page_ids=True).capabilities.judges_contents


class _Declares:
    """A plugin whose capabilities are given (its hooks are never called here)."""

    def __init__(self, **caps: object) -> None:
        self.caps = caps

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(name="declares", ops={"index_topk"}, device_types={"cpu"},
                                   topk_layout="head_major", **self.caps)

    @hookimpl
    def index_topk(self, index_q, caches, batch, params, out, page_faults):  # type: ignore[no-untyped-def]
        pass
