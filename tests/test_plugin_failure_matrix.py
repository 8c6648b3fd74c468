"""Broken and excluded plugins, end to end through real entry points (docs/plugins.md).

Each scenario is a throwaway distribution: a ``*.dist-info`` folder (METADATA
+ entry_points.txt) and its plugin module in a temporary directory put on
``PYTHONPATH``, which is what ``pip install`` leaves behind for
``importlib.metadata``. ``mm3 backends`` then runs in a fresh interpreter, as a
user would run it. All broken plugins are installed *together* with a healthy
third-party plugin: every problem must get its own readable line naming the
distribution, its version and what to fix, and none may take the others down
(the built-ins and the healthy plugin are listed, available and still compute).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from plugin_fakes import backends_row as _row
from plugin_fakes import subprocess_env

from mm3.testing.helpers import write_distribution

HEALTHY = textwrap.dedent("""
    # A working third-party backend: the reference math under another name.
    from mm3.plugin import Probe, hookimpl
    from mm3_backends.cpu_ref import plugin as _ref

    @hookimpl
    def backend_capabilities():
        return _ref.CAPABILITIES.model_copy(update={"name": "healthy", "priority": 3})

    @hookimpl
    def backend_probe(device):
        return Probe.yes("healthy and here")

    @hookimpl
    def index_topk(index_q, caches, batch, params, out):
        _ref.index_topk(index_q, caches, batch, params, out)

    @hookimpl
    def attention_forward(q, caches, topk, batch, params, out):
        _ref.attention_forward(q, caches, topk, batch, params, out)

    @hookimpl
    def index_scores(index_q, caches, batch, params, out):
        _ref.index_scores(index_q, caches, batch, params, out)
""")


def _caps(name: str, layout: str = "head_major") -> str:
    return (f"BackendCapabilities(name={name!r}, ops={{'attention'}}, device_types={{'cpu'}}, "
            f"topk_layout={layout!r})")


def _plugin(caps: str, attention_args: str = "q, caches, topk, batch, params, out",
            probe: str = "return Probe.yes()", header: str = "") -> str:
    return textwrap.dedent(f"""
        from mm3.plugin import BackendCapabilities, Probe, hookimpl
        {header}
        @hookimpl
        def backend_capabilities():
            return {caps}

        @hookimpl
        def backend_probe(device):
            {probe}

        @hookimpl
        def attention_forward({attention_args}):
            pass
    """)


@dataclass(frozen=True)
class Broken:
    """One broken distribution and the line ``mm3 backends`` must print for it."""

    dist: str
    version: str
    entry_point: str
    source: str
    stage: Optional[str]               # problems stage, or None when listed as a backend
    expect: tuple[str, ...]            # fragments of its line


BROKEN = {
    "import_error": Broken(
        "vendor-ext-attn", "0.9.1", "vendor_ext",
        _plugin(_caps("vendor_ext"), header="import vendor_ext_kernels  # its compiled extension is missing"),
        "import", ("ModuleNotFoundError: No module named 'vendor_ext_kernels'",
                   "set MM3_DISABLE_PLUGINS=vendor_ext")),
    "invalid_capabilities": Broken(
        "badcaps-attn", "2.0.0", "badcaps",
        _plugin(_caps("badcaps", layout="row_major")),
        "capabilities", ("invalid BackendCapabilities: topk_layout: Input should be 'head_major' or "
                         "'token_major' (got 'row_major')",)),
    "misspelled_hook_argument": Broken(
        "typo-attn", "1.0.0", "typo",
        _plugin(_caps("typo"), attention_args="q, caches, topk, batch, params, output"),
        "register", ("attention_forward(q, caches, topk, batch, params, output)", "{'output'}",
                     "make the hookimpl's arguments a subset of the hookspec's")),
    "duplicate_name_a": Broken(
        "twin-a", "1.0.0", "twin_a", _plugin(_caps("twin")),
        "duplicate", ("backend name 'twin' is declared by more than one plugin",
                      "twin-a 1.0.0 (entry point twin_a", "twin-b 2.0.0 (entry point twin_b")),
    "duplicate_name_b": Broken(
        "twin-b", "2.0.0", "twin_b", _plugin(_caps("twin")),
        "duplicate", ("twin-a 1.0.0 (entry point twin_a", "twin-b 2.0.0 (entry point twin_b")),
    "probe_raises": Broken(
        "flaky-attn", "0.1.0", "flaky",
        _plugin(_caps("flaky"), probe="raise RuntimeError('driver not loaded')"),
        None, ("flaky-attn 0.1.0", "no", "probe raised RuntimeError: driver not loaded")),
}


def _install(site: Path, broken: dict[str, Broken]) -> None:
    write_distribution(site, "healthy-attn", "1.0.0",
                       entry_points={"mm3.backends": {"healthy": "healthy_plugin"}},
                       files={"healthy_plugin.py": HEALTHY})
    for key, b in broken.items():
        module = f"{b.entry_point}_plugin"
        write_distribution(site, b.dist, b.version, entry_points={"mm3.backends": {b.entry_point: module}},
                           files={f"{module}.py": b.source})


def _mm3_command() -> list[str]:
    """The installed console script when there is one (what users run), else ``python -m mm3.cli``."""
    script = Path(sys.executable).with_name("mm3")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mm3.cli"]


def _backends_text(site: Path, cwd: Path, **env: str) -> str:
    r = subprocess.run([*_mm3_command(), "backends", "--device", "cpu"], cwd=cwd, env=subprocess_env(site, **env),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return r.stdout


def _line(text: str, start: str) -> Optional[str]:
    return next((ln.strip() for ln in text.splitlines() if ln.strip().startswith(start)), None)


# The same interpreter also checks what a program sees: warnings issued, the healthy plugin and
# cpu_ref still compute, and `mm3 check` explains the broken names.
PROGRAM = textwrap.dedent("""
    import contextlib, io, json, warnings
    import torch
    import mm3, mm3.cli as cli
    from mm3.runtime.layer import SparseAttention
    from mm3.runtime.discovery import PluginLoadWarning
    from mm3.runtime.registry import default_registry
    from mm3.testing.helpers import CaseFactory, default_params
    from mm3.testing.oracle import oracle_attention

    def capture(argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
        return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = default_registry().names()
    res = {"names": names,
           "warnings": [str(w.message) for w in caught if issubclass(w.category, PluginLoadWarning)],
           "json": json.loads(capture(["backends", "--device", "cpu", "--json"])["out"]),
           "check_twin": capture(["check", "twin", "--device", "cpu"]),
           "check_vendor": capture(["check", "vendor_ext", "--device", "cpu"])}
    p = default_params()
    case = CaseFactory(seed=5)(p)
    for name in ("healthy", "cpu_ref"):
        layer = SparseAttention(p, dtype=torch.float32, max_num_tokens=64, backend=name)
        out = layer(case.q, case.index_q, case.caches, case.batch)
        sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
        ref = oracle_attention(case.q, case.caches, sel, case.batch, p)
        res["err_" + name] = float((out.double() - ref).abs().max())
    print(json.dumps(res))
""")


@pytest.fixture(scope="module")
def all_broken(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every broken distribution installed at once next to a healthy one; what the user sees."""
    root = tmp_path_factory.mktemp("failure_matrix")
    site, cwd = root / "site", root / "work"
    cwd.mkdir()
    _install(site, BROKEN)
    text = _backends_text(site, cwd)
    r = subprocess.run([sys.executable, "-c", PROGRAM], cwd=cwd, env=subprocess_env(site), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"text": text, **json.loads(r.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("scenario", list(BROKEN))
def test_broken_plugin_has_a_readable_line(all_broken: dict, scenario: str) -> None:
    b = BROKEN[scenario]
    text = all_broken["text"]
    if b.stage is None:
        # Installed fine but unusable here: a backend row, AVAILABLE "no", the reason.
        name = b.entry_point
        row = _row(text, name)
        assert row is not None, text
        line = "  ".join(row)
        assert row[1] == f"{b.dist} {b.version}" and row[2] == "no", row
    else:
        line = _line(text, f"{b.entry_point} from {b.dist} {b.version} [{b.stage}]:")
        assert line is not None, f"no problem line for {b.entry_point}:\n{text}"
        assert "\n" not in line and len(line) < 700
        # Structured output agrees.
        probs = {p["entry_point"]: p for p in all_broken["json"]["problems"]}
        p = probs[b.entry_point]
        assert (p["distribution"], p["version"], p["stage"]) == (b.dist, b.version, b.stage)
    for fragment in b.expect:
        assert fragment in line, f"{fragment!r} not in {line!r}"


def test_broken_plugins_are_reported_not_swallowed(all_broken: dict) -> None:
    excluded = {b.entry_point for b in BROKEN.values() if b.stage is not None}
    warned = " ".join(all_broken["warnings"])
    for ep in excluded:
        assert f"{ep} [" in warned, f"no PluginLoadWarning for {ep}: {all_broken['warnings']}"
    assert f"problems ({len(excluded)} plugin(s) excluded):" in all_broken["text"]


def test_broken_plugins_break_nothing_else(all_broken: dict) -> None:
    text = all_broken["text"]
    for name, source in (("cpu_ref", "mm3 "), ("healthy", "healthy-attn 1.0.0")):
        row = _row(text, name)
        assert row is not None and row[1].startswith(source) and row[2] == "yes", (name, text)
    # The broken ones are not offered as backends (the flaky one is listed but unavailable).
    assert set(all_broken["names"]) >= {"cpu_ref", "healthy", "flaky"}
    assert not set(all_broken["names"]) & {"vendor_ext", "badcaps", "typo", "twin"}
    # auto still decides (among the good backends: other plugins installed here may outrank healthy),
    # and both good backends still compute the oracle's answer.
    auto = _line(text, "auto picks")
    assert auto is not None and not any(f"={b.entry_point}" in auto for b in BROKEN.values()), text
    assert all_broken["err_healthy"] < 1e-5 and all_broken["err_cpu_ref"] < 1e-5


def test_check_explains_broken_names(all_broken: dict) -> None:
    twin = all_broken["check_twin"]
    assert twin["rc"] == 2
    assert "declared by more than one plugin" in twin["err"] and "twin-a 1.0.0" in twin["err"] \
        and "twin-b 2.0.0" in twin["err"]
    vendor = all_broken["check_vendor"]
    assert vendor["rc"] == 2
    assert "unknown backend 'vendor_ext'" in vendor["err"]
    assert "excluded: vendor_ext [import]" in vendor["err"] and "vendor_ext_kernels" in vendor["err"]


EXCLUSIONS = {
    # scenario: (environment, the line `mm3 backends` prints for the healthy plugin)
    "allow_list": ({"MM3_PLUGINS": "cpu_ref"},
                   "healthy from healthy-attn 1.0.0 [disabled]: excluded by MM3_PLUGINS allow-list "
                   "(plugins=['cpu_ref']); add 'healthy' to it to load"),
    "deny_list": ({"MM3_DISABLE_PLUGINS": "healthy"},
                  "healthy from healthy-attn 1.0.0 [disabled]: excluded by MM3_DISABLE_PLUGINS "
                  "(disable_plugins=['healthy']); remove 'healthy' from it to load"),
    "no_autoload": ({"MM3_NO_PLUGIN_AUTOLOAD": "1"},
                    "healthy from healthy-attn 1.0.0 [disabled]: excluded by MM3_NO_PLUGIN_AUTOLOAD "
                    "(third-party plugins load only when named in MM3_PLUGINS); set MM3_PLUGINS=healthy"),
}


@pytest.mark.slow   # a fresh interpreter per case (torch's import): the default run keeps the others
@pytest.mark.parametrize("scenario", list(EXCLUSIONS))
def test_excluded_by_setting(tmp_path: Path, scenario: str) -> None:
    env, expected = EXCLUSIONS[scenario]
    site = tmp_path / "site"
    _install(site, {})
    text = _backends_text(site, tmp_path, **env)
    assert expected in text, text
    assert _row(text, "healthy") is None
    row = _row(text, "cpu_ref")
    assert row is not None and row[2] == "yes", text
    auto = _line(text, "auto picks")          # auto decides without it (among whatever else is installed)
    assert auto is not None and "healthy" not in auto, text


def test_no_autoload_still_loads_a_named_plugin(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _install(site, {})
    text = _backends_text(site, tmp_path, MM3_NO_PLUGIN_AUTOLOAD="1", MM3_PLUGINS="healthy,cpu_ref")
    row = _row(text, "healthy")
    assert row is not None and row[1] == "healthy-attn 1.0.0" and row[2] == "yes", text
    # cuda/rocm are not in the allow-list: excluded with a line each, cpu_ref and healthy stay.
    assert "[disabled]: excluded by MM3_PLUGINS allow-list" in text
