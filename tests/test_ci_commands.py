"""CI runs what README says, and between its two commands every test runs.

``.ci/run`` takes README's commands verbatim: the install and the default run
(``python -m pytest``, which pyproject.toml's ``-m 'not slow'`` keeps to the
quick checks), then the expensive checks (``python -m pytest -m slow``).
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_readme_default_run_then_the_slow_checks() -> None:
    r = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--print"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    default, slow = r.stdout.splitlines()
    assert default.startswith("pip install ") and default.endswith(" && python -m pytest"), default
    assert slow == "python -m pytest -m slow", slow
    with open(REPO / "pyproject.toml", "rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not slow'" in addopts, addopts      # the default run leaves out exactly what the second runs
