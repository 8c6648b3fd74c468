"""pytest plugin (entry point ``pytest11``): mm3's fixtures and the ``--mm3-backend`` option."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mm3")
    group.addoption("--mm3-backend", action="append", default=[], metavar="NAME",
                    help="backend(s) the mm3 conformance suite runs against (repeatable)")
