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
# in both top-k layouts (cuda writes token-major, rocm head-major). The planted-tie cases
# (docs/spec.md §3.5) run on the GPU for both; here the two plugins, which share the indexer
# kernel, split them. rocm takes the NaN one: the interpreter turns an fp8 e4m3fn NaN
# (0x7f) into 480.0, so a NaN key in cuda's fp8 index cache would not be a NaN here.
ONLY_ON_GPU = {"cuda": ("exact_ties_half_tied", "exact_ties_nan_pages"),
               "rocm": ("exact_ties_all_equal", "exact_ties_duplicated_pages")}


@pytest.mark.parametrize("backend,dtype,index_dtype", [("cuda", "float16", "float8_e4m3fn"),
                                                       ("rocm", "float32", "float16")])
def test_conformance_quick_under_interpreter(backend: str, dtype: str, index_dtype: str) -> None:
    from mm3.testing.conformance import ConformanceReport, plan_cases

    reg = Registry(plugins=[cuda_plugin, rocm_plugin, cpu_ref], entry_points=False)
    plan = plan_cases(reg.get(backend), device="cpu", quick=True, dtypes=[dtype], index_dtypes=[index_dtype])
    left_out = [c for c in plan if c.name.split("/")[-1].split(":")[0] in ONLY_ON_GPU[backend]]
    assert len(left_out) == 2, [c.name for c in plan]
    report = ConformanceReport(backend, "cpu", [c.run() for c in plan if c not in left_out])
    assert report.results, "the suite planned no case"
    assert report.passed, report.format()
    # nothing may be skipped: every case is inside what the plugin declares
    assert all(r.passed for r in report.results), report.format()
