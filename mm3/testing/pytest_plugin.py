"""mm3's pytest plugin: its fixtures, per-test settings, and the conformance suite's backend.

It is loaded only where a pytest run asks for it (the ``pytest11`` entry
point, :mod:`mm3_pytest`, is inert otherwise): ``pytest -p mm3``,
``addopts = "-p mm3"`` in the project's pytest configuration,
``--mm3-backend NAME``, or ``pytest_plugins = ["mm3.testing.pytest_plugin"]``
in a ``conftest.py``. Then every test gets

* a fresh read of mm3's settings (``MM3_*`` variables a test sets apply to the
  layers it builds);
* the fixtures of :mod:`mm3.testing.fixtures`: ``mm3_registry`` (isolated
  registries), ``mock_backend``, ``mm3_params``, ``mm3_case``, ``mm3_batch``,
  ``mm3_caches``, ``mm3_clean_env``, ``mm3_conformance``; and
  ``mm3_conformance_backend`` / ``mm3_conformance_device`` for extra tests of
  the backend named on the command line (``--mm3-backend``, ``--mm3-device``).

See docs/testing.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import pytest

# Fixtures are found by name in a plugin module's namespace: importing them registers them.
from mm3.testing.fixtures import (  # noqa: F401
    mm3_batch, mm3_caches, mm3_case, mm3_clean_env, mm3_conformance, mm3_params, mm3_registry,
    mock_backend,
)

if TYPE_CHECKING:
    import torch

    from mm3.runtime.backend import Backend


@pytest.fixture(autouse=True)
def _mm3_fresh_settings() -> Iterator[None]:
    """mm3 reads its settings once per process; each test reads them afresh (after its own setenv)."""
    from mm3.runtime.config import reset_default_settings

    reset_default_settings()
    yield
    reset_default_settings()


def _backends(config: pytest.Config) -> list[str]:
    # The options belong to the entry point module; without it (-p no:mm3) there are none.
    return list(config.getoption("mm3_backend", None) or [])


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One header line naming the backends under test, when ``--mm3-backend`` is given."""
    names = _backends(config)
    if not names:
        return []
    return [f"mm3 conformance: backend(s) {', '.join(names)} on {config.getoption('mm3_device', 'cpu')}"
            + (" (full)" if config.getoption("mm3_full", False) else "")]


@pytest.fixture(scope="session")
def mm3_conformance_device(pytestconfig: pytest.Config) -> "torch.device":
    """The device given by ``--mm3-device`` (default cpu)."""
    import torch

    return torch.device(pytestconfig.getoption("mm3_device", "cpu"))


@pytest.fixture(scope="session")
def mm3_conformance_backend(pytestconfig: pytest.Config) -> "Backend":
    """The backend named by the first ``--mm3-backend`` (skips the test when none was given).

    Example (a plugin author's own extra test)::

        def test_my_extra_rule(mm3_conformance_backend, mm3_conformance_device):
            assert mm3_conformance_backend.probe(mm3_conformance_device).available
    """
    names = _backends(pytestconfig)
    if not names:
        pytest.skip("no backend given: pass --mm3-backend NAME")
    from mm3.runtime.registry import default_registry

    return default_registry().get(names[0])
