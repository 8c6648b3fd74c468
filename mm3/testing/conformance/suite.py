"""Plan the conformance cases for a backend and run them.

:func:`plan_cases` expands the case table (:mod:`.cases`) over the dtypes a
run asks for, and marks as *skipped* (never failed) every case the backend
cannot serve by its own declaration: an op it does not provide, a dtype,
head dim, block size or decode query length outside its capabilities, or a
device its probe refuses. :func:`run_conformance` runs the plan.

Example:
    >>> from mm3.runtime.registry import default_registry
    >>> plan = plan_cases(default_registry().get("cpu_ref"), dtypes=["float32"],
    ...                   index_dtypes=["bfloat16"])
    >>> plan[0].name, plan[0].run().status
    ('indexer/mixed_h1:bfloat16', 'pass')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

import torch

from mm3.contract.errors import InputError
from mm3.contract.hookspecs import Op
from mm3.testing.conformance.cases import (
    ATTENTION_STEPS, BODIES, BUFFER_CASES, COMPOSED_STEPS, INDEXER_STEPS, LARGE_STEPS, CaseContext,
    CaseSpec, Step,
)
from mm3.testing.conformance.contents_cases import CONTENTS_STEPS, FAULTS, JUDGES, contents_body
from mm3.testing.conformance.quant_cases import QUANT_CASES
from mm3.testing.conformance.report import CaseResult, ConformanceReport
from mm3.testing.conformance.scores import SCORE_STEPS, scores_body

if TYPE_CHECKING:
    from mm3.runtime.backend import Backend

__all__ = ["PlannedCase", "plan_cases", "run_conformance", "DEFAULT_DTYPES", "DEFAULT_INDEX_DTYPES"]

DEFAULT_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
"""Attention dtypes tried by default (docs/spec.md §1: bf16 or fp16; fp32 accepted by the reference)."""

DEFAULT_INDEX_DTYPES: tuple[str, ...] = ("bfloat16", "float8_e4m3fn")
"""Index cache dtypes tried by default (docs/spec.md §1); ask for float16/float32 explicitly."""

_ALL_DTYPES = ("bfloat16", "float16", "float32")
_ALL_INDEX_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


@dataclass(frozen=True)
class PlannedCase:
    """A case bound to a backend and device; ``skip`` is the reason it will not run ('' = it runs)."""

    spec: CaseSpec
    backend: "Backend"
    device: torch.device
    skip: str = ""
    reference_indexer: Optional["Backend"] = None

    @property
    def name(self) -> str:
        return self.spec.name

    def run(self) -> CaseResult:
        if self.skip:
            return CaseResult(self.spec.name, self.spec.kind, "skip", message=self.skip)
        ok, message, details, elapsed = self.spec.run(
            CaseContext(self.backend, self.device, self.reference_indexer))
        return CaseResult(self.spec.name, self.spec.kind, "pass" if ok else "fail", message=message,
                          details=details, elapsed=elapsed)


def _resolve(backend: Union["Backend", str]) -> "Backend":
    if isinstance(backend, str):
        from mm3.runtime.registry import default_registry

        return default_registry().get(backend)
    return backend


def _pick(wanted: Sequence[str], allowed: Iterable[str], known: Sequence[str], what: str) -> list[str]:
    unknown = [d for d in wanted if d not in known]
    if unknown:
        raise InputError(f"unknown {what} {unknown}; choose from {list(known)}")
    return [d for d in wanted if d in set(allowed)] or list(wanted[:1])


def _preferred(candidates: Sequence[str], declared: Iterable[str]) -> str:
    """bf16 when possible, else the first candidate the backend declares, else the first candidate."""
    declared = set(declared)
    usable = [d for d in candidates if d in declared] or list(candidates)
    return "bfloat16" if "bfloat16" in usable else usable[0]


def plan_cases(backend: Union["Backend", str], *, device: Union[str, torch.device] = "cpu",
               quick: bool = True, dtypes: Optional[Sequence[str]] = None,
               index_dtypes: Optional[Sequence[str]] = None,
               reference_indexer: Optional[Union["Backend", str]] = None,
               seed: int = 0) -> list[PlannedCase]:
    """Every case for ``backend`` on ``device``, each runnable or marked skipped with a reason.

    ``dtypes`` (attention) and ``index_dtypes`` (index cache) restrict the
    expansion (defaults :data:`DEFAULT_DTYPES`, :data:`DEFAULT_INDEX_DTYPES`);
    a requested dtype the backend does not declare yields skipped cases.
    ``quick`` (the default): each step once, the requested dtypes (or dtype
    pairs, for composed steps) taken in turn, so every step and every dtype
    runs at least once; ``quick=False``: every step in every requested dtype,
    and the larger shapes of :data:`.cases.LARGE_STEPS` too.
    ``seed`` varies every case's random inputs (each case is reproducible per seed).
    """
    be = _resolve(backend)
    ref = _resolve(reference_indexer) if reference_indexer is not None else None
    dev = torch.device(device)
    caps = be.capabilities
    want_dt = list(dtypes) if dtypes is not None else list(DEFAULT_DTYPES)
    want_idx = list(index_dtypes) if index_dtypes is not None else list(DEFAULT_INDEX_DTYPES)
    _pick(want_dt, _ALL_DTYPES, _ALL_DTYPES, "dtype(s)")
    _pick(want_idx, _ALL_INDEX_DTYPES, _ALL_INDEX_DTYPES, "index cache dtype(s)")
    if not want_dt or not want_idx:
        raise InputError("conformance needs at least one dtype and one index cache dtype")
    base_dt = _preferred(want_dt, caps.dtypes)
    base_idx = _preferred(want_idx, caps.index_cache_dtypes)

    def q_dtype_for_index(idx: str) -> str:
        # The index query has the model dtype: a float16/float32 index cache implies that dtype,
        # an fp8 one goes with the run's base dtype (so `dtypes=["float16"]` avoids bf16 entirely).
        return idx if idx in _ALL_DTYPES else base_dt

    specs: list[CaseSpec] = []

    def add(kind: str, name: str, step: Step, dtype: str, idx: str, ops: set[str], **extra: object) -> None:
        body = scores_body if kind == "scores" else BODIES[kind]
        specs.append(CaseSpec(name=name, kind=name.split("/")[0], step=step, body=body,
                              ops=frozenset(ops), dtype=dtype, index_dtype=idx, extra=dict(extra),
                              needs_any_layout=kind == "indexer_other", salt=seed))

    large = {} if quick else LARGE_STEPS

    def expanded(steps: dict[str, Step], options: Sequence) -> list[tuple[str, Step, object]]:
        """(step name, step, option): every pair, or (quick) each step and each option at least once."""
        named = list(steps.items())
        if not quick:
            return [(name, step, o) for name, step in named for o in options]
        return [(*named[i % len(named)], options[i % len(options)]) for i in range(max(len(named), len(options)))]

    for step_name, step, idx in expanded({**INDEXER_STEPS, **large}, want_idx):
        add("indexer", f"indexer/{step_name}:{idx}", step, q_dtype_for_index(idx), idx, {"index_topk"})
    for case_name, (kind, step, extra) in BUFFER_CASES.items():
        if kind.startswith("indexer"):
            add(kind, f"buffer/{case_name}:{base_idx}", step, q_dtype_for_index(base_idx), base_idx,
                {"index_topk"}, **extra)
        else:
            add(kind, f"buffer/{case_name}:{base_dt}", step, base_dt, base_idx, {"attention"}, **extra)
    for step_name, step, dt in expanded({**ATTENTION_STEPS, **large}, want_dt):
        add("attention", f"attention/{step_name}:{dt}", step, dt, base_idx, {"attention"})
    for step_name, step, idx in expanded(SCORE_STEPS, want_idx):
        add("scores", f"scores/{step_name}:{idx}", step, q_dtype_for_index(idx), idx, {"index_scores"})
    pairs = [(dt, base_idx) for dt in want_dt] + [(base_dt, i) for i in want_idx if i != base_idx]
    for step_name, step, (dt, idx) in expanded({**COMPOSED_STEPS, **large}, pairs):
        add("composed", f"composed/{step_name}:{dt}+{idx}", step, dt, idx, {"index_topk", "attention"})
    # the authors' formats: each case once, its formats fixed by the step (the report names a missing declaration)
    for step_name, (kind, step) in QUANT_CASES.items():
        idx = step.index_format or base_idx
        ops = {"attention": {"attention"}, "indexer": {"index_topk"}, "composed": {"index_topk", "attention"}}[kind]
        tail = f"{base_dt}+{idx}" if kind == "composed" else (idx if kind == "indexer" else base_dt)
        add(kind, f"{kind}/{step_name}:{tail}", step, q_dtype_for_index(idx) if kind == "indexer" else base_dt,
            idx, ops)

    # the backend's own judges of a batch's contents: only those it has (most leave the contents to mm3). The
    # check_contents hook is called alone: its cases ask for one op the backend provides (the first of Op's),
    # whose requirements the step must meet; index_topk's judge is index_topk itself
    reads = next((op.value for op in Op if be.provides(op.value)), Op.INDEX_TOPK.value)
    for judge in JUDGES:
        if not (be.check_contents is not None if judge == "check_contents" else caps.judges_contents):
            continue
        judge_ops = frozenset({reads if judge == "check_contents" else Op.INDEX_TOPK.value})
        for step_name, step in CONTENTS_STEPS.items():
            for fault in FAULTS:
                specs.append(CaseSpec(name=f"contents/{judge}_{step_name}_{fault}:{base_idx}", kind="contents",
                                      step=step, body=contents_body(judge, fault), ops=judge_ops,
                                      dtype=q_dtype_for_index(base_idx), index_dtype=base_idx,
                                      extra={"judge": judge}, salt=seed))

    probe = be.probe(dev)
    planned = []
    from mm3.runtime.selection import requirements_for

    for spec in specs:
        reasons: list[str] = []
        missing = [op for op in sorted(spec.ops) if not be.provides(op)]
        if missing:
            reasons.append(f"backend does not provide {missing}")
        else:
            req = requirements_for(spec.step.params(), spec.dtype, spec.index_dtype, dev,
                                   decode_query_len=spec.step.dq, kv_dtype=spec.step.kv_dtype,
                                   kv_slot_scales=spec.step.kv_fp8 == "slot",
                                   query_dtype="float8_e4m3fn" if spec.step.q8 else None,
                                   addressing=spec.step.addressing).for_ops(*spec.ops)
            reasons += caps.unmet(req)
            other = "token_major" if caps.topk_layout == "head_major" else "head_major"
            if spec.needs_any_layout and not caps.accepts_topk(other, dense=True):
                reasons.append(f"backend declares topk_requires_contiguous ({caps.topk_layout} only)")
            if not reasons and not probe.available:
                reasons.append(f"backend unavailable on {dev}: {probe.reason}")
        planned.append(PlannedCase(spec, be, dev, "; ".join(reasons), ref))
    return planned


def run_conformance(backend: Union["Backend", str], *, device: Union[str, torch.device] = "cpu",
                    quick: bool = True, dtypes: Optional[Sequence[str]] = None,
                    index_dtypes: Optional[Sequence[str]] = None,
                    reference_indexer: Optional[Union["Backend", str]] = None,
                    seed: int = 0) -> ConformanceReport:
    """Run the conformance suite (docs/spec.md) on ``backend`` and return a report (never raises on failure).

    Args:
        backend: a bound :class:`~mm3.runtime.backend.Backend` (or a name in the
            default registry).
        device: where the inputs live (``"cpu"``, ``"cuda"``...).
        quick: each step once, the dtypes in turn (see :func:`plan_cases`); ``False``: every step in
            every dtype, and bigger shapes.
        dtypes / index_dtypes: restrict the attention / index cache dtypes.
        reference_indexer: a backend whose selection the attention cases use
            instead of the fp64 oracle's (faster for big shapes).
        seed: varies the random inputs of every case (0 = the standard set).

    Example:
        >>> report = run_conformance("cpu_ref", dtypes=["float32"], index_dtypes=["bfloat16"])
        >>> report.passed, [r.name for r in report.failures]
        (True, [])
    """
    be = _resolve(backend)
    dev = torch.device(device)
    plan = plan_cases(be, device=dev, quick=quick, dtypes=dtypes, index_dtypes=index_dtypes,
                      reference_indexer=reference_indexer, seed=seed)
    return ConformanceReport(be.name, str(dev), [c.run() for c in plan])
