"""Plugin test helpers shared by several test files.

* :class:`FakeEntryPoint`: the registry discovers plugins through
  ``mm3.runtime.discovery.list_entry_points``; tests replace that function with one
  returning these, so discovery, load failures and provenance (distribution
  name and version) can be exercised without installing anything.
* :func:`subprocess_env`: the environment for running mm3 in a subprocess
  against plugins installed into a separate site directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["FakeDist", "FakeEntryPoint", "subprocess_env"]


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


def subprocess_env(site: Path, **extra: str) -> dict[str, str]:
    """This process's environment without mm3 settings or the Triton interpreter, with ``site`` on the path."""
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("MM3_") and k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env
