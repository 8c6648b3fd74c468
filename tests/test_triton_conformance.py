"""The mm3 conformance suite on both Triton plugins, under Triton's interpreter (CPU, fp16/fp32).

bf16 is left to the GPU run (tests/gpu): the interpreter computes bf16
arithmetic wrongly. The report of every case is printed on failure.
"""

from __future__ import annotations

import os

import pytest

from mm3.runtime.registry import Registry
from mm3_backends.cpu_ref import plugin as cpu_ref
from mm3_backends.cuda import plugin as cuda_plugin
from mm3_backends.rocm import plugin as rocm_plugin

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]


# The interpreter is slow on 2 cores: each plugin takes one attention dtype and one index
# dtype, and between them they cover fp16 + fp32 attention and fp16 + fp8 index caches
# in both top-k layouts (cuda writes token-major, rocm head-major).
@pytest.mark.parametrize("backend,dtype,index_dtype", [("cuda", "float16", "float8_e4m3fn"),
                                                       ("rocm", "float32", "float16")])
def test_conformance_quick_under_interpreter(backend: str, dtype: str, index_dtype: str) -> None:
    from mm3.testing.conformance import run_conformance

    reg = Registry(plugins=[cuda_plugin, rocm_plugin, cpu_ref], entry_points=False)
    report = run_conformance(reg.get(backend), device="cpu", quick=True, dtypes=[dtype],
                             index_dtypes=[index_dtype])
    assert report.results, "the suite planned no case"
    assert report.passed, report.format()
    # nothing may be skipped: every case is inside what the plugin declares
    assert all(r.passed for r in report.results), report.format()
