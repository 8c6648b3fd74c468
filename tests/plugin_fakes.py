"""Stand-ins for ``importlib.metadata`` entry points, shared by the registry, selection and CLI tests.

The registry discovers plugins through ``mm3.registry.list_entry_points``;
tests replace that function with one returning these, so discovery, load
failures and provenance (distribution name and version) can be exercised
without installing anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["FakeDist", "FakeEntryPoint"]


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
