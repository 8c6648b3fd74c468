"""`mm3 bench --tiny`: the whole benchmark pipeline on tiny shapes, on the CPU, in seconds.

Runs a reduced tiny grid in-process through the same loader `mm3 bench` uses
(the harness is the installed package mm3_benchmarks), with every peer that runs
on a CPU (SDPA, eager FlexAttention, the reference backend), and checks the
outputs: JSON with records and targets, the Markdown report, the plots when
matplotlib is installed, and that every correctness check inside passed
(so the FlexAttention block mask built from a selection is right). The backend
under test is named (cpu_ref): auto selection depends on the plugins installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

from mm3.cli import bench


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    harness = bench.load_harness()
    ap = argparse.ArgumentParser()
    harness.add_arguments(ap)
    return ap.parse_args(["--tiny", "--device", "cpu", "--backend", "cpu_ref", "--out", str(tmp_path), *extra])


def test_harness_is_an_installed_package() -> None:
    mod = bench.load_harness()
    assert mod.__name__ == "mm3_benchmarks.harness"
    assert callable(mod.run) and callable(mod.add_arguments)


@pytest.mark.slow   # a whole tiny bench run; the CPU report's wording is checked in the default run
def test_tiny_run_writes_every_output(tmp_path: Path) -> None:
    harness = bench.load_harness()
    only = r"tiny b3 ctx200 q1 idx-bf16|tiny b2 ctx256 q2|48 new ctx80 sel-random"
    rc = harness.run(_args(tmp_path, "--only", only))
    assert rc == 0, (tmp_path / "results.md").read_text()

    data = json.loads((tmp_path / "results.json").read_text())
    recs = data["records"]
    assert data["ceilings"]["copy"]["GBps"] > 0
    assert {r["kind"] for r in recs if "ms" in r} == {"decode", "prefill"}
    impls = {r.get("impl") for r in recs if "ms" in r}
    assert {"mm3:cpu_ref", "sdpa:default", "flex"} <= impls
    for part in ("indexer", "attention", "step"):
        r = next(r for r in recs if r.get("impl") == "mm3:cpu_ref" and r.get("part") == part
                 and r["kind"] == "decode")
        assert r["ms"] > 0 and r["bytes"] > 0 and r["GBps"] > 0 and "pct_copy" in r
    pre = next(r for r in recs if r["kind"] == "prefill" and r.get("part") == "attention"
               and r.get("impl") == "mm3:cpu_ref")
    assert pre["flops"] > 0 and pre["TFLOPs"] > 0
    # FlexAttention with the block mask built from the selection computes the same attention
    flex = [r for r in recs if r.get("impl") == "flex" and "ms" in r]
    assert len(flex) == 3 and all(r["check"]["max_abs_diff_vs_mm3"] < 3e-2 for r in flex)
    assert not [r for r in recs if "error" in r], [r["error"] for r in recs if "error" in r]
    assert len(data["targets"]) >= 10

    md = (tmp_path / "results.md").read_text()
    for heading in ("## Ceilings", "## Targets", "## Decode", "## Prefill"):
        assert heading in md
    assert "FAILED CHECKS" not in md
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("decode_vs_context.png", "prefill_vs_context.png", "blockmap.png"):
            assert (tmp_path / name).stat().st_size > 1000, name


def test_minimal_byte_counts_match_the_notes() -> None:
    """The counts docs/performance.md quotes for M3 TP1, batch 64, 64K context."""
    counts = bench.load_harness().counts
    from mm3.contract.params import SparseAttentionParams

    p = SparseAttentionParams.minimax_m3(tp_size=1)
    kv_tokens = 64 * 4 * 16 * 128
    bf16 = counts.decode_bytes(p, batch=64, context=65536, qlen=1, index_elt=2, kv_elt=2, kv_tokens=kv_tokens)
    fp8 = counts.decode_bytes(p, batch=64, context=65536, qlen=1, index_elt=1, kv_elt=2, kv_tokens=kv_tokens)
    assert bf16["index_keys"] == 64 * 65536 * 128 * 2
    assert bf16["kv"] == 64 * 4 * 16 * 128 * 128 * 2 * 2
    assert abs(bf16["step"] / 1e9 - 1.345) < 1e-3 and abs(fp8["step"] / 1e9 - 0.808) < 1e-3
    assert 0.79 < bf16["index_keys"] / bf16["step"] < 0.81


def test_distinct_kv_counts_shared_blocks_once() -> None:
    counts = bench.load_harness().counts
    # 1 head, 2 requests x 2 speculative rows, K = 3; request 0's rows share block 1
    sel = torch.tensor([[[0, 1, -1], [1, 2, -1], [3, -1, -1], [3, -1, -1]]], dtype=torch.int32)
    seq = torch.tensor([300, 400])    # request 0's block 2 holds 300 - 256 = 44 visible tokens,
    got = counts.distinct_kv_tokens(sel, seq, qlen=2, block_size=128)   # request 1's block 3 holds 16
    assert got == 128 + 128 + 44 + 16


@pytest.mark.parametrize("mode", ["cli"])
def test_cli_help_lists_bench_options(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mm3.cli import main

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--tiny" in out and "--budget-s" in out


def test_every_variant_is_a_choice_the_cuda_config_does_not_make() -> None:
    """``mm3 bench --variants ALL`` builds every variant, and each changes the cuda plugin's config
    (a variant equal to the default, or naming a field that is gone, fails here)."""
    pytest.importorskip("triton")
    from mm3_backends.cuda.plugin import PLATFORM
    from mm3_backends.triton.launch import override
    from mm3_benchmarks.variants import VARIANTS, make_variants

    built = make_variants("ALL")
    assert [v.name for v in built] == [f"cuda[{n}]" for n in VARIANTS]
    for v in built:
        assert override(PLATFORM.launch, **v.overrides) != PLATFORM.launch, v.name
        assert set(v.kinds) <= {"decode", "prefill"} and v.kinds, v.name
    with pytest.raises(KeyError, match="unknown variant 'v0'; known: slowlaunch"):
        make_variants("v0")


def test_a_full_run_on_a_cpu_says_first_what_it_will_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mm3.cli import main

    assert main(["bench", "--device", "cpu", "--backend", "cpu_ref", "--only", "^no such row$", "--no-ceilings",
                 "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "no GPU in use (device cpu)" in err and "0 configuration(s)" in err, err
    assert "mm3 bench --tiny" in err and "--only REGEX" in err, err


def test_tiny_prints_no_figures_that_tiny_shapes_cannot_measure(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from mm3.cli import main

    assert main(["bench", "--tiny", "--device", "cpu", "--backend", "cpu_ref", "--peers", "",
                 "--only", "^decode tiny b3 ctx200 q1 idx-bf16$", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    md = (tmp_path / "results.md").read_text()
    assert "ceilings" not in out.lower() and "bf16 matmul" not in md, out  # no copy/matmul of tiny sizes
    assert "% of copy" not in out and "%copy |" not in md             # so no share of a copy bandwidth either
    assert "no `%copy` shares (--tiny" in md
    summary = out[out.rindex("targets:"):].strip().splitlines()
    assert summary[1:] == [summary[1]] and "none of the" in summary[1], summary   # one line, not one per target


def test_a_cpu_run_says_what_it_measured_and_what_it_could_not(tmp_path: Path) -> None:
    from mm3.cli import main

    assert main(["bench", "--tiny", "--device", "cpu", "--backend", "cpu_ref", "--peers", "sdpa",
                 "--only", "^decode tiny b3 ctx200 q1 idx-bf16$|^prefill tiny 48 new ctx80 sel-random$",
                 "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert "## Decode (eager calls; times in us)" in headings, headings
    assert "## Prefill (48-token chunk; ms, TFLOP/s in parentheses)" in headings, headings
    assert not [h for h in headings if "CUDA graph" in h or "8K" in h], headings
    assert "rotated over" not in md and "of eager calls on cpu (host clock)" in md
    # cpu_ref checked against itself is no check: said once, and no check column of 100% / 0
    assert "reference: none other than the backend under test (`cpu_ref`)" in md
    assert "- not measured: correctness: the backend under test `cpu_ref` is the reference" in md
    assert "| check |" not in md and "100% / 0e+00" not in md
    assert "- not measured: CUDA-graph times: cpu is not a CUDA device" in md
    # the CPU's SDPA kernel is the default one, and its column says so
    assert "| sdpa default |" in md and "sdpa flash" not in md
    assert re.search(r"none of the \d+ targets applies to this run: .*; this run used tiny shapes \(--tiny\) on "
                     r"cpu, not a CUDA GPU\.", md), md
    assert "target(s) not measured" not in md


def test_auto_with_an_attention_only_winner_asks_for_a_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The bench times one backend's indexer, attention and step: when auto pairs two, it says so."""
    import mm3_backends.cpu_ref.plugin as cpu_ref
    from plugin_fakes import FakeEntryPoint

    from mm3.cli import main
    from mm3.runtime import discovery
    from mm3.runtime.registry import reset_default_registry
    from mm3.testing.mock import MockBackend

    eps = [FakeEntryPoint("cpu_ref", cpu_ref), FakeEntryPoint("attn", MockBackend("attn", ops={"attention"},
                                                                                   priority=50), "attn-dist")]
    monkeypatch.setattr(discovery, "list_entry_points", lambda group="mm3.backends": eps)
    for k in [k for k in os.environ if k.upper().startswith("MM3_")]:
        monkeypatch.delenv(k)
    reset_default_registry()
    try:
        assert main(["bench", "--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 2
    finally:
        reset_default_registry()
    err = capsys.readouterr().err
    assert ("auto selection picks attention=attn and indexer=cpu_ref on cpu; mm3 bench times one backend for both "
            "ops: pass --backend NAME (e.g. --backend cpu_ref)") in err, err


def test_variants_above_the_variant_priority_are_skipped_aloud() -> None:
    """A configuration above ``--variant-priority`` times no variant, and the log says why."""
    from types import SimpleNamespace

    harness = bench.load_harness()
    logged: list[str] = []
    v = SimpleNamespace(name="cuda[x]", kinds=("decode",))
    ctx = SimpleNamespace(variants=[v], args=SimpleNamespace(variant_priority=0), log=logged.append)
    assert harness._variants_for(ctx, SimpleNamespace(priority=0), "decode") == [v] and not logged
    assert harness._variants_for(ctx, SimpleNamespace(priority=0), "prefill") == [] and not logged
    assert harness._variants_for(ctx, SimpleNamespace(priority=1), "decode") == []
    assert len(logged) == 1 and "--variant-priority 0" in logged[0]



def test_host_overhead_stream_measures_every_row_of_a_tiny_stream(capsys: pytest.CaptureFixture[str]) -> None:
    """``host_overhead.py --stub --stream --steps 3``: every measure of every entry point, and the
    process as it was (the tables' patch, the drop-in's backends, torch's threads) afterwards."""
    import mm3
    from mm3.integrations import targets
    from mm3.runtime import step
    from mm3.runtime.config import default_settings
    from mm3_benchmarks import host_overhead
    from mm3_benchmarks.stream import MEASURES, ROWS

    on_host, threads = step.on_host, torch.get_num_threads()
    host_overhead.main(["--stub", "--stream", "--steps", "3", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["mm3"] == mm3.__file__ and not got["notes"], got
    want = {"from_device: host us / step", "from_device: torch ops / step"} | {f"{r}: {m}" for r in ROWS
                                                                              for m in MEASURES}
    assert set(got["measures"]) == want
    m = got["measures"]
    assert all(m[f"{r}: host us / step, pass {n}"] > 0 for r in ROWS for n in (1, 2)), m
    assert all(m[f"{r}: host reads / step, pass 2"] == 0 for r in ROWS), m   # every class seen: nothing to read
    assert m["from_device: torch ops / step"] > 0
    assert step.on_host is on_host and torch.get_num_threads() == threads
    assert targets.settings() is default_settings()     # the drop-in configured back to the process's own


def test_host_overhead_stream_table_says_what_an_older_checkout_lacks() -> None:
    from mm3_benchmarks.stream import format_table

    this = {"stream": "3 steps", "backend": "stub", "notes": [],
            "measures": {"layer: host us / step, pass 1": 61.25, "vllm decode: host reads / step, pass 1": 4.2,
                         "layer: steps with host reads, pass 1": 3.0}}
    base = {"stream": "3 steps", "backend": "stub", "notes": ["vllm decode: n/a (No module named 'x')"],
            "measures": {"layer: host us / step, pass 1": 25.0, "vllm decode: host reads / step, pass 1": None,
                         "layer: steps with host reads, pass 1": 0.0}}
    lines = format_table(this, base, "41597a9").splitlines()
    assert lines[3].split() == ["41597a9", "this", "checkout"]
    assert lines[4].split()[-2:] == ["25.0", "61.2"] and lines[5].split()[-2:] == ["n/a", "4.20"]
    assert lines[6].split()[-2:] == ["0", "3"]
    assert lines[-1] == "note (41597a9): vllm decode: n/a (No module named 'x')"


@pytest.mark.parametrize("argv, says", [
    (["--stream"], "needs a CUDA device"),          # a CPU machine: the GPU stream has no device
    (["--stream", "--stub", "--device", "cuda"], "--stub --stream runs on the CPU"),
    (["--base", "HEAD"], "add --stream"),
    (["--stream", "--stub", "--steps", "0"], "--steps must be >= 1"),
])
def test_host_overhead_stream_refuses_what_it_cannot_run(argv: list[str], says: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from mm3_benchmarks import host_overhead

    if argv == ["--stream"] and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit) as e:
        host_overhead.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_sglang_dropin_bench_parses_its_arguments_and_says_it_needs_a_gpu() -> None:
    """Import-safe without CUDA or SGLang; its arguments parse; without CUDA it exits saying why."""
    from mm3_benchmarks import sglang_dropin

    a = sglang_dropin.parser().parse_args(["--tp", "1", "8", "--kind", "decode", "--graph", "--context", "4096"])
    assert (a.tp, a.kind, a.graph, a.context, a.backend) == ([1, 8], "decode", True, 4096, "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            sglang_dropin.main(["--tp", "1"])
