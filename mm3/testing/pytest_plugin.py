"""pytest plugin (entry point ``pytest11``): mm3's fixtures and the ``--mm3-backend`` option."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

    from mm3.registry import Backend


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mm3")
    group.addoption("--mm3-backend", action="append", default=[], metavar="NAME",
                    help="backend(s) the mm3 conformance suite runs against (repeatable)")
    group.addoption("--mm3-device", default="cpu", metavar="DEVICE",
                    help="torch device the mm3 conformance suite runs on (default: cpu)")
    group.addoption("--mm3-full", action="store_true", default=False,
                    help="mm3 conformance: add the bigger shapes (default: tiny shapes only)")
    group.addoption("--mm3-dtype", action="append", default=[], metavar="DTYPE",
                    help="mm3 conformance: attention dtype(s) to try (repeatable; default bf16, fp16, fp32)")
    group.addoption("--mm3-index-dtype", action="append", default=[], metavar="DTYPE",
                    help="mm3 conformance: index cache dtype(s) to try (repeatable; default bf16, fp8)")


@pytest.fixture(scope="session")
def mm3_conformance_device(pytestconfig: pytest.Config) -> "torch.device":
    """The device given by ``--mm3-device`` (default cpu)."""
    import torch

    return torch.device(pytestconfig.getoption("--mm3-device"))


@pytest.fixture(scope="session")
def mm3_conformance_backend(pytestconfig: pytest.Config) -> "Backend":
    """The backend named by the first ``--mm3-backend`` (skips the test when none was given).

    Example (a plugin author's own extra test)::

        def test_my_extra_rule(mm3_conformance_backend, mm3_conformance_device):
            assert mm3_conformance_backend.probe(mm3_conformance_device).available
    """
    names = pytestconfig.getoption("--mm3-backend")
    if not names:
        pytest.skip("no backend given: pass --mm3-backend NAME")
    from mm3.registry import default_registry

    return default_registry().get(names[0])
