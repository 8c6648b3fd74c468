"""The testing kit: fp64 oracle, random step factories, mock backend, conformance suite.

Example:
    >>> from mm3.testing import MockBackend, make_case, oracle_topk, run_conformance
"""

from mm3.testing.factories import Case, make_case
from mm3.testing.mock import MockBackend
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk


def __getattr__(name: str):  # the conformance suite is heavier: load it on first use
    if name == "run_conformance":
        from mm3.testing.conformance import run_conformance
        return run_conformance
    raise AttributeError(f"module 'mm3.testing' has no attribute {name!r}")


__all__ = ["Case", "make_case", "MockBackend", "check_topk", "oracle_attention", "oracle_topk",
           "run_conformance"]
