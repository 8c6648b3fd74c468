"""The conformance suite on cpu_ref and on mocks: layout negotiation, skips, and that it can fail.

* cpu_ref (head-major) passes every case;
* a token-major MockBackend delegating to cpu_ref passes too: the suite hands
  every backend buffers in its own declared layout, and the "other layout"
  cases hand it the layout it did not ask for;
* a token-major mock that *requires* a contiguous buffer (and rejects anything
  else) passes: the suite converts head-major buffers for it, as the core does;
* each injected fault makes the cases that should catch it fail.
"""

from __future__ import annotations

import subprocess
import sys
import pytest

import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3.runtime.backend import Backend
from mm3.runtime.registry import Registry
from mm3.testing.conformance import (
    CaseResult, ConformanceReport, PlannedCase, plan_cases, run_conformance,
)
from mm3.testing.mock import MockBackend


def _bind(plugin: object, name: str) -> Backend:
    return Registry(plugins=[plugin], entry_points=False).get(name)


CPU_REF = _bind(cpu_ref, "cpu_ref")
TOKEN_MAJOR = _bind(MockBackend("mock_token_major", topk_layout="token_major"), "mock_token_major")
CONTIGUOUS = _bind(MockBackend("mock_tm_contiguous", topk_layout="token_major", topk_requires_contiguous=True),
                   "mock_tm_contiguous")


def _run(case: PlannedCase) -> CaseResult:
    result = case.run()
    assert not result.failed, result.describe() + "\n" + result.details.get("traceback", "")
    return result


@pytest.mark.parametrize("case", plan_cases(CPU_REF, quick=False), ids=lambda c: c.name)
def test_cpu_ref(case: PlannedCase) -> None:
    assert not case.skip, f"cpu_ref declares everything the full plan asks for, got skip: {case.skip}"
    assert _run(case).passed


def _step_ops(plan: list[PlannedCase]) -> list[PlannedCase]:
    """The cases of a step's two ops: the mocks declare those (index_scores: tests/test_index_scores.py)."""
    return [c for c in plan if not c.name.startswith("scores/")]


@pytest.mark.parametrize("case", _step_ops(plan_cases(TOKEN_MAJOR, dtypes=["bfloat16", "float32"])),
                         ids=lambda c: c.name)
def test_token_major_mock(case: PlannedCase) -> None:
    assert not case.skip
    result = _run(case)
    if "layout" in result.details:
        expect = "head_major" if "other_layout" in case.name else "token_major"
        assert result.details["layout"] == expect


@pytest.mark.parametrize("case", _step_ops(plan_cases(CONTIGUOUS, dtypes=["bfloat16"])), ids=lambda c: c.name)
def test_contiguous_token_major_mock(case: PlannedCase) -> None:
    result = _run(case)
    if case.name.startswith("buffer/indexer_writes_other_layout"):
        assert result.skipped and "topk_requires_contiguous" in result.message
    else:
        assert result.passed
        given = result.details.get("topk_given")
        if given is not None:  # converted by the suite, never handed a strided/other-layout view
            assert given == "token_major"


def test_contiguous_mock_really_rejects_head_major_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the suite's conversion the strict mock fails: the conversion above is what passed."""
    from mm3.testing.conformance import cases as cases_mod

    plan = plan_cases(CONTIGUOUS, dtypes=["bfloat16"])
    case = next(c for c in plan if c.name.startswith("buffer/attention_reads_other_layout_h2"))
    monkeypatch.setattr(cases_mod, "_to_consumer", lambda ctx, buf: buf)
    result = case.run()
    assert result.failed and "to_layout('token_major')" in result.message


# -- the suite catches broken backends ----------------------------------------------------------------

SUBSET = dict(dtypes=["float32"], index_dtypes=["bfloat16"])


def _failures(fault: str, layout: str = "head_major") -> dict[str, str]:
    name = f"faulty_{fault}_{layout}"
    be = _bind(MockBackend(name, topk_layout=layout, fault=fault), name)  # type: ignore[arg-type]
    report = run_conformance(be, **SUBSET)  # type: ignore[arg-type]
    assert not report.passed
    return {r.name: r.message for r in report.failures}


def test_suite_catches_wrong_layout_storage_only_with_several_heads() -> None:
    for layout in ("head_major", "token_major"):
        failed = _failures("wrong_layout", layout)
        assert "buffer/sentinel_rows_h2:bfloat16" in failed          # the mislabelled buffer is refused
        assert f"as {layout!r} storage" in failed["buffer/sentinel_rows_h2:bfloat16"]
        assert "buffer/indexer_writes_other_layout_h2:bfloat16" in failed    # the layout-blind writer
        assert "buffer/sentinel_rows_h1:bfloat16" not in failed     # one head: same memory map
        assert "indexer/mixed_h1:bfloat16" not in failed


def test_suite_catches_out_of_range_ids() -> None:
    failed = _failures("out_of_range")
    assert "indexer/mixed_h2:bfloat16" in failed and "outside" in failed["indexer/mixed_h2:bfloat16"]
    assert any(n.startswith("composed/") for n in failed)
    assert not any(n.startswith("attention/") for n in failed)


def test_suite_catches_rows_out_of_the_declared_order() -> None:
    """An indexer that declares topk_order="ascending" is taken at its word (nothing sorts its rows for
    SGLang's callers or an ascending attention), so the suite checks it; one that declares score order
    promises none."""
    name = "faulty_unordered_ascending"
    be = _bind(MockBackend(name, topk_order="ascending", fault="unordered"), name)
    failed = {r.name: r.message for r in run_conformance(be, **SUBSET).failures}  # type: ignore[arg-type]
    assert "not ascending" in failed["indexer/mixed_h2:bfloat16"], failed
    assert any(n.startswith("composed/") and "not ascending" in m for n, m in failed.items()), failed
    assert not any(n.startswith("attention/") for n in failed), failed
    name = "unordered_score"
    be = _bind(MockBackend(name, topk_order="score", fault="unordered"), name)
    assert run_conformance(be, **SUBSET).passed  # type: ignore[arg-type]


def test_suite_catches_writes_past_the_step() -> None:
    failed = _failures("write_past_rows")
    assert "past the step's rows" in failed["buffer/sentinel_rows_h1:bfloat16"]
    assert "indexer/spec_decode_q2:bfloat16" in failed


def test_suite_catches_nan_output() -> None:
    failed = _failures("nan_output")
    assert "non-finite output" in failed["attention/mixed_h2_g2:float32"] or \
        "padding" in failed["attention/mixed_h2_g2:float32"]
    assert not any(n.startswith("indexer/") for n in failed)


def test_suite_reports_backend_exceptions_as_failures() -> None:
    failed = _failures("raise")
    assert failed and all("MockFault" in m for m in failed.values())


def test_suite_catches_inaccurate_attention() -> None:
    """An attention 3e-3 off on every element fails docs/spec.md §4's mean tolerance and says by how much."""
    import torch

    class Sloppy:
        def index_topk(self, *a: object) -> None:
            cpu_ref.index_topk(*a)  # type: ignore[arg-type]

        def attention_forward(self, q, caches, topk, batch, params, out) -> None:  # type: ignore[no-untyped-def]
            cpu_ref.attention_forward(q, caches, topk, batch, params, out)
            real = batch.token_positions >= 0
            out[real] += torch.randn_like(out[real]) * 3e-3

    be = _bind(MockBackend("sloppy", delegate=Sloppy()), "sloppy")
    report = run_conformance(be, dtypes=["bfloat16"], index_dtypes=["bfloat16"])
    failed = {r.name: r for r in report.failures}
    assert "attention/mixed_h1_g8:bfloat16" in failed
    assert failed["attention/mixed_h1_g8:bfloat16"].details["mean_err"] > 3e-4


# -- skips and reports --------------------------------------------------------------------------------


def test_undeclared_ops_and_dtypes_are_skipped_not_failed() -> None:
    be = _bind(MockBackend("att_only", ops={"attention"}, dtypes={"float32"}), "att_only")
    report = run_conformance(be, dtypes=["bfloat16", "float32"], index_dtypes=["bfloat16"])
    assert report.passed, report.format()
    skipped = {r.name: r.message for r in report.skipped}
    assert "does not provide ['index_topk']" in skipped["indexer/mixed_h1:bfloat16"]
    assert "dtype bfloat16 not in ['float32']" in skipped["attention/mixed_h1_g8:bfloat16"]
    assert all(r.name.startswith(("attention/", "buffer/attention")) for r in report.ran)


def test_unavailable_backend_runs_nothing() -> None:
    be = _bind(MockBackend("off", available=False, probe_reason="no device here"), "off")
    report = run_conformance(be, **SUBSET)  # type: ignore[arg-type]
    assert not report.ran and not report.passed
    assert all("no device here" in r.message for r in report.skipped if not r.name.startswith("scores/"))
    assert all("does not provide ['index_scores']" in r.message for r in report.skipped
               if r.name.startswith("scores/"))
    assert "NOTHING RAN" in report.format()


def test_report_format_lists_every_case() -> None:
    report = run_conformance(CPU_REF, dtypes=["float32"], index_dtypes=["float8_e4m3fn"])
    assert isinstance(report, ConformanceReport) and report.passed
    text = report.format()
    assert text.count("\n") == len(report) + 1 and "PASSED" in text
    assert "PASS attention/chunked_prefill:float32" in text and "mean_err=" in text


def test_reference_indexer_feeds_attention_cases() -> None:
    mock = MockBackend("ref_idx")
    ref = _bind(mock, "ref_idx")
    report = run_conformance(CPU_REF, dtypes=["float32"], index_dtypes=["bfloat16"], reference_indexer=ref)
    assert report.passed
    assert len(mock.calls_to("index_topk")) == sum(
        r.name.startswith(("attention/", "buffer/attention")) for r in report.ran)


def test_unknown_dtype_is_an_input_error() -> None:
    from mm3.contract.errors import InputError

    with pytest.raises(InputError, match="float64"):
        plan_cases(CPU_REF, dtypes=["float64"])


@pytest.mark.slow   # a pytest run in a subprocess
def test_pytest_entry_point() -> None:
    # -n 0: run from this repository, the child would take the suite's `-n auto` (pyproject) and start
    # workers of its own for 4 cases, on cores the suite's workers already use; a vendor's repo has no such option
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--pyargs",
           "mm3.testing.conformance", "--mm3-backend", "cpu_ref", "--mm3-dtype", "float32",
           "--mm3-index-dtype", "bfloat16", "-k", "mixed_h1 or sentinel"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " passed" in r.stdout and "failed" not in r.stdout


def test_seed_varies_inputs_reproducibly() -> None:
    a, b, c = (plan_cases(CPU_REF, seed=s) for s in (0, 0, 1))
    assert [x.spec.seed for x in a] == [x.spec.seed for x in b]
    assert all(x.spec.seed != y.spec.seed for x, y in zip(a, c))


def test_suite_catches_ties_broken_to_the_highest_id_and_says_where() -> None:
    """docs/spec.md §3.5: exact ties go to the lowest block id; a plugin that keeps the highest
    ones passes every tolerant case but fails each exact-tie case, with the tied scores shown."""
    import torch

    from mm3.plugin import BackendCapabilities, hookimpl
    from mm3.testing.oracle import oracle_block_scores

    class HighestIdWins:
        @hookimpl
        def backend_capabilities(self) -> BackendCapabilities:
            return BackendCapabilities(name="highest_id", ops={"index_topk"}, device_types={"cpu"},
                                       topk_layout="head_major", max_decode_query_len=8)

        @hookimpl
        def index_topk(self, index_q, caches, batch, params, out) -> None:  # type: ignore[no-untyped-def]
            hm = out.head_major()
            hm.fill_(-1)
            for t, S in enumerate(oracle_block_scores(index_q, caches, batch, params)):
                nb = S.shape[1]
                if nb:        # a stable descending sort of the reversed blocks: ties to the highest id
                    order = nb - 1 - S.flip(-1).argsort(dim=-1, descending=True, stable=True)
                    hm[:, t, :min(nb, params.topk)] = order[:, :params.topk].to(torch.int32)

    plan = [c for c in plan_cases(_bind(HighestIdWins(), "highest_id"), **SUBSET)  # type: ignore[arg-type]
            if c.name.startswith("indexer/") and ("ties" in c.name or "nan_index_query" in c.name or
                                                  "mixed_h2" in c.name)]
    results = [c.run() for c in plan]
    failed = {r.name: r.message for r in results if r.failed}
    assert len(results) == 7 and set(failed) == {r.name for r in results} - {"indexer/mixed_h2:bfloat16"}, failed
    msg = failed["indexer/exact_ties_half_tied:bfloat16"]
    assert "break the exact-tie rule" in msg and "instead of" in msg and "(score " in msg, msg
    assert "score -1e+30" in failed["indexer/exact_ties_nan_pages:bfloat16"]


def test_suite_catches_a_judge_that_misses_faults() -> None:
    """An indexer that declares ``judges_contents`` is taken at its word (the layer then makes no check of the
    contents before it), so the suite checks its word: a mock that declares it and judges nothing fails the
    faulty steps and passes the fine ones; a backend without a check_contents hook gets no such cases."""
    name = "declares_a_judge"
    be = _bind(MockBackend(name, reports_bad_page_ids=True, judges_contents=True), name)
    report = run_conformance(be, **SUBSET)  # type: ignore[arg-type]
    contents = {r.name.split("/")[1].split(":")[0]: r for r in report.results if r.kind == "contents"}
    failed = sorted(n for n, r in contents.items() if r.status == "fail")
    assert failed == [f"index_topk_{step}_{fault}" for step in ("decodes", "decodes_slots", "mixed")
                      for fault in ("page_id", "position")]
    assert "found no fault where mm3's reference finds" in contents["index_topk_mixed_position"].message
    assert {contents[f"index_topk_{s}_fine"].status for s in ("decodes", "mixed")} == {"pass"}
    assert not any(n.startswith("check_contents") for n in contents), sorted(contents)


def test_suite_runs_the_check_contents_cases_of_a_backend_without_index_topk() -> None:
    """A check_contents hook is called alone, so an attention-only backend that has one gets its cases (and
    none of index_topk's judge): a hook that lowers the word as mm3's reference does passes every one, one
    that judges nothing fails each faulty step and passes the fine ones."""
    import torch

    from mm3.contract.contents import lengths_word, pages_word
    from mm3.plugin import hookimpl

    class AttentionJudge(MockBackend):
        def __init__(self, name: str, judges: bool) -> None:
            super().__init__(name, ops={"attention"}, addressings={"pages", "slots"})
            self.judges = judges

        @hookimpl
        def check_contents(self, batch, num_pages, word) -> None:  # type: ignore[no-untyped-def]
            if self.judges:
                word.copy_(torch.minimum(word, torch.minimum(lengths_word(batch), pages_word(batch, num_pages))))

    steps = ("decodes", "decodes_slots", "mixed")
    for name, judges in (("attention_judge", True), ("attention_judge_blind", False)):
        plan = [c for c in plan_cases(_bind(AttentionJudge(name, judges), name), **SUBSET)  # type: ignore[arg-type]
                if c.spec.kind == "contents"]
        assert sorted(c.name.split("/")[1].split(":")[0] for c in plan) == sorted(
            f"check_contents_{step}_{fault}" for step in steps for fault in ("fine", "page_id", "position"))
        assert [c.skip for c in plan if c.skip] == []
        results = {r.name.split("/")[1].split(":")[0]: r for r in (c.run() for c in plan)}
        failed = sorted(n for n, r in results.items() if r.status != "pass")
        if judges:
            assert failed == [], {n: results[n].message for n in failed}
        else:
            assert failed == [f"check_contents_{step}_{fault}" for step in steps for fault in ("page_id", "position")]
            assert all(results[n].status == "fail" for n in failed)
            assert "found no fault where mm3's reference finds" in results["check_contents_mixed_position"].message


def test_a_contents_case_whose_own_step_is_wrong_says_the_suite_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A contents case checks its step against mm3's reference before any backend's word, and says which side
    is wrong: a 'fine' step the reference finds a fault in, or a fault that left the reference word alone."""
    from mm3.testing.conformance import contents_cases

    name = "declares_a_judge_too"
    plan = {c.name.split("/")[1].split(":")[0]: c
            for c in plan_cases(_bind(MockBackend(name, reports_bad_page_ids=True, judges_contents=True), name),
                                **SUBSET) if c.spec.kind == "contents"}  # type: ignore[arg-type]
    monkeypatch.setitem(contents_cases.FAULTS, "fine", contents_cases.FAULTS["page_id"])
    monkeypatch.setitem(contents_cases.FAULTS, "position", lambda case: None)
    fine, position = plan["index_topk_mixed_fine"].run(), plan["index_topk_mixed_position"].run()
    assert fine.failed and "on a step built to be fine: the suite's step builder is wrong" in fine.message
    assert position.failed and "did not change mm3's reference word" in position.message
