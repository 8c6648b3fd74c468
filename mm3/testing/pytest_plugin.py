"""pytest plugin (entry point ``pytest11``): mm3's fixtures and the conformance options.

Installing mm3 makes this plugin load in every pytest run of the environment,
so a backend or engine project gets, with no conftest.py:

* a fresh read of mm3's settings for every test (``MM3_*`` variables a test
  sets apply to the layers it builds);
* the fixtures of :mod:`mm3.testing.fixtures`: ``mm3_registry`` (isolated
  registries), ``mock_backend``, ``mm3_params``, ``mm3_case``, ``mm3_batch``,
  ``mm3_caches``, ``mm3_clean_env``, ``mm3_conformance``; and
  ``mm3_conformance_backend`` / ``mm3_conformance_device`` for extra tests of
  the backend named on the command line;
* the options of the conformance suite, run with
  ``pytest --pyargs mm3.testing.conformance --mm3-backend NAME``
  (``--mm3-device``, ``--mm3-full``, ``--mm3-dtype``, ``--mm3-index-dtype``).

``pytest -p no:mm3`` turns it off. See docs/testing.md.
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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mm3")
    group.addoption("--mm3-backend", action="append", default=[], metavar="NAME",
                    help="backend(s) the mm3 conformance suite runs against (repeatable)")
    group.addoption("--mm3-device", default="cpu", metavar="DEVICE",
                    help="torch device the mm3 conformance suite runs on (default: cpu)")
    group.addoption("--mm3-full", action="store_true", default=False,
                    help="mm3 conformance: every step in every dtype, and the bigger shapes (default: each "
                         "step once, the dtypes in turn)")
    group.addoption("--mm3-dtype", action="append", default=[], metavar="DTYPE",
                    help="mm3 conformance: attention dtype(s) to try (repeatable; default bf16, fp16, fp32)")
    group.addoption("--mm3-index-dtype", action="append", default=[], metavar="DTYPE",
                    help="mm3 conformance: index cache dtype(s) to try (repeatable; default bf16, fp8)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One header line naming the backends under test, when ``--mm3-backend`` is given."""
    names = config.getoption("--mm3-backend")
    if not names:
        return []
    return [f"mm3 conformance: backend(s) {', '.join(names)} on {config.getoption('--mm3-device')}"
            + (" (full)" if config.getoption("--mm3-full") else "")]


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
    from mm3.runtime.registry import default_registry

    return default_registry().get(names[0])
