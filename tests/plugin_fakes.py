"""Plugin test helpers shared by several test files.

* :class:`FakeEntryPoint`: the registry discovers plugins through
  ``mm3.runtime.discovery.list_entry_points``; tests replace that function with one
  returning these, so discovery, load failures and provenance (distribution
  name and version) can be exercised without installing anything.
* :func:`subprocess_env`: the environment for running mm3 in a subprocess
  against plugins installed into a separate site directory.
* :func:`backends_row`: one backend's row of the ``mm3 backends`` table.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["FakeDist", "FakeEntryPoint", "subprocess_env", "backends_row"]


@dataclass
class FakeDist:
    name: str
    version: str


class FakeEntryPoint:
    """Quacks like ``importlib.metadata.EntryPoint`` (name, value, dist, load).

    ``target`` is what ``load()`` returns, or raises if it is an exception;
    ``counter`` (a list) records each load by name.
    """

    def __init__(self, name: str, target: Any, dist: str = "mm3", version: str = "0.1.0",
                 counter: Optional[list] = None, value: Optional[str] = None) -> None:
        self.name = name
        self.value = value or f"fake_pkg.{name}"
        self.dist = FakeDist(dist, version)
        self._target = target
        self._counter = counter

    def load(self) -> Any:
        if self._counter is not None:
            self._counter.append(self.name)
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


def subprocess_env(site: Optional[Path] = None, **extra: str) -> dict[str, str]:
    """This process's environment without mm3 settings or the Triton interpreter, with ``site`` (if any) on the path."""
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("MM3_") and k != "TRITON_INTERPRET"}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def backends_row(table: str, name: str) -> Optional[list[str]]:
    """The cells of backend ``name``'s row in ``mm3 backends``' table (split on 2+ spaces), or None."""
    for line in table.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] == name and len(cells) >= 8:
            return cells
    return None


def pip_install_into(src: Path, target: Path) -> None:
    """``pip install`` the project at ``src`` into the folder ``target`` (offline, no dependencies):
    a plugin installed the way a user's would be, importable by adding ``target`` to the path."""
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install of {src} failed:\n{r.stdout}\n{r.stderr}"
