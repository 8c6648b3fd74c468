"""The mm3 conformance suite on both Triton plugins, under Triton's interpreter (CPU), bf16 included.

The interpreter's bf16 (and e4m3 NaNs) are made right by
backends/triton/interpreter.py, which the kernels' import installs, as for
``TRITON_INTERPRET=1 mm3 check``: so the verdicts here are the ones a user
gets, bf16 included (without it the bf16 cases fail on right kernels, and an
e4m3 NaN key is no NaN). The report of every case is printed on failure.
"""

from __future__ import annotations

import os

import pytest

from mm3.runtime.registry import Registry
from mm3.testing.conformance.quant_cases import QUANT_CASES
from mm3_backends.cpu_ref import plugin as cpu_ref
from mm3_backends.cuda import plugin as cuda_plugin
from mm3_backends.rocm import plugin as rocm_plugin

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU-interpreter tests; a GPU machine runs tests/gpu instead"),
]


ALL_KINDS = ("indexer", "attention", "buffer", "composed", "scores", "contents")
# (plugin, attention dtype, index cache dtype, case kinds): between them every attention dtype and
# every index cache dtype but fp32, in both top-k layouts (cuda writes token-major, rocm head-major).
# Each run is the quick plan of one dtype pair: every step of its kinds. The bf16 runs take the kinds
# that reach each kernel in bf16 once (the composed steps run the indexer and the attention): cuda's
# bf16 dots in both, its fp16 dots of bf16 queries on fp8 K/V; rocm's fp8 index keys widened to bf16
# (ties and e4m3 NaN keys included), its grid decode and token-tile prefill in bf16; cuda's block scores
# (index_scores) in bf16 as well. One test per
# case, so a parallel run (pytest-xdist) spreads them and a failure names its case.
RUNS = (("cuda", "float16", "float8_e4m3fn", ALL_KINDS), ("rocm", "float32", "float16", ALL_KINDS),
        ("cuda", "bfloat16", "bfloat16", ("attention", "composed", "scores")),
        ("rocm", "bfloat16", "float8_e4m3fn", ("indexer", "composed")))
def _registry() -> Registry:
    return Registry(plugins=[cuda_plugin, rocm_plugin, cpu_ref], entry_points=False)


def _plan(backend: str, dtype: str, index_dtype: str, registry: Registry) -> list:
    from mm3.testing.conformance import plan_cases

    return plan_cases(registry.get(backend), device="cpu", quick=True, dtypes=[dtype], index_dtypes=[index_dtype])


# Planning builds no input and runs no kernel: cheap enough for collection. Every case of the authors'
# formats (NVFP4 K/V and index keys, fp8 queries, unscaled e4m3) is among them, and every token-slot case:
# both plugins declare them all.
CASES = [(backend, dtype, index_dtype, case.name) for backend, dtype, index_dtype, kinds in RUNS
         for case in _plan(backend, dtype, index_dtype, _registry()) if case.name.split("/")[0] in kinds]


def test_every_run_plans_its_case_kinds() -> None:
    for backend, dtype, index_dtype, want in RUNS:
        kinds = {name.split("/")[0] for b, d, i, name in CASES if (b, d, i) == (backend, dtype, index_dtype)}
        assert kinds == set(want), (backend, dtype, kinds)


def test_every_case_of_the_authors_formats_runs_on_both_plugins() -> None:
    """NVFP4 K/V and index keys included (run with every kind: cuda in fp16, rocm in fp32), none skipped."""
    for backend, dtype in (("cuda", "float16"), ("rocm", "float32")):
        quant = {name.split("/")[1].split(":")[0] for b, d, _, name in CASES if (b, d) == (backend, dtype)}
        assert set(QUANT_CASES) <= quant, (backend, sorted(set(QUANT_CASES) - quant))


def _default_run(case: str) -> bool:
    """The cases the default run keeps: every indexer and contents case and the composed mixed step (both
    kernels of a plugin in one step) outside bf16. The rest — the attention and buffer cases, the other composed
    steps — are the interpreter's slowest minutes and run with ``-m slow`` (CI runs both)."""
    kind = case.split("/")[0]
    return kind in ("indexer", "contents") or (case.startswith("composed/mixed") and "bfloat16" not in case)


@pytest.mark.parametrize("backend,dtype,index_dtype,case",
                         [pytest.param(*c, marks=() if _default_run(c[3]) else pytest.mark.slow) for c in CASES],
                         ids=[f"{b}-{c}" for b, _, _, c in CASES])
def test_conformance_case_under_interpreter(backend: str, dtype: str, index_dtype: str, case: str) -> None:
    from mm3.testing.conformance import ConformanceReport

    planned = [c for c in _plan(backend, dtype, index_dtype, _registry()) if c.name == case]
    assert len(planned) == 1, f"{case!r} is planned {len(planned)} times"
    report = ConformanceReport(backend, "cpu", [planned[0].run()])
    # nothing may be skipped: every case is inside what the plugin declares
    assert report.passed and all(r.passed for r in report.results), report.format()


def test_per_slot_scales_are_among_the_cases() -> None:
    """The fp8 K/V cases with scales per token slot reach both plugins' attention (they declare
    kv_slot_scales): in the decode kernels (cuda's persistent one, rocm's grid) and both prefill ones."""
    slot = {(b, name.split("/")[-1].split(":")[0]) for b, _, _, name in CASES if "kv_fp8_slot" in name}
    assert {("cuda", "kv_fp8_slot_mixed"), ("rocm", "kv_fp8_slot_mixed"),
            ("cuda", "kv_fp8_slot_spec_decode_hnd"), ("rocm", "kv_fp8_slot_spec_decode_hnd")} <= slot, slot


def test_token_slot_cases_run_on_both_plugins() -> None:
    """The plugins declare addressings "slots": every token-slot case of a run's kinds is planned, none skipped."""
    for backend, dtype, index_dtype, kinds in RUNS:
        slots = [c for c in _plan(backend, dtype, index_dtype, _registry())
                 if "token_slots" in c.name and c.name.split("/")[0] in kinds]
        assert slots and not [c.name for c in slots if c.skip], (backend, dtype)
        assert {c.name for c in slots} <= {n for b, d, i, n in CASES if (b, d, i) == (backend, dtype, index_dtype)}
