"""Installing mm3 leaves the pytest runs of every other project in the environment alone.

mm3's ``pytest11`` entry point (``mm3_pytest``) is loaded into every pytest run.
An unrelated project's run must not import mm3 (nor torch through it), get an
autouse fixture or a fixture of mm3's, or have mm3 read its settings. The same
probe, run with ``-p mm3``, shows the plugin at work: that is what the first
test would see if the entry point loaded it unasked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = textwrap.dedent('''
    import json, os, sys

    def test_probe(request, pytestconfig):
        seen = {
            "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("mm3", "mm3_backends", "torch")),
            "plugin": pytestconfig.pluginmanager.get_plugin("mm3.testing.pytest_plugin") is not None,
            "fixtures": sorted(n for n in request.fixturenames if "mm3" in n),
        }
        try:
            request.getfixturevalue("mm3_params")
            seen["mm3_params"] = True
        except Exception:
            seen["mm3_params"] = False
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(seen, f)
''')


def _probe(tmp_path: Path, *args: str) -> dict:
    project = tmp_path / "unrelated"
    project.mkdir()
    (project / "test_unrelated.py").write_text(PROBE)
    out = tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MM3_"))}
    env["PROBE_OUT"] = str(out)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=project,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def test_an_unrelated_projects_run_is_untouched(tmp_path: Path) -> None:
    seen = _probe(tmp_path)
    assert seen == {"modules": [], "plugin": False, "fixtures": [], "mm3_params": False}, seen


@pytest.mark.slow   # a pytest run in a subprocess
def test_the_same_probe_sees_the_plugin_when_a_run_asks_for_it(tmp_path: Path) -> None:
    seen = _probe(tmp_path, "-p", "mm3")
    assert seen["plugin"] and seen["mm3_params"], seen
    assert "_mm3_fresh_settings" in seen["fixtures"] and "mm3" in seen["modules"], seen


def test_mm3_backend_asks_for_it_too() -> None:
    """``--mm3-backend`` (the conformance suite's option) loads the plugin; no option, no plugin."""
    import mm3_pytest

    class Config:
        def __init__(self, **options: object) -> None:
            self.options = options

        def getoption(self, name: str, default: object = None) -> object:
            return self.options.get(name, default)

    assert mm3_pytest.asked_for(Config(mm3_backend=["cpu_ref"]))
    assert mm3_pytest.asked_for(Config(plugins=["xdist", "mm3"]))
    assert not mm3_pytest.asked_for(Config(plugins=["no:mm3x", "mm3x"], mm3_backend=[]))


@pytest.mark.parametrize("module", ["mm3_pytest"])
def test_the_entry_point_module_imports_nothing_of_mm3(module: str) -> None:
    r = subprocess.run([sys.executable, "-c", f"import sys, {module}; "
                        "print([m for m in sys.modules if m.split('.')[0] in ('mm3', 'torch')])"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_plain_helpers_need_no_pytest() -> None:
    """docs/plugins.md's try-it step runs where only mm3 is installed: its helpers import no pytest."""
    code = ("import sys, mm3.testing.helpers, mm3.testing.oracle, mm3.testing.factories; "
            "print([m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest')])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
