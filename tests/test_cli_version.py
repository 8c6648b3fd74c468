"""The entry points people reach for: ``python -m mm3``, ``mm3 --version`` and ``mm3 version``.

The version report is what a bug report needs: mm3, Python, torch, Triton (or
"not installed"), the device, and every discovered backend plugin with the
distribution and version it came from.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys

import pytest
import torch
from plugin_fakes import FakeEntryPoint, subprocess_env

import mm3
from mm3.cli import main
from mm3.cli import version as version_cmd
from mm3.runtime import discovery
from mm3.runtime.registry import reset_default_registry


def _python_m_mm3(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mm3", *args], env=subprocess_env(), cwd=os.path.dirname(__file__),
                          capture_output=True, text=True, timeout=120)


def test_python_m_mm3_runs_the_command() -> None:
    r = _python_m_mm3("backends", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "auto picks" in r.stdout and "cpu_ref" in r.stdout
    usage = _python_m_mm3("no-such-command")
    assert usage.returncode == 2 and "usage: mm3" in usage.stderr, usage.stderr


@pytest.mark.slow   # a fresh interpreter per case (torch's import): the default run keeps the others
def test_version_names_every_installed_plugin_with_its_distribution() -> None:
    """``python -m mm3 --version`` in a fresh interpreter, against the entry points installed here."""
    r = _python_m_mm3("--version")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"mm3 {mm3.__version__} (")
    assert lines[1].startswith(f"Python {platform.python_version()} ")
    assert lines[2] == f"torch {torch.__version__}"
    triton = version_cmd.distribution_version("triton")
    assert lines[3] == (f"Triton {triton}" if triton else "Triton not installed")
    assert lines[4].startswith("device: ")
    assert lines[5] == "backend plugins:"
    listed = "\n".join(lines[6:])
    for ep in importlib.metadata.entry_points(group="mm3.backends"):
        assert f"{ep.dist.name} {ep.dist.version} (entry point {ep.name})" in listed, (ep, listed)
    assert _python_m_mm3("version").stdout == r.stdout


@pytest.fixture
def fake_plugins(monkeypatch: pytest.MonkeyPatch):
    """A registry discovering one healthy third-party plugin and one that fails to import."""
    from mm3.testing.mock import MockBackend

    for k in list(os.environ):
        if k.upper().startswith("MM3_"):
            monkeypatch.delenv(k)
    eps = [FakeEntryPoint("fast_ep", MockBackend("fast"), "fast-attn", "2.3.4"),
           FakeEntryPoint("broken_ep", ImportError("No module named 'vendor_ext'"), "vendor-ext", "0.9")]
    monkeypatch.setattr(discovery, "list_entry_points", lambda group="mm3.backends": eps)
    reset_default_registry()
    yield
    reset_default_registry()


def test_version_lists_loaded_and_excluded_plugins(fake_plugins: None, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version_cmd, "distribution_version", lambda name: None)
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert "Triton not installed" in out
    # a loaded plugin's line ends with its probe on this device: the backend's own words about it
    assert "  fast: fast-attn 2.3.4 (entry point fast_ep), loaded; on cpu: available (" in out, out
    assert "  broken_ep: vendor-ext 0.9 (entry point broken_ep), excluded [import]: ImportError: No module " \
           "named 'vendor_ext'" in out, out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == out


def test_the_device_line_asks_the_accelerator_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """The core names the accelerator by type and index only: what the device is, the backends' probes say."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    assert version_cmd.describe_device() == "cuda:1 (2 visible)"
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert version_cmd.describe_device().startswith("cpu (")


def test_a_setting_that_stops_the_registry_still_gives_a_report(fake_plugins: None, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MM3_CHECK_CONTRACTS", "bogus")
    reset_default_registry()
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"mm3 {mm3.__version__}") and "device: " in out
    assert "(registry): no distribution (entry point -), not loaded: ConfigError: invalid mm3 settings: " \
           "check_contracts (from env MM3_CHECK_CONTRACTS)" in out, out
