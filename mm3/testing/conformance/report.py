"""Results of a conformance run: one :class:`CaseResult` per case, gathered in a report.

Example:
    >>> r = ConformanceReport("mine", "cpu", [
    ...     CaseResult("attention/mixed[bfloat16]", "attention", "pass", elapsed=0.01,
    ...                details={"mean_err": 1e-4, "max_err": 3e-3}),
    ...     CaseResult("indexer/mixed[float8_e4m3fn]", "indexer", "skip",
    ...                message="index cache dtype float8_e4m3fn not in ['bfloat16']")])
    >>> r.passed, len(r.ran), len(r.skipped)
    (True, 1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CaseResult", "ConformanceReport", "Status"]

Status = Literal["pass", "fail", "skip"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one conformance case.

    ``details`` holds the numbers behind the verdict (errors against the
    oracle and their tolerances, bad top-k rows, timings); ``message`` says
    why a case failed or was skipped; ``elapsed`` is the case's wall time in
    seconds (inputs, backend calls and oracle).
    """

    name: str
    kind: str
    status: Status
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    elapsed: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    @property
    def skipped(self) -> bool:
        return self.status == "skip"

    def describe(self) -> str:
        """One line: status, name, time, message and the headline numbers."""
        shown = {k: v for k, v in self.details.items() if k != "traceback"}
        nums = ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
        parts = [f"{self.status.upper():4} {self.name}", f"({self.elapsed * 1e3:.0f} ms)"]
        if self.message:
            parts.append(f"- {self.message}")
        if nums:
            parts.append(f"[{nums}]")
        return " ".join(parts)


@dataclass
class ConformanceReport:
    """Every case result of one backend on one device.

    ``passed`` is True when no case failed and at least one ran: a backend
    whose every case was skipped has not shown anything.
    """

    backend: str
    device: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.failed]

    @property
    def skipped(self) -> list[CaseResult]:
        return [r for r in self.results if r.skipped]

    @property
    def ran(self) -> list[CaseResult]:
        return [r for r in self.results if not r.skipped]

    @property
    def passed(self) -> bool:
        return not self.failures and bool(self.ran)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def format(self, *, show_skipped: bool = True) -> str:
        """A per-case printout and a summary line."""
        lines = [f"mm3 conformance: backend {self.backend!r} on {self.device}"]
        for r in self.results:
            if r.skipped and not show_skipped:
                continue
            lines.append("  " + r.describe())
        n_pass = sum(r.passed for r in self.results)
        verdict = "PASSED" if self.passed else ("NOTHING RAN" if not self.ran else "FAILED")
        lines.append(f"{verdict}: {n_pass} passed, {len(self.failures)} failed, {len(self.skipped)} skipped "
                     f"in {sum(r.elapsed for r in self.results):.1f} s")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
