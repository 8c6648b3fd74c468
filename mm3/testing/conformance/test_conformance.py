"""The conformance suite as pytest tests: one test per case per backend.

Run it against installed backends::

    pytest --pyargs mm3.testing.conformance --mm3-backend cpu_ref
    pytest --pyargs mm3.testing.conformance --mm3-backend cuda --mm3-device cuda --mm3-full

Options (from mm3's pytest plugin): ``--mm3-backend NAME`` (repeatable),
``--mm3-device`` (default ``cpu``), ``--mm3-full`` (add bigger shapes),
``--mm3-dtype`` / ``--mm3-index-dtype`` (repeatable; restrict the dtypes).
Cases a backend cannot serve by its declaration are reported as skipped.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest

from mm3.testing.conformance.suite import PlannedCase, plan_cases


def _option(config: pytest.Config, name: str, default: Any) -> Any:
    try:
        value = config.getoption(name)
    except ValueError:  # mm3's pytest plugin disabled (-p no:mm3)
        return default
    return default if value is None else value


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mm3_conformance_case" not in metafunc.fixturenames:
        return
    cfg = metafunc.config
    names: list[str] = list(_option(cfg, "--mm3-backend", []))
    device = _option(cfg, "--mm3-device", "cpu")
    quick = not _option(cfg, "--mm3-full", False)
    dtypes = _option(cfg, "--mm3-dtype", []) or None
    index_dtypes = _option(cfg, "--mm3-index-dtype", []) or None
    planned: list[Optional[PlannedCase]] = []
    if names:
        from mm3.contract.errors import MM3Error
        from mm3.runtime.registry import default_registry

        reg = default_registry()
        for name in names:
            try:
                planned += plan_cases(reg.get(name), device=device, quick=quick, dtypes=dtypes,
                                      index_dtypes=index_dtypes)
            except MM3Error as e:
                raise pytest.UsageError(f"--mm3-backend {name}: {e}") from None
    if not planned:
        planned = [None]
    ids = [f"{c.backend.name}:{c.name}" if c is not None else "no-backend" for c in planned]
    metafunc.parametrize("mm3_conformance_case", planned, ids=ids)


def test_conformance(mm3_conformance_case: Optional[PlannedCase]) -> None:
    case = mm3_conformance_case
    if case is None:
        pytest.skip("no backend to check: pass --mm3-backend NAME (see `mm3 backends` for names)")
    result = case.run()
    if result.skipped:
        pytest.skip(result.message)
    if result.failed:
        tb = result.details.get("traceback", "")
        pytest.fail(result.describe() + (f"\n{tb}" if tb else ""), pytrace=False)
