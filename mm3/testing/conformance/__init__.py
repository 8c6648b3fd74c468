"""The mm3 conformance suite: does a backend compute what docs/spec.md says, on this device?

Two ways in:

* programmatic: :func:`run_conformance` returns a :class:`ConformanceReport`
  (one :class:`CaseResult` per case, ``report.format()`` prints them);
* pytest: ``pytest --pyargs mm3.testing.conformance --mm3-backend NAME``
  (options ``--mm3-device``, ``--mm3-full``, ``--mm3-dtype``, ``--mm3-index-dtype``).

Cases a backend cannot serve by its own declaration (an op it does not
provide, a dtype or shape outside its capabilities, a device its probe
refuses) are skipped, not failed. See :mod:`mm3.testing.conformance.cases`
for what each case checks.

Example:
    >>> from mm3.testing.conformance import run_conformance
    >>> report = run_conformance("cpu_ref", dtypes=["float32"], index_dtypes=["bfloat16"])
    >>> report.passed
    True
"""

from mm3.testing.conformance.cases import SENTINEL, TOLERANCES, CaseSpec, Step
from mm3.testing.conformance.report import CaseResult, ConformanceReport
from mm3.testing.conformance.suite import (
    DEFAULT_DTYPES, DEFAULT_INDEX_DTYPES, PlannedCase, plan_cases, run_conformance,
)

__all__ = [
    "run_conformance", "plan_cases", "PlannedCase", "ConformanceReport", "CaseResult",
    "CaseSpec", "Step", "TOLERANCES", "SENTINEL", "DEFAULT_DTYPES", "DEFAULT_INDEX_DTYPES",
]
