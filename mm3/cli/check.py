"""``mm3 check NAME``: run the conformance suite against one installed backend.

It prints one line per case as the case finishes (``[n/N elapsed]``, PASS /
FAIL with the numbers behind the verdict), the skipped cases grouped by reason (an
attention-only backend skips every indexer case, which is not a failure),
and a summary.

Exit status:

* ``0`` every case that ran passed;
* ``1`` at least one case failed;
* ``2`` the backend is unknown, excluded, unavailable on the device, or could
  run none of the cases; the message says why and what to do.

Example:
    $ mm3 check cpu_ref
    $ mm3 check torch_sdpa_sparse --dtype float32 --show-skipped
    $ TRITON_INTERPRET=1 mm3 check cuda --device cpu                  # the GPU code on a laptop
    $ mm3 check cuda --device cuda --full --json > report.json

The same cases run under pytest with
``pytest --pyargs mm3.testing.conformance --mm3-backend NAME``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any, Optional, TextIO

__all__ = ["add_arguments", "run", "check_backend", "EXIT_PASSED", "EXIT_FAILED", "EXIT_UNUSABLE"]

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_UNUSABLE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mm3 check`` (called by :mod:`mm3.cli`)."""
    parser.add_argument("name", metavar="NAME", help="backend name, as listed by `mm3 backends`")
    parser.add_argument("--device", default=None,
                        help="torch device the inputs live on (default: the current accelerator, else cpu)")
    parser.add_argument("--full", action="store_true",
                        help="every case in every dtype, and the larger shapes (slower; by default each case "
                             "runs once, the dtypes taken in turn)")
    parser.add_argument("--dtype", action="append", default=None, metavar="DTYPE",
                        help="attention dtype to test (repeatable; default bfloat16, float16, float32)")
    parser.add_argument("--index-dtype", action="append", default=None, metavar="DTYPE",
                        help="index cache dtype to test (repeatable; default bfloat16, float8_e4m3fn)")
    parser.add_argument("--reference-indexer", default=None, metavar="NAME",
                        help="take the attention cases' selection from this backend instead of the "
                             "fp64 oracle (faster on big shapes)")
    parser.add_argument("--show-skipped", action="store_true",
                        help="list every skipped case instead of grouping them by reason")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")


def _unusable(message: str, out: TextIO) -> int:
    print(f"mm3 check: {message}", file=out)
    return EXIT_UNUSABLE


def check_backend(name: str, *, device: str = "cpu", full: bool = False,
                  dtypes: Optional[list[str]] = None, index_dtypes: Optional[list[str]] = None,
                  reference_indexer: Optional[str] = None, show_skipped: bool = False,
                  as_json: bool = False, out: Optional[TextIO] = None,
                  err: Optional[TextIO] = None) -> int:
    """Run the conformance suite on backend ``name`` from the default registry; return the exit status.

    Per-case lines go to ``out`` (default stdout) as they finish; reasons for
    exit status 2 go to ``err`` (default stderr).

    Example:
        >>> check_backend("cpu_ref", dtypes=["float32"], index_dtypes=["bfloat16"])  # doctest: +ELLIPSIS
        mm3 conformance: backend 'cpu_ref' on cpu (mm3 0.1.0), ... cases
          [ 1/... s] PASS indexer/mixed_h1:bfloat16 (... ms) [...]
        ...
        PASSED: ... passed, 0 failed, 0 skipped in ... s
        0
    """
    import torch

    from mm3.contract.errors import MM3Error
    from mm3.runtime.registry import default_registry
    from mm3.testing.conformance import ConformanceReport, plan_cases

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        return _unusable(f"invalid --device {device!r}: {e}", err)

    reg = default_registry()
    try:
        be = reg.get(name)
    except MM3Error as e:
        # Unknown, or excluded (broken plugin, duplicate name, disabled): the registry's message
        # already names the known backends and the related problem.
        return _unusable(f"{e}", err)

    probe = be.probe(dev)
    if not probe.available:
        return _unusable(f"backend {name!r} ({be.source.dist_label}) is not available on {dev}: "
                         f"{probe.reason}. Run it where its probe accepts the device, or pass another "
                         f"--device.", err)
    ref = None
    if reference_indexer is not None:
        try:
            ref = reg.get(reference_indexer)
        except MM3Error as e:
            return _unusable(f"--reference-indexer: {e}", err)
        if not ref.provides("index_topk"):
            return _unusable(f"--reference-indexer {reference_indexer!r} does not provide index_topk "
                             f"(ops {sorted(ref.capabilities.ops)}); name a backend that does", err)
    try:
        plan = plan_cases(be, device=dev, quick=not full, dtypes=dtypes, index_dtypes=index_dtypes,
                          reference_indexer=ref)
    except MM3Error as e:  # bad --dtype / --index-dtype
        return _unusable(f"{e}", err)

    report = ConformanceReport(be.name, str(dev))
    if not as_json:
        print(f"mm3 conformance: backend {be.name!r} on {dev} ({be.source.dist_label}), "
              f"{len(plan)} cases{' (full)' if full else ''}", file=out, flush=True)
    t0 = time.perf_counter()
    width = len(str(len(plan)))
    for n, case in enumerate(plan, 1):
        result = case.run()
        report.results.append(result)
        # [n/N] and the time since the start: a slow backend shows it is moving (on stderr with --json)
        progress = f"[{n:>{width}}/{len(plan)} {time.perf_counter() - t0:6.1f} s]"
        if as_json:
            print(f"{progress} {result.status.upper()} {result.name}", file=err, flush=True)
            continue
        if result.skipped and not show_skipped:
            continue
        print(f"  {progress} {result.describe()}", file=out, flush=True)
        if result.failed and result.details.get("traceback"):
            print("    " + str(result.details["traceback"]).rstrip().replace("\n", "\n    "), file=out)
    elapsed = time.perf_counter() - t0

    if as_json:
        print(json.dumps(_as_dict(report, be, elapsed), indent=2, default=str), file=out)
    else:
        skipped = report.skipped
        if skipped and not show_skipped:
            by_reason = Counter(r.message for r in skipped)
            print(f"  skipped {len(skipped)} case(s) the backend does not declare support for:", file=out)
            for reason, n in by_reason.most_common():
                print(f"    {n} x {reason}", file=out)
        n_pass = sum(r.passed for r in report.results)
        verdict = "PASSED" if report.passed else ("FAILED" if report.failures else "NOTHING RAN")
        print(f"{verdict}: {n_pass} passed, {len(report.failures)} failed, {len(skipped)} skipped "
              f"in {elapsed:.1f} s", file=out)
        for r in report.failures:
            print(f"  failed: {r.name}: {r.message}", file=out)

    if report.failures:
        return EXIT_FAILED
    if not report.ran:
        reasons = sorted({r.message for r in report.skipped})
        return _unusable(f"backend {name!r} could run none of the {len(report)} cases on {dev}: "
                         f"{'; '.join(reasons) or 'no cases planned'}. Check its capabilities "
                         f"(`mm3 backends`) or widen --dtype/--index-dtype.", err)
    return EXIT_PASSED


def _as_dict(report: Any, be: Any, elapsed: float) -> dict[str, Any]:
    return {
        "backend": report.backend,
        "device": report.device,
        "distribution": be.source.distribution,
        "version": be.source.version,
        "passed": report.passed,
        "elapsed_s": elapsed,
        "cases": [{"name": r.name, "kind": r.kind, "status": r.status, "message": r.message,
                   "elapsed_s": r.elapsed,
                   "details": {k: v for k, v in r.details.items() if k != "traceback"},
                   **({"traceback": r.details["traceback"]} if "traceback" in r.details else {})}
                  for r in report.results],
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mm3 check`` (called by :mod:`mm3.cli`)."""
    from mm3.cli.main import default_device

    return check_backend(args.name, device=args.device or default_device(), full=args.full,
                         dtypes=args.dtype, index_dtypes=args.index_dtype,
                         reference_indexer=args.reference_indexer, show_skipped=args.show_skipped,
                         as_json=args.json)
