"""Property-based tests: random mixed steps, every available backend against the fp64 oracle.

Hypothesis draws the whole step: head counts (H = 1 and H > 1, GQA groups),
sizes, top-k and forced blocks, decodes (plain and speculative), padding and
empty decode rows, chunked prefills, random page permutations with spare
pages, NHD or HND pages, dtypes, and the top-k layouts the indexer writes and
the attention reads (each independent of what the backend prefers). Every
backend call goes through the contract guard, and the results are compared
with the oracle: the indexer's rows as tie-tolerant sets, the attention (fed
the oracle's own selection, so ties cannot leak) within docs/spec.md §4's tolerances
(the mean bound plus the output dtype's rounding floor: see _check_attention).
A third property composes two backends through ``SparseAttention``.

Profiles (``MM3_TEST_FUZZ_PROFILE``; default ``gpu`` when CUDA is available,
else ``ci``):

* ``ci``: a fixed, derandomized example set small enough for 2 CPU cores
  (40 per property for cpu_ref, 10 / 8 for each Triton backend's indexer /
  attention, 15 for the cpu_ref composed pair and 4 for each pair with a Triton
  backend; the Triton backends run through the interpreter, fp16/fp32 only,
  since it computes bf16 wrongly);
* ``gpu``: many more examples, bf16 too, on the GPU (2,550 in all: 300 per
  backend for the indexer and the attention, 150 per composed pair).

``MM3_TEST_FUZZ_EXAMPLES=N`` overrides the example count of every test.
A failure prints the example and a ``@reproduce_failure`` blob.

Every case with a Triton backend is marked ``slow``: through the interpreter its
examples take seconds each, so it runs with ``python -m pytest -m slow`` (CI runs
both), and the default run fuzzes cpu_ref.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mm3 import SparseAttentionParams, TopkBuffer
from mm3.runtime.config import Settings
from mm3.contract.buffers import TORCH_DTYPES
from mm3.contract.errors import BackendUnavailableError
from mm3.debug import GUARD_SENTINEL, checked_call
from mm3.runtime.layer import SparseAttention
from mm3.runtime.registry import Registry
from mm3.testing.factories import Case, make_case
from mm3.testing.oracle import check_topk, oracle_attention, oracle_topk

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
PROFILE = os.environ.get("MM3_TEST_FUZZ_PROFILE") or ("gpu" if GPU else "ci")
ROCM_OVERRIDE = "MM3_ROCM_ALLOW_NON_ROCM"   # the rocm plugin's test-only switch for non-AMD GPUs

_COMMON: dict[str, Any] = dict(deadline=None, database=None, print_blob=True, derandomize=True,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
# examples per property and backend: (ci, gpu). The interpreter's examples cost 2-8 s each before
# the interpreter shortcuts (backends/triton/interpreter_speed.py), about a third of that since; CI draws
# a few of them, the GPU profile (and MM3_TEST_FUZZ_EXAMPLES) many more
EXAMPLES = {"indexer": {"cpu_ref": (40, 300), "triton": (10, 300)},
            "attention": {"cpu_ref": (40, 300), "triton": (8, 300)},
            "composed": {"cpu_ref": (15, 150), "triton": (4, 150)}}


def _settings(prop: str, triton: bool) -> settings:
    n = EXAMPLES[prop]["triton" if triton else "cpu_ref"][0 if PROFILE == "ci" else 1]
    n = int(os.environ.get("MM3_TEST_FUZZ_EXAMPLES", n))
    return settings(max_examples=n, **_COMMON)


@contextlib.contextmanager
def _rocm_allowed() -> Iterator[None]:
    """Let the rocm plugin run its head-major path on a non-AMD GPU, for this block only."""
    old = os.environ.get(ROCM_OVERRIDE)
    os.environ[ROCM_OVERRIDE] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[ROCM_OVERRIDE]
        else:
            os.environ[ROCM_OVERRIDE] = old


def _load_backends() -> dict[str, Any]:
    """name -> Backend for every built-in that runs here (each in its own isolated registry)."""
    from mm3.runtime.discovery import list_entry_points

    found = {}
    with _rocm_allowed():
        for ep in list_entry_points():
            if ep.name not in ("cpu_ref", "cuda", "rocm"):
                continue
            try:
                be = Registry(plugins=[ep.load()], entry_points=False).get(ep.name)
            except Exception:  # noqa: BLE001 - a backend that cannot load simply is not fuzzed
                continue
            if be.probe(DEVICE).available:
                found[ep.name] = be
    return found


BACKENDS = _load_backends()
ALL = ["cpu_ref", pytest.param("cuda", marks=pytest.mark.slow), pytest.param("rocm", marks=pytest.mark.slow)]


def _backend(name: str) -> Any:
    if name not in BACKENDS:
        pytest.skip(f"backend {name} is not available on {DEVICE}")
    return BACKENDS[name]


# -- the step strategy -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """Everything that defines one random step (hypothesis shrinks this, not tensors)."""

    H: int
    G: int
    D: int
    Di: int
    B: int
    K: int
    init: int
    local: int
    decodes: tuple[int, ...]
    decode_query_len: int
    padding: int
    empty: int
    prefills: tuple[tuple[int, int], ...]
    kv_layout: str
    dtype: str
    index_dtype: str
    writer: str
    reader: str
    extra_pages: int
    spare_rows: int
    seed: int

    @property
    def params(self) -> SparseAttentionParams:
        return SparseAttentionParams(num_heads=self.H * self.G, num_kv_heads=self.H, head_dim=self.D,
                                     num_index_heads=self.H, index_head_dim=self.Di, block_size=self.B,
                                     topk=self.K, init_blocks=self.init, local_blocks=self.local)

    def case(self) -> Case:
        return make_case(self.params, decodes=self.decodes, prefills=self.prefills,
                         decode_query_len=self.decode_query_len, padding_decodes=self.padding,
                         empty_decodes=self.empty, dtype=self.dtype, index_dtype=self.index_dtype,
                         kv_layout=self.kv_layout, device=DEVICE, seed=self.seed,
                         extra_pages=self.extra_pages)


@st.composite
def steps(draw: st.DrawFn, triton: bool) -> Step:
    H = draw(st.sampled_from([1, 2, 3]))
    G = draw(st.sampled_from([1, 2, 3, 4]))
    D = draw(st.sampled_from([16, 32]))
    Di = draw(st.sampled_from([16, 32]))
    B = draw(st.sampled_from([16, 16, 32]))
    K = draw(st.integers(1, 6))
    init = draw(st.integers(0, min(1, K)))
    local = draw(st.integers(0, min(2, K - init)))
    dq = draw(st.sampled_from([1, 1, 2, 3]))
    max_ctx = 6 * B                                          # several blocks more than K, often
    decodes = tuple(draw(st.lists(st.integers(dq, max_ctx), max_size=3)))
    padding = draw(st.integers(0, 2))
    empty = draw(st.integers(0, 1))
    prefills = tuple(draw(st.lists(
        st.tuples(st.integers(1, 20), st.integers(0, 4 * B)).map(lambda qc: (qc[0], qc[0] + qc[1])),
        max_size=3)))
    # bf16 under the interpreter: tests/test_triton_conformance.py; the fuzz draws it on cpu_ref and a GPU
    dtypes = ["float16", "float32"] if triton and not GPU else ["bfloat16", "float16", "float32"]
    dtype = draw(st.sampled_from(dtypes))
    index_dtype = draw(st.sampled_from([dtype, "float8_e4m3fn"]))
    return Step(H, G, D, Di, B, K, init, local, decodes, dq, padding, empty, prefills,
                draw(st.sampled_from(["NHD", "HND"])), dtype, index_dtype,
                draw(st.sampled_from(["head_major", "token_major"])),
                draw(st.sampled_from(["head_major", "token_major"])),
                # >= 1 spare page: a cache with no pages at all crashes cpu_ref (reported, not fuzzed)
                draw(st.integers(1, 4)), draw(st.integers(0, 5)), draw(st.integers(0, 2 ** 16)))


# docs/spec.md §4: (max, mean) |error| against the fp64 oracle
TOL = {"bfloat16": (2e-2, 3e-4), "float16": (1e-2, 1.5e-4), "float32": (1e-5, 1e-5)}


def _check_attention(out: torch.Tensor, ref: torch.Tensor, dtype: str, T: int) -> None:
    """docs/spec.md §4's tolerances, the mean one raised by the output dtype's own rounding floor.

    docs/spec.md §4's bf16 mean bound (3e-4) assumes realistic contexts, where outputs
    average many values and stay small. With the few keys of a fuzzed step an
    output can be ~1, and merely rounding the exact answer to bf16 costs a
    mean error of up to ~1e-3: no backend could meet 3e-4 there. So the mean
    bound is the spec's plus that floor (measured on the exact answer); the max
    bound is the spec's unchanged.
    """
    if T == 0:
        return
    got = out[:T].double().cpu()
    assert torch.isfinite(got).all(), "non-finite output for finite inputs"
    err = (got - ref).abs()
    floor = (ref.to(TORCH_DTYPES[dtype]).double() - ref).abs().mean().item()
    max_tol, mean_tol = TOL[dtype]
    assert err.max().item() <= max_tol and err.mean().item() <= mean_tol + floor, (
        f"attention error max {err.max().item():.3g} (tol {max_tol}), mean {err.mean().item():.3g} "
        f"(tol {mean_tol} + rounding floor {floor:.3g})")


# -- properties -------------------------------------------------------------------------------------------------------

def _indexer_property(name: str, step: Step) -> None:
    be = _backend(name)
    case = step.case()
    p, T = case.params, case.batch.num_tokens
    buf = TopkBuffer.allocate(T + step.spare_rows, p.num_kv_heads, p.topk, step.writer, DEVICE)
    buf.fill_(GUARD_SENTINEL)
    with _rocm_allowed():
        be.index_topk(case.index_q, case.caches, case.batch, p, buf.rows(0, T))     # admitted
        checked_call(be, "index_topk", (case.index_q, case.caches, case.batch, p, buf.rows(0, T), None))  # guarded
    bad = check_topk(buf.rows(0, T), case.index_q, case.caches, case.batch, p)
    assert not bad, "\n".join(map(str, bad[:5]))
    assert (buf.head_major()[:, T:] == GUARD_SENTINEL).all(), "rows past T were written"


def _attention_property(name: str, step: Step) -> None:
    be = _backend(name)
    case = step.case()
    p, T = case.params, case.batch.num_tokens
    sel = oracle_topk(case.index_q, case.caches, case.batch, p).to_layout(step.reader)
    topk = TopkBuffer.allocate(T + step.spare_rows, p.num_kv_heads, p.topk, step.reader, DEVICE)
    topk.rows(0, T).copy_(TopkBuffer._wrap(sel.storage.to(DEVICE), step.reader))
    out = torch.full((T + step.spare_rows, p.num_heads, p.head_dim), float("nan"),
                     dtype=TORCH_DTYPES[step.dtype], device=DEVICE)
    with _rocm_allowed():
        # guarded: out[T:] and the top-k buffer stay untouched, padding rows are zero
        be.attention_forward(case.q, case.caches, topk.rows(0, T), case.batch, p, out[:T])    # admitted
        checked_call(be, "attention", (case.q, case.caches, topk.rows(0, T), case.batch, p, out[:T]))  # guarded
    _check_attention(out, oracle_attention(case.q, case.caches, sel, case.batch, p), step.dtype, T)
    assert torch.isnan(out[T:]).all(), "rows past T were written"


@pytest.mark.parametrize("backend", ALL)
def test_indexer_matches_oracle(backend: str) -> None:
    _backend(backend)

    @_settings("indexer", backend != "cpu_ref")
    @given(step=steps(triton=backend != "cpu_ref"))
    def prop(step: Step) -> None:
        _indexer_property(backend, step)

    prop()


@pytest.mark.parametrize("backend", ALL)
def test_attention_matches_oracle(backend: str) -> None:
    _backend(backend)

    @_settings("attention", backend != "cpu_ref")
    @given(step=steps(triton=backend != "cpu_ref"))
    def prop(step: Step) -> None:
        _attention_property(backend, step)

    prop()


# indexer from one backend, attention from another: the buffer crosses layouts on the way (every
# pair, in CI too: the pairs with cpu_ref had been GPU-profile only for CI time)
PAIRS = [("cpu_ref", "cpu_ref"), ("cuda", "rocm"), ("rocm", "cuda"), ("cpu_ref", "cuda"), ("rocm", "cpu_ref")]
@pytest.mark.parametrize("indexer,attention", [
    pytest.param(i, a, id=f"{i}->{a}", marks=[pytest.mark.slow] if {i, a} != {"cpu_ref"} else [])
    for i, a in PAIRS])
def test_composed_layer_matches_oracle(indexer: str, attention: str) -> None:
    for name in (indexer, attention):
        _backend(name)
    triton = any(n != "cpu_ref" for n in (indexer, attention))

    @_settings("composed", triton)
    @given(step=steps(triton=triton))
    def prop(step: Step) -> None:
        case = step.case()
        p, T = case.params, case.batch.num_tokens
        reg = Registry(plugins=[BACKENDS[indexer].plugin, BACKENDS[attention].plugin]
                       if indexer != attention else [BACKENDS[indexer].plugin], entry_points=False)
        with _rocm_allowed():
            try:
                layer = SparseAttention(p, device=DEVICE, dtype=case.q.dtype, index_dtype=case.caches.index_dtype,
                                        max_num_tokens=T + step.spare_rows + 1,
                                        max_decode_query_len=step.decode_query_len, backend=attention,
                                        indexer_backend=indexer, registry=reg,
                                        settings=Settings(check_contracts=True))
            except BackendUnavailableError as e:       # e.g. a shape one of the two does not declare
                pytest.fail(f"unexpected: {e}")
            out = layer(case.q, case.index_q, case.caches, case.batch)
        sel = layer.topk_buffer.rows(0, T)
        bad = check_topk(sel, case.index_q, case.caches, case.batch, p)
        assert not bad, "\n".join(map(str, bad[:5]))
        ref = oracle_attention(case.q, case.caches, TopkBuffer._wrap(sel.storage.cpu(), sel.layout), case.batch, p)
        _check_attention(out, ref, step.dtype, T)

    prop()


def test_strategy_covers_the_spec_regressions() -> None:
    """The strategy can produce docs/spec.md §5's regression shapes (mixed, H > 1, T % 4 != 0, both layouts)."""
    seen: dict[str, bool] = {}

    @settings(max_examples=200, **_COMMON)
    @given(step=steps(triton=False))
    def collect(step: Step) -> None:
        T = len(step.decodes) * step.decode_query_len + step.padding * step.decode_query_len + \
            sum(q for q, _ in step.prefills)
        seen["mixed_h>1"] = seen.get("mixed_h>1", False) or (
            len(step.decodes) >= 2 and len(step.prefills) >= 2 and step.H > 1)
        seen["h1"] = seen.get("h1", False) or step.H == 1
        seen["t_not_mult_4"] = seen.get("t_not_mult_4", False) or T % 4 != 0
        seen["layouts_differ"] = seen.get("layouts_differ", False) or step.writer != step.reader
        seen["spec_decode"] = seen.get("spec_decode", False) or (step.decode_query_len > 1 and bool(step.decodes))
        seen["chunked"] = seen.get("chunked", False) or any(s > q for q, s in step.prefills)
        seen["padding"] = seen.get("padding", False) or step.padding > 0
        seen["hnd"] = seen.get("hnd", False) or step.kv_layout == "HND"

    collect()
    assert all(seen.values()), seen
