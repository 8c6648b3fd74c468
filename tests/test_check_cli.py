"""``mm3 check NAME``: per-case output and the exit status contract (0 pass, 1 failures, 2 unusable).

Most tests run the command in-process against an isolated default registry
(the ``mm3_registry`` fixture) holding mock backends that delegate to
``cpu_ref``; one runs the installed console script. A real backend passing
``mm3 check`` in a fresh interpreter is in test_third_party_install.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mm3.cli as cli
from mm3.cli.check import EXIT_FAILED, EXIT_PASSED, EXIT_UNUSABLE

FAST = ["--device", "cpu", "--dtype", "float32", "--index-dtype", "bfloat16"]


PROGRESS = re.compile(r"^  \[ *(\d+)/(\d+) +\d+\.\d s\] (PASS|FAIL|SKIP) ")


def verdicts(out: str, verdict: str) -> list[str]:
    """Per-case lines with ``verdict``; each must carry its ``[n/N elapsed]`` progress prefix."""
    return [ln for ln in out.splitlines() if (m := PROGRESS.match(ln)) and m.group(3) == verdict]


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["check", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_passing_backend_prints_each_case_and_exits_0(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("good", ops={"attention"}), installed=["cpu_ref"])
    rc, out, err = check(capsys, "good", *FAST)
    assert rc == EXIT_PASSED, out + err
    lines = out.splitlines()
    assert lines[0].startswith("mm3 conformance: backend 'good' on cpu (explicit)")
    passed = verdicts(out, "PASS")
    numbers = [int(PROGRESS.match(ln).group(1)) for ln in passed]
    assert numbers == sorted(numbers) and int(PROGRESS.match(passed[-1]).group(2)) >= len(passed)
    assert any("attention/mixed_h2_g2:float32" in ln and "max_err=" in ln for ln in passed), out
    assert any("buffer/attention_reads_other_layout_h2:float32" in ln for ln in passed), out
    # An attention-only backend skips the indexer cases: grouped, with the reason, not failed.
    assert "does not provide ['index_topk']" in out and "SKIP" not in out
    summary = next(ln for ln in lines if ln.startswith("PASSED:"))
    assert f"{len(passed)} passed, 0 failed" in summary


def test_failures_are_listed_and_exit_1(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("nanny", ops={"attention"}, fault="nan_output"), installed=["cpu_ref"])
    rc, out, err = check(capsys, "nanny", *FAST)
    assert rc == EXIT_FAILED, out + err
    failed = verdicts(out, "FAIL")
    assert failed and all("attention" in ln or "buffer" in ln for ln in failed), out
    assert "FAILED:" in out and f"{len(failed)} failed" in out
    assert any(ln.strip().startswith("failed: attention/") for ln in out.splitlines())


def test_a_backend_that_raises_fails_with_its_traceback(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("boom", ops={"attention"}, fault="raise"), installed=["cpu_ref"])
    rc, out, _ = check(capsys, "boom", *FAST, "--json")
    assert rc == EXIT_FAILED
    data = json.loads(out)
    assert data["backend"] == "boom" and data["passed"] is False
    ran = [c for c in data["cases"] if c["status"] != "skip"]
    assert ran and all(c["status"] == "fail" for c in ran)
    assert all("MockFault" in c["message"] and "injected fault" in c["traceback"] for c in ran)


def test_unknown_backend_exits_2_and_lists_the_known_ones(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("good"), installed=["cpu_ref"])
    rc, out, err = check(capsys, "goood", "--device", "cpu")
    assert rc == EXIT_UNUSABLE and out == ""
    assert "unknown backend 'goood'" in err and "cpu_ref, good" in err and "did you mean 'good'" in err


def test_unavailable_backend_exits_2_with_the_probe_reason(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("absent", available=False, probe_reason="needs a frobnicator 3000"),
                 installed=["cpu_ref"])
    rc, out, err = check(capsys, "absent", "--device", "cpu")
    assert rc == EXIT_UNUSABLE and out == ""
    assert "backend 'absent' (explicit) is not available on cpu: needs a frobnicator 3000" in err


def test_duplicate_name_exits_2_naming_both(mm3_registry, mock_backend, capsys) -> None:
    with pytest.warns(UserWarning, match="more than one plugin"):
        mm3_registry(mock_backend("twin"), mock_backend("twin"), installed=["cpu_ref"])
    rc, _, err = check(capsys, "twin", "--device", "cpu")
    assert rc == EXIT_UNUSABLE
    assert "backend name 'twin' is declared by more than one plugin" in err
    assert err.count("MockBackend instance") >= 2


def test_nothing_runnable_exits_2(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("halfonly", ops={"attention"}, dtypes={"float16"}), installed=["cpu_ref"])
    rc, out, err = check(capsys, "halfonly", *FAST)
    assert rc == EXIT_UNUSABLE
    assert "NOTHING RAN" in out
    assert "could run none of the" in err and "dtype float32 not in ['float16']" in err


def test_show_skipped_lists_each_case(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("halfonly", ops={"attention"}, dtypes={"float16"}), installed=["cpu_ref"])
    _, out, _ = check(capsys, "halfonly", *FAST, "--show-skipped")
    skips = verdicts(out, "SKIP")
    assert skips and any("indexer/mixed_h2:bfloat16" in ln for ln in skips)


def test_reference_indexer_option(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("good", ops={"attention"}), mock_backend("idx", ops={"index_topk"}),
                 installed=["cpu_ref"])
    rc, out, err = check(capsys, "good", *FAST, "--reference-indexer", "idx")
    assert rc == EXIT_PASSED, out + err
    rc, _, err = check(capsys, "idx", *FAST, "--reference-indexer", "good")
    assert rc == EXIT_UNUSABLE and "does not provide index_topk" in err


@pytest.mark.parametrize("args, message", [
    (["cpu_ref", "--dtype", "int8"], "unknown dtype(s) ['int8']"),
    (["cpu_ref", "--device", "not-a-device"], "invalid --device 'not-a-device'"),
])
def test_bad_options_exit_2(mm3_registry, capsys, args: list[str], message: str) -> None:
    mm3_registry(installed=["cpu_ref"])
    rc, _, err = check(capsys, *args)
    assert rc == EXIT_UNUSABLE and message in err


def test_name_is_required(capsys) -> None:
    rc = cli.main(["check"])
    assert rc == 2 and "NAME" in capsys.readouterr().err


def test_console_script(tmp_path: Path) -> None:
    """The installed ``mm3`` script reaches the command and returns its status."""
    script = Path(sys.executable).with_name("mm3")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "mm3.cli"]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MM3_")}
    r = subprocess.run([*cmd, "check", "no_such_backend", "--device", "cpu"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_UNUSABLE
    assert "unknown backend 'no_such_backend'; known backends:" in r.stderr and "cpu_ref" in r.stderr


def test_the_quick_plan_runs_every_step_and_every_dtype_and_full_every_pair() -> None:
    """Quick (the default): each step once, the dtypes (composed: dtype pairs) taken in turn, so every
    step and every dtype runs; full: every step in every dtype, and the larger shapes."""
    from mm3.runtime.registry import Registry
    from mm3.testing.conformance import plan_cases
    from mm3.testing.conformance.cases import (ATTENTION_STEPS, BUFFER_CASES, COMPOSED_STEPS, INDEXER_STEPS,
                                               LARGE_STEPS)
    from mm3.testing.conformance.suite import DEFAULT_DTYPES, DEFAULT_INDEX_DTYPES
    from mm3_backends.cpu_ref import plugin as cpu_ref

    be = Registry([cpu_ref], entry_points=False).get("cpu_ref")

    from mm3.testing.conformance.quant_cases import QUANT_CASES

    def split(plan: list) -> dict[str, list[tuple[str, str]]]:
        kinds: dict[str, list[tuple[str, str]]] = {}
        for c in plan:
            kind, rest = c.name.split("/")
            if rest.split(":")[0] not in QUANT_CASES:     # the authors' formats: each planned once, below
                kinds.setdefault(kind, []).append(tuple(rest.split(":")))
        return kinds

    for plan in (plan_cases(be), plan_cases(be, quick=False)):
        quant = [c.name.split("/")[1].split(":")[0] for c in plan if c.name.split("/")[1].split(":")[0] in QUANT_CASES]
        assert sorted(quant) == sorted(QUANT_CASES)
    quick, full = split(plan_cases(be)), split(plan_cases(be, quick=False))
    for kind, steps in (("indexer", INDEXER_STEPS), ("attention", ATTENTION_STEPS), ("composed", COMPOSED_STEPS),
                        ("buffer", BUFFER_CASES)):
        assert {s for s, _ in quick[kind]} == set(steps), kind
        assert {s for s, _ in full[kind]} == set(steps) | (set(LARGE_STEPS) if kind != "buffer" else set()), kind
    assert {d for _, d in quick["attention"]} == set(DEFAULT_DTYPES) == {d for _, d in full["attention"]}
    assert {d for _, d in quick["indexer"]} == set(DEFAULT_INDEX_DTYPES)
    pairs = {d for _, d in full["composed"]}
    assert {d for _, d in quick["composed"]} == pairs and len(pairs) == 4
    assert len(quick["attention"]) == len(ATTENTION_STEPS)
    assert len(full["attention"]) == (len(ATTENTION_STEPS) + len(LARGE_STEPS)) * len(DEFAULT_DTYPES)


def test_full_runs_the_larger_shapes(mm3_registry, mock_backend, capsys) -> None:
    mm3_registry(mock_backend("good", ops={"attention"}), installed=["cpu_ref"])
    quick = json.loads(check(capsys, "good", *FAST, "--json")[1])["cases"]
    full = json.loads(check(capsys, "good", *FAST, "--json", "--full")[1])["cases"]
    added = {c["name"]: c["status"] for c in full if c["name"] not in {q["name"] for q in quick}}
    assert set(added) == {f"{kind}/{step}:{dt}" for kind, dt in (("indexer", "bfloat16"), ("attention", "float32"),
                                                                ("composed", "float32+bfloat16"))
                          for step in ("large", "large_kv_fp8", "large_kv_e5m2_slot")}, added
    # the attention-only backend runs the larger attention steps and skips the others
    assert [n for n, status in added.items() if status == "pass"] == [
        "attention/large:float32", "attention/large_kv_fp8:float32", "attention/large_kv_e5m2_slot:float32"], added
