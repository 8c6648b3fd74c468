"""The `mm3 backends` and `mm3 config` commands, and the CLI's command plumbing."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Any

import pytest
from plugin_fakes import FakeEntryPoint

import mm3.cli as cli
import mm3.runtime.discovery as discovery
from mm3.plugin import BackendCapabilities, Probe, hookimpl
from mm3.runtime.registry import reset_default_registry


class Plugin:
    def __init__(self, name: str, priority: int, layout: str, available: bool, reason: str,
                 ops=("index_topk", "attention"), kv: str = "NHD", contiguous: bool = False) -> None:
        self._caps = BackendCapabilities(name=name, priority=priority, ops=set(ops), device_types={"cpu"},
                                         topk_layout=layout, kv_cache_layout=kv,
                                         topk_requires_contiguous=contiguous)
        self._probe = Probe(available=available, reason=reason)

    @hookimpl
    def backend_capabilities(self):
        return self._caps

    @hookimpl
    def backend_probe(self, device):
        return self._probe

    @hookimpl
    def index_topk(self, index_q, caches, batch, params, out):
        pass

    @hookimpl
    def attention_forward(self, q, caches, topk, batch, params, out):
        pass


def EP(name: str, target: Any, dist: str, version: str) -> FakeEntryPoint:  # noqa: N802 - reads like a class
    return FakeEntryPoint(name, target, dist, version, value=f"{dist}.plugin")


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch, tmp_path):
    for k in list(os.environ):
        if k.upper().startswith("MM3_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    eps = [
        EP("ref_ep", Plugin("ref", 0, "head_major", True, "plain PyTorch: always available"),
           "mm3", "0.1.0"),
        EP("fast_ep", Plugin("fast", 50, "token_major", True, "fast ready", kv="HND"),
           "fast-attn", "2.3.4"),
        EP("gone_ep", Plugin("gone", 100, "head_major", False, "needs an accelerator"),
           "gone-attn", "1.0"),
        EP("broken_ep", ImportError("cannot import name 'kernel' from 'vendor_ext'"),
           "vendor-ext", "0.9"),
    ]
    monkeypatch.setattr(discovery, "list_entry_points", lambda group="mm3.backends": eps)
    reset_default_registry()
    yield tmp_path
    reset_default_registry()


def rows_by_name(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in {"ref", "fast", "gone"}:
            rows[parts[0]] = line
    return rows


def test_backends_table(capsys):
    assert cli.main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "NAME" in line)
    for col in ("SOURCE", "AVAILABLE", "TOPK LAYOUT", "KV", "OPS", "PRIORITY", "AUTO", "REASON"):
        assert col in header
    rows = rows_by_name(out)
    assert list(rows) == ["gone", "fast", "ref"]  # priority order
    fast = rows["fast"].split()
    assert fast[1:3] == ["fast-attn", "2.3.4"] and "yes" in fast and "token_major" in fast
    assert "HND" in fast and "attention,index_topk" in fast and "50" in fast
    assert "attention+indexer" in rows["fast"] and "fast ready" in rows["fast"]
    assert "no" in rows["gone"].split() and "needs an accelerator" in rows["gone"]
    assert "attention+indexer" not in rows["ref"] and "indexer" not in rows["ref"].split()
    assert "auto picks attention=fast, indexer=fast" in out and "TP8" in out
    # problems section: the broken entry point, with its distribution and error
    problems = out[out.index("problems"):]
    assert "broken_ep" in problems and "vendor-ext 0.9" in problems
    assert "ImportError: cannot import name 'kernel'" in problems


def test_backends_json(capsys):
    assert cli.main(["backends", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["auto"] == {"attention": "fast", "indexer": "fast"}
    by = {b["name"]: b for b in data["backends"]}
    assert by["gone"]["available"] is False and by["gone"]["reason"] == "needs an accelerator"
    assert by["fast"]["distribution"] == "fast-attn" and by["fast"]["version"] == "2.3.4"
    (p,) = data["problems"]
    assert (p["name"], p["distribution"], p["stage"]) == ("broken_ep", "vendor-ext", "import")


def test_backends_respects_settings_and_reports_disabled(capsys, monkeypatch):
    monkeypatch.setenv("MM3_DISABLE_PLUGINS", "fast_ep")
    assert cli.main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "fast" not in rows_by_name(out)
    assert "auto picks attention=ref, indexer=ref" in out
    assert "excluded by MM3_DISABLE_PLUGINS" in out


def test_backends_when_nothing_fits(capsys, monkeypatch):
    monkeypatch.setenv("MM3_PLUGINS", "gone_ep")
    assert cli.main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "auto finds no backend" in out and "needs an accelerator" in out


def test_backends_verbose_prints_traceback(capsys):
    assert cli.main(["backends", "--device", "cpu", "--verbose"]) == 0
    assert "Traceback" in capsys.readouterr().out


def test_config_command_shows_values_and_sources(capsys, monkeypatch, env):
    (env / "mm3.toml").write_text('disable_plugins = ["rocm"]\n')
    monkeypatch.setenv("MM3_BACKEND", "fast")
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert f"config file: {env / 'mm3.toml'}" in out
    lines = {line.split()[0]: line for line in out.splitlines()[2:] if line.strip()}
    assert lines["backend"].split()[1:] == ["fast", "env", "MM3_BACKEND"]
    assert lines["disable_plugins"].split()[1:] == ["rocm", "file", str(env / "mm3.toml")]
    assert lines["allow_fallback"].split()[1:] == ["false", "default"]
    assert set(lines) >= {"indexer_backend", "plugins", "no_plugin_autoload", "check_contracts", "config"}


def test_config_json(capsys, monkeypatch):
    monkeypatch.setenv("MM3_ALLOW_FALLBACK", "1")
    assert cli.main(["config", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["key"]: r for r in data["settings"]}
    assert rows["allow_fallback"] == {"key": "allow_fallback", "value": True, "source": "env MM3_ALLOW_FALLBACK"}


@pytest.mark.parametrize("argv", [["config"], ["backends"]])
def test_config_errors_exit_2_with_one_line(capsys, monkeypatch, argv):
    monkeypatch.setenv("MM3_BACKEDN", "cuda")
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("mm3: error: unknown environment variable MM3_BACKEDN")
    assert "\n" not in err and "Traceback" not in err
    assert "MM3_BACKEND" in err


def test_malformed_config_file_exit_2(capsys, env):
    (env / "mm3.toml").write_text("backend = \n")
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mm3: error: malformed TOML") and "mm3.toml" in err


def test_missing_command_module_fails_cleanly_and_others_still_work(capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "ghost", cli.Command("ghost", "not there", "mm3.no_such_module"))
    assert cli.main(["ghost"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mm3: error: command 'ghost' is not available") and "no_such_module" in err
    assert cli.main(["backends", "--device", "cpu"]) == 0
    assert "auto picks" in capsys.readouterr().out


def test_added_command_is_imported_lazily_by_module_path(capsys, monkeypatch):
    mod = types.ModuleType("fake_mm3_cmd")
    imported: list[str] = []

    def add_arguments(parser):
        imported.append("add_arguments")
        parser.add_argument("--times", type=int, default=1)

    def run(args):
        print("hello " * args.times)
        return 3

    mod.add_arguments, mod.run = add_arguments, run
    monkeypatch.setitem(sys.modules, "fake_mm3_cmd", mod)
    monkeypatch.setitem(cli.COMMANDS, "hello", cli.Command("hello", "say hello", "fake_mm3_cmd"))
    assert cli.main(["config"]) == 0
    assert imported == []  # another command never imports this one
    capsys.readouterr()
    assert cli.main(["hello", "--times", "2"]) == 3
    assert capsys.readouterr().out.strip() == "hello hello"


def test_help_lists_commands_without_importing_them(capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "ghost", cli.Command("ghost", "a ghost command", "mm3.no_such_module"))
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("backends", "config", "demo", "check", "bench", "ghost"):
        assert name in out


def test_no_command_and_bad_usage(capsys):
    assert cli.main([]) == 2
    assert cli.main(["nonsense"]) == 2
    assert cli.main(["backends", "--device"]) == 2
    assert "mm3" in capsys.readouterr().err


def test_bad_device_is_a_clean_error(capsys):
    assert cli.main(["backends", "--device", "not_a_device"]) == 2
    assert capsys.readouterr().err.startswith("mm3: error: invalid --device")


# -- configured backend names are checked (a typo is an error, not "auto picks ...") ---------------------

@pytest.mark.parametrize("argv", [["backends", "--device", "cpu"], ["backends", "--json"], ["config"],
                                  ["config", "--json"]])
@pytest.mark.parametrize("var", ["MM3_BACKEND", "MM3_INDEXER_BACKEND"])
def test_unknown_configured_backend_exits_2_with_did_you_mean(capsys, monkeypatch, argv, var):
    monkeypatch.setenv(var, "fsat")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mm3: error: ") and len(err.splitlines()) == 1
    assert "'fsat'" in err and f"env {var}" in err and "did you mean 'fast'" in err


def test_unknown_backend_in_config_file_names_the_file(capsys, env):
    (env / "mm3.toml").write_text('backend = "nosuch"\n')
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch'" in err and str(env / "mm3.toml") in err and "known backends: fast, gone, ref" in err


def test_known_configured_backend_passes(capsys, monkeypatch):
    monkeypatch.setenv("MM3_BACKEND", "gone")          # installed; availability is not a name error
    assert cli.main(["config"]) == 0
    assert cli.main(["backends", "--device", "cpu"]) == 0


def test_demo_checks_the_configuration_before_building_inputs(capsys, monkeypatch):
    import mm3.cli.demo as demo

    monkeypatch.setattr(demo, "_build", lambda *a, **k: pytest.fail("inputs built before the check"))
    monkeypatch.setenv("MM3_BACKEND", "nosuch")
    assert cli.main(["demo", "--device", "cpu"]) == 2
    assert "unknown backend 'nosuch'" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::mm3.runtime.discovery.PluginLoadWarning")
def test_use_backend_rejects_an_unknown_name_when_the_block_opens():
    from mm3 import use_backend
    from mm3.contract.errors import UnknownBackendError

    with pytest.raises(UnknownBackendError, match="did you mean 'fast'"):
        with use_backend("fsat"):
            pytest.fail("the block must not run")
    with pytest.raises(UnknownBackendError, match="'nope'"):
        with use_backend("auto", indexer_backend="nope"):
            pass
    with use_backend("auto", indexer_backend="ref") as scope:
        assert scope.indexer_backend == "ref"


def test_mm3_table_in_mm3_toml_gets_a_hint(capsys, env):
    (env / "mm3.toml").write_text('[mm3]\nbackend = "ref"\n')
    assert cli.main(["config"]) == 2
    assert "settings go at the top level of mm3.toml" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["backends", "config", "demo", "check", "bench"])
def test_every_option_has_help_and_shows_its_default(command):
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"mm3 {command} {action.option_strings[0]} has no help text"
        shown = formatter._get_help_string(action)
        if action.default is not None and action.default is not False:
            assert "default" in shown, f"mm3 {command} {action.option_strings[0]}: {shown!r}"


def test_help_prints_no_warning():
    """A fresh install prints nothing on stderr for --help (once: torch's NumPy warning)."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "mm3.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "backends" in r.stdout
    assert r.stderr == "", r.stderr

