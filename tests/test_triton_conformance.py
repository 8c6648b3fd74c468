"""The mm3 conformance suite on both Triton plugins, under Triton's interpreter (CPU, fp16/fp32).

bf16 is left to the GPU run (tests/gpu): the interpreter computes bf16
arithmetic wrongly. The report of every case is printed on failure.
"""

from __future__ import annotations

import os

import pytest

from mm3.registry import Registry
from mm3_backends.cpu_ref import plugin as cpu_ref
from mm3_backends.cuda import plugin as cuda_plugin
from mm3_backends.rocm import plugin as rocm_plugin

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_conformance_quick_under_interpreter(backend: str) -> None:
    from mm3.testing.conformance import run_conformance

    reg = Registry(plugins=[cuda_plugin, rocm_plugin, cpu_ref], entry_points=False)
    report = run_conformance(reg.get(backend), device="cpu", quick=True, dtypes=["float16", "float32"],
                             index_dtypes=["float16", "float8_e4m3fn"])
    assert report.results, "the suite planned no case"
    assert report.passed, report.format()
    # nothing may be skipped: every case is inside what the plugin declares
    assert all(r.passed for r in report.results), report.format()
