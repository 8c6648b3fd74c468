"""Plugin test helpers shared by several test files.

* :class:`FakeEntryPoint`: the registry discovers plugins through
  ``mm3.runtime.discovery.list_entry_points``; tests replace that function with one
  returning these, so discovery, load failures and provenance (distribution
  name and version) can be exercised without installing anything.
* :func:`subprocess_env`: the environment for running mm3 in a subprocess
  against plugins installed into a separate site directory.
* :func:`backends_row`: one backend's row of the ``mm3 backends`` table.
* :func:`pip_install_into` (a ``--target`` folder) and :func:`throwaway_venv` (a
  virtual environment of its own): where tests install packages, so the
  environment running the tests is never installed into or uninstalled from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["FakeDist", "FakeEntryPoint", "subprocess_env", "backends_row", "pip_install_into", "throwaway_venv",
           "PIP_OFFLINE"]

# pip, offline and without dependencies or a wheel cache: what tests install is built from a local folder
PIP_OFFLINE = ["-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]


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
        [sys.executable, *PIP_OFFLINE, "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install of {src} failed:\n{r.stdout}\n{r.stderr}"


def throwaway_venv(root: Path) -> Path:
    """A new virtual environment in ``root`` that sees this one's packages; returns its interpreter.

    Its own site-packages comes first and is where ``pip`` (run by that interpreter) installs; the
    site directories of the running environment follow (mm3, torch, pip, setuptools...), added by a
    ``.pth`` file that processes their own ``.pth`` files too (editable installs). A package the
    test installs there shadows one of the same name installed here, and is gone with ``root``.
    """
    venv.create(root, with_pip=False, symlinks=os.name != "nt")
    python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    # One line ("import ..." lines of a .pth run at start-up); "zz" sorts it after the venv's own .pth files.
    Path(purelib, "zz_running_environment.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in ours) + "\n")
    return python
