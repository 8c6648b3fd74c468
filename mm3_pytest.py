"""mm3's pytest entry point (``pytest11``): inert unless a pytest run asks for mm3.

Installing mm3 puts this module into every pytest run of the environment,
whatever the project under test. So on its own it does nothing: it imports
neither mm3 nor torch, defines no fixture and touches no setting. It declares
the conformance suite's options (so that ``--mm3-backend`` parses anywhere)
and, when a run asks for mm3, loads the plugin itself,
:mod:`mm3.testing.pytest_plugin` (the fixtures, a fresh read of mm3's
settings per test). A run asks for mm3 with either of

* ``-p mm3`` on the command line, or ``addopts = "-p mm3"`` in the project's
  pytest configuration;
* ``--mm3-backend NAME``: the conformance suite,
  ``pytest --pyargs mm3.testing.conformance --mm3-backend NAME``.

A ``conftest.py`` may load the plugin directly instead:
``pytest_plugins = ["mm3.testing.pytest_plugin"]``. ``-p no:mm3`` removes
this module from a run.

This module lives outside the ``mm3`` package because importing any module
of a package imports the package first, and importing mm3 imports torch.
"""

from __future__ import annotations

from typing import Any

PLUGIN = "mm3.testing.pytest_plugin"
"""The module loaded when a run asks for mm3."""


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("mm3")
    group.addoption("--mm3-backend", action="append", default=[], metavar="NAME",
                    help="backend(s) the mm3 conformance suite runs against (repeatable; loads mm3's "
                         "pytest plugin)")
    group.addoption("--mm3-device", default="cpu", metavar="DEVICE",
                    help="torch device the mm3 conformance suite runs on (default: cpu)")
    group.addoption("--mm3-full", action="store_true", default=False,
                    help="mm3 conformance: every step in every dtype, and the bigger shapes (default: each "
                         "step once, the dtypes in turn)")
    group.addoption("--mm3-dtype", action="append", default=[], metavar="DTYPE",
                    help="mm3 conformance: attention dtype(s) to try (repeatable; default bf16, fp16, fp32)")
    group.addoption("--mm3-index-dtype", action="append", default=[], metavar="DTYPE",
                    help="mm3 conformance: index cache dtype(s) to try (repeatable; default bf16, fp8)")


def asked_for(config: Any) -> bool:
    """Does this run ask for mm3: ``-p mm3`` (command line or configured ``addopts``) or ``--mm3-backend``?"""
    return "mm3" in (config.getoption("plugins", None) or []) or bool(config.getoption("mm3_backend", None))


def pytest_configure(config: Any) -> None:
    if asked_for(config):
        config.pluginmanager.import_plugin(PLUGIN)
