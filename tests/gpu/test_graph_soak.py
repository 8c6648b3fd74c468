"""GPU safety under load: CUDA-graph replays, a long soak, and the contract guard on real shapes.

Run on a CUDA machine (the GPU tests skip cleanly elsewhere)::

    pytest tests/gpu/test_graph_soak.py -s -q            # -s shows the figures to record
    MM3_GPU_SOAK_STEPS=5000 pytest tests/gpu/test_graph_soak.py -s -k soak
    MM3_GPU_GRAPH_REPLAYS=1000 pytest tests/gpu/test_graph_soak.py -s -k graph

* **graph**: one decode step (indexer + attention through ``SparseAttention``)
  captured in a CUDA graph and replayed many times with new queries and new
  sequence lengths (padding rows included) within the captured block-table
  capacity; every replay must equal an eager run bit for bit (selection and
  output), rows past ``T`` of the top-k buffer and of ``out`` stay untouched,
  and sampled replays match an fp64 reference. Run for the token-major
  ``cuda`` and the head-major ``rocm`` plugin, with the contract guard off and
  on (the guard steps aside inside the capture and checks the eager runs).
* **soak**: thousands of eager steps with varying mixed batches through the
  ``cuda`` backend; no drift (a fixed probe step gives bit-identical output
  throughout), no GPU memory growth (``torch.cuda.memory_allocated`` before and
  after, ``max_memory_allocated``), no write outside the step's rows (out and
  top-k buffer sentinels), and periodic fp64 reference checks.
* **guard**: the guard's overhead at MiniMax-M3 shapes, and the vLLM layout bug
  stopped on the GPU.

Each test prints a ``FIGURES`` line. Two CPU smoke tests run the same
harnesses on tiny shapes (the graph one without capture) so they stay honest
in CI.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

from mm3 import BatchMetadata, PagedKVCache, SparseAttentionParams
from mm3.runtime.config import Settings
from mm3.contract.buffers import TopkBuffer
from mm3.contract.errors import PluginError
from mm3.runtime.layer import SparseAttention
from mm3.runtime.registry import Registry

from gpu_reference import attention_reference, block_scores, selection_errors

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
ROCM_OVERRIDE = "MM3_ROCM_ALLOW_NON_ROCM"
SENTINEL = -7
# docs/spec.md §4 against fp64: (max, mean); the mean also gets the dtype's rounding floor (see _attention_error)
TOL = {torch.bfloat16: (2e-2, 3e-4), torch.float16: (1e-2, 1.5e-4), torch.float32: (1e-5, 1e-5)}


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@pytest.fixture
def rocm_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ROCM_OVERRIDE, "1")


def _registry(*names: str) -> Registry:
    from mm3.runtime.discovery import list_entry_points

    eps = {ep.name: ep for ep in list_entry_points()}
    return Registry(plugins=[eps[n].load() for n in names], entry_points=False)


def _figures(**kw: Any) -> None:
    print("FIGURES " + " ".join(f"{k}={v}" for k, v in kw.items()), flush=True)


def _attention_error(out: torch.Tensor, ref: dict[int, torch.Tensor]) -> tuple[float, float, float]:
    """(max, mean, rounding floor) of |out - ref| over the referenced tokens."""
    toks = sorted(ref)
    want = torch.stack([ref[t] for t in toks])
    got = out[toks].to(torch.float64)
    err = (got - want).abs()
    floor = (want.to(out.dtype).to(torch.float64) - want).abs().mean().item()
    return err.max().item(), err.mean().item(), floor


def _check_reference(layer: SparseAttention, q: torch.Tensor, iq: torch.Tensor, caches: PagedKVCache,
                     batch: BatchMetadata, out: torch.Tensor, tokens: list[int]) -> float:
    """Selection and output of ``tokens`` against the fp64 references; returns the max error."""
    p = layer.params
    T = batch.num_tokens
    sel = layer.topk_buffer.rows(0, T)
    errors = selection_errors(sel, block_scores(iq, caches, batch, p, tokens), p)
    assert not errors, "\n".join(errors[:5])
    mx, mean, floor = _attention_error(out, attention_reference(q, caches, sel, batch, p, tokens))
    max_tol, mean_tol = TOL[out.dtype]
    assert mx <= max_tol and mean <= mean_tol + floor, (
        f"attention error max {mx:.3g} (tol {max_tol}), mean {mean:.3g} (tol {mean_tol} + floor {floor:.3g})")
    return mx


def _random_caches(p: SparseAttentionParams, pages: int, dtype: torch.dtype, device: torch.device,
                   g: torch.Generator, kv_layout: str = "NHD") -> PagedKVCache:
    c = PagedKVCache.allocate(pages, p.block_size, p.num_kv_heads, p.head_dim, p.index_head_dim, dtype,
                              dtype, kv_layout, device)
    for t in (c.k, c.v, c.index):
        t.copy_(torch.randn(t.shape, device=device, generator=g))
    return c


def _sample(batch: BatchMetadata, limit: int, rng: random.Random) -> list[int]:
    """Up to ``limit`` real tokens of the step: decodes first, then a spread of prefill tokens."""
    pos = batch.token_positions.tolist()
    real = [t for t, x in enumerate(pos) if x >= 0]
    if len(real) <= limit:
        return real
    dec = [t for t in real if t < batch.num_decode_tokens][: limit // 2]
    rest = [t for t in real if t >= batch.num_decode_tokens]
    return sorted(dec + rng.sample(rest, min(len(rest), limit - len(dec))))


# -- CUDA-graph replay ------------------------------------------------------------------------------------------

@dataclass
class GraphRun:
    replays: int
    tokens: int
    max_err: float
    seconds: float


def graph_harness(params: SparseAttentionParams, backend: str, *, device: torch.device, capture: bool,
                  guard: bool, decodes: int, decode_query_len: int, width: int, replays: int,
                  reference_every: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> GraphRun:
    """Capture (or, without ``capture``, just re-run) one static decode step; compare every replay to eager.

    The static step has ``decodes`` requests of ``decode_query_len`` tokens and a
    block table ``width`` blocks wide; replays change the queries and every
    request's length (to anything in ``[0, width * block_size]``; 0 = padding).
    """
    B = params.block_size
    R, dq = decodes, decode_query_len
    T = R * dq
    rng = random.Random(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    pages = R * width + 8
    caches = _random_caches(params, pages, dtype, device, g)
    bt = torch.randperm(pages)[: R * width].reshape(R, width).to(torch.int32)

    def new_batch() -> BatchMetadata:
        lens = [0 if rng.random() < 0.1 else rng.randint(dq, width * B) for _ in range(R)]
        return BatchMetadata.build([dq] * R, lens, bt, block_size=B, num_decodes=R, decode_query_len=dq,
                                   num_pages=pages, device=device)

    def new_q() -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randn(T, params.num_heads, params.head_dim, device=device, generator=g).to(dtype)
        iq = torch.randn(T, params.num_index_heads, params.index_head_dim, device=device, generator=g).to(dtype)
        return q, iq

    reg = _registry(backend)
    settings = Settings(check_contracts=guard)
    layer = SparseAttention(params, device=device, dtype=dtype, index_dtype=dtype, max_num_tokens=T + 8,
                            max_decode_query_len=dq, backend=backend, registry=reg, settings=settings,
                            cuda_graph=capture)
    eager = SparseAttention(params, device=device, dtype=dtype, index_dtype=dtype, max_num_tokens=T,
                            max_decode_query_len=dq, backend=backend, registry=reg, settings=settings)
    static_batch = new_batch()
    q_s, iq_s = new_q()
    out_s = torch.full((T + 8, params.num_heads, params.head_dim), float("nan"), dtype=dtype, device=device)

    def step() -> None:
        layer(q_s, iq_s, caches, static_batch, out=out_s)

    if capture:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):          # compile and warm up outside the capture
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    else:
        run = step
    layer.topk_buffer.head_major()[:, T:].fill_(SENTINEL)
    out_s[T:].fill_(float("nan"))

    max_err = 0.0
    t0 = time.perf_counter()
    for i in range(replays):
        batch = new_batch()
        q, iq = new_q()
        static_batch.update_(batch)
        q_s.copy_(q)
        iq_s.copy_(iq)
        run()
        want = eager(q, iq, caches, batch)
        got_sel = layer.topk_buffer.rows(0, T).head_major()
        assert torch.equal(got_sel, eager.topk_buffer.rows(0, T).head_major()), \
            f"replay {i}: the replayed indexer chose other blocks than eager"
        assert torch.equal(out_s[:T], want), f"replay {i}: replayed output differs from eager"
        if reference_every and i % reference_every == 0:
            toks = _sample(batch, 32, rng)
            max_err = max(max_err, _check_reference(eager, q, iq, caches, batch, want, toks))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert (layer.topk_buffer.head_major()[:, T:] == SENTINEL).all(), "rows past T of the top-k buffer changed"
    assert torch.isnan(out_s[T:]).all(), "rows past T of out were written"
    return GraphRun(replays, T, max_err, seconds)


GRAPH_CASES = {
    # name: (tp, decodes, decode_query_len, width); width * 128 = the captured context capacity
    "tp8_q1": (8, 32, 1, 64),
    "tp2_q1": (2, 16, 1, 64),
    "tp2_spec_q4": (2, 8, 4, 32),
}


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("guard", [False, True], ids=["unguarded", "guarded"])
@pytest.mark.parametrize("backend", ["cuda", "rocm"])
@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_graph_replays_equal_eager(case: str, backend: str, guard: bool, rocm_allowed: None) -> None:
    tp, R, dq, width = GRAPH_CASES[case]
    run = graph_harness(SparseAttentionParams.minimax_m3(tp_size=tp), backend, device=torch.device("cuda"),
                        capture=True, guard=guard, decodes=R, decode_query_len=dq, width=width,
                        replays=_env_int("MM3_GPU_GRAPH_REPLAYS", 200), reference_every=50)
    _figures(test="graph", case=case, backend=backend, guard=guard, replays=run.replays, tokens=run.tokens,
             context_capacity=width * 128, max_err=f"{run.max_err:.3g}",
             replay_plus_eager_ms=f"{1e3 * run.seconds / run.replays:.2f}")


@pytest.mark.interpreter
def test_graph_harness_smoke_on_cpu() -> None:
    """The same harness, without capture, on the interpreted cuda plugin: replays via update_ stay exact."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU smoke test of the graph harness (needs TRITON_INTERPRET=1)")
    p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4)
    try:
        run = graph_harness(p, "cuda", device=torch.device("cpu"), capture=False, guard=True, decodes=4,
                            decode_query_len=2, width=6, replays=2, reference_every=1, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        if "unavailable" in str(e):
            pytest.skip(str(e))
        raise
    assert run.replays == 2 and run.max_err < 1e-4


# -- soak -----------------------------------------------------------------------------------------------------------

@dataclass
class SoakRun:
    steps: int
    tokens: int
    seconds: float
    max_err: float
    mem_before: Optional[int]
    mem_after: Optional[int]
    peak: Optional[int]
    probe_checks: int


def soak(params: SparseAttentionParams, backend: str, *, device: torch.device, steps: int, max_tokens: int,
         width: int, pool_pages: int, check_every: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
         warmup: int = 50) -> SoakRun:
    """Run ``steps`` random mixed steps through one layer; check stray writes every step (on device),
    a fixed probe step and an fp64 reference every ``check_every`` steps, memory before/after."""
    B = params.block_size
    rng = random.Random(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    caches = _random_caches(params, pool_pages, dtype, device, g, kv_layout="HND")
    max_dq = 4
    layer = SparseAttention(params, device=device, dtype=dtype, index_dtype=dtype, max_num_tokens=max_tokens,
                            max_decode_query_len=max_dq, backend=backend, registry=_registry(backend),
                            settings=Settings(check_contracts=False))
    out_buf = torch.empty(max_tokens + 8, params.num_heads, params.head_dim, dtype=dtype, device=device)
    topk_all: TopkBuffer = layer.topk_buffer
    stray = torch.zeros(3, dtype=torch.int64, device=device)   # out past T, top-k past T, unwritten rows

    def draw_step() -> tuple[torch.Tensor, torch.Tensor, BatchMetadata]:
        while True:
            dq = rng.choice([1, 1, 2, 4])
            nd = rng.randint(0, 24)
            ql, sl = [], []
            for _ in range(nd):
                pad = rng.random() < 0.1
                ql.append(dq)
                sl.append(0 if pad else rng.randint(dq, width * B))
            for _ in range(rng.randint(0, 3)):
                q = min(rng.choice([1, 7, 64, 200, 511]), width * B)
                ql.append(q)
                sl.append(q + rng.randint(0, width * B - q))
            if 0 < sum(ql) <= max_tokens:
                break
        bt = torch.randint(0, pool_pages, (len(ql), width), dtype=torch.int32)   # any pages (reads only)
        batch = BatchMetadata.build(ql, sl, bt, block_size=B, num_decodes=nd, decode_query_len=dq,
                                    num_pages=pool_pages, device=device)
        T = batch.num_tokens
        q = torch.randn(T, params.num_heads, params.head_dim, device=device, generator=g).to(dtype)
        iq = torch.randn(T, params.num_index_heads, params.index_head_dim, device=device, generator=g).to(dtype)
        return q, iq, batch

    probe = draw_step()
    probe_out = layer(*probe[:2], caches, probe[2]).clone()
    # The reference's fp64 matmuls allocate library workspaces on first use: do that before the
    # memory baseline, so it is not mistaken for a leak.
    max_err = _check_reference(layer, *probe[:2], caches, probe[2], probe_out, _sample(probe[2], 24, rng))
    probe_checks = 0
    tokens = 0
    mem_before = None
    t0 = time.perf_counter()
    for i in range(steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.synchronize()
            gc.collect()
            mem_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        q, iq, batch = draw_step()
        T = batch.num_tokens
        tokens += T
        out_buf.fill_(float("nan"))
        topk_all.fill_(SENTINEL)
        out = layer(q, iq, caches, batch, out=out_buf)
        stray[0] += (~torch.isnan(out_buf[T:])).any()
        stray[1] += (topk_all.head_major()[:, T:] != SENTINEL).any()
        stray[2] += torch.isnan(out).any()
        if check_every and (i + 1) % check_every == 0:
            max_err = max(max_err, _check_reference(layer, q, iq, caches, batch, out, _sample(batch, 24, rng)))
            again = layer(*probe[:2], caches, probe[2])
            assert torch.equal(again, probe_out), f"step {i}: the probe step's output drifted"
            probe_checks += 1
            assert stray.tolist() == [0, 0, 0], f"step {i}: stray/unwritten rows {stray.tolist()}"
        del q, iq, batch, out
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert stray.tolist() == [0, 0, 0], f"stray writes past T (out, top-k) / unwritten rows: {stray.tolist()}"
    again = layer(*probe[:2], caches, probe[2])
    assert torch.equal(again, probe_out), "the probe step's output drifted by the end"
    mem_after = peak = None
    if device.type == "cuda":
        del again
        torch.cuda.synchronize()
        gc.collect()
        mem_after = torch.cuda.memory_allocated(device)
        peak = torch.cuda.max_memory_allocated(device)
    return SoakRun(steps, tokens, seconds, max_err, mem_before, mem_after, peak, probe_checks + 1)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 8])
def test_soak_no_drift_no_leak_no_stray_writes(tp: int) -> None:
    steps = _env_int("MM3_GPU_SOAK_STEPS", 2000)
    run = soak(SparseAttentionParams.minimax_m3(tp_size=tp), "cuda", device=torch.device("cuda"), steps=steps,
               max_tokens=2048, width=64, pool_pages=4096, check_every=100)
    mib = 1 << 20
    assert run.mem_before is not None and run.mem_after is not None and run.peak is not None
    _figures(test="soak", tp=tp, backend="cuda", steps=run.steps, tokens=run.tokens,
             ms_per_step=f"{1e3 * run.seconds / run.steps:.2f}", max_err=f"{run.max_err:.3g}",
             probe_checks=run.probe_checks, mem_before_MiB=f"{run.mem_before / mib:.1f}",
             mem_after_MiB=f"{run.mem_after / mib:.1f}", peak_MiB=f"{run.peak / mib:.1f}")
    growth = run.mem_after - run.mem_before
    assert growth <= mib, f"GPU memory grew by {growth / mib:.2f} MiB over {run.steps} steps"


def test_soak_harness_smoke_on_cpu() -> None:
    """The soak harness on cpu_ref with tiny shapes, so its checks stay honest in CI."""
    p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2, index_head_dim=16,
                              block_size=16, topk=4, init_blocks=1)
    run = soak(p, "cpu_ref", device=torch.device("cpu"), steps=24, max_tokens=1200, width=8, pool_pages=64,
               check_every=8, dtype=torch.float32, warmup=0)
    assert run.steps == 24 and run.tokens > 0 and run.probe_checks == 4 and run.max_err < 1e-4


# -- the guard on the GPU ------------------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 2])
def test_guard_overhead_on_gpu(tp: int) -> None:
    """The guard's cost at M3 shapes with the cuda backend (printed), and identical results."""
    from gpu_reference import build_case

    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    c = build_case(p, decodes=[8192 + 512 * i for i in range(16)], prefills=[(512, 4096), (256, 256)])
    layers = {on: SparseAttention(p, device="cuda", max_num_tokens=1024, backend="cuda",
                                  registry=_registry("cuda"), settings=Settings(check_contracts=on))
              for on in (False, True)}
    outs = {}
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(25):
        for on, layer in layers.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs[on] = layer(c.q, c.index_q, c.caches, c.batch)
            torch.cuda.synchronize()
            if i >= 5:
                times[on].append((time.perf_counter() - t0) * 1e3)
    assert torch.equal(outs[False], outs[True])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    _figures(test="guard_overhead", tp=tp, tokens=c.batch.num_tokens, off_ms=f"{off:.3f}", on_ms=f"{on:.3f}",
             overhead=f"{100 * (on / off - 1):.0f}%")


@needs_gpu
@pytest.mark.gpu
def test_vllm_layout_bug_cannot_be_allocated_on_gpu() -> None:
    from gpu_reference import build_case
    from mm3.testing.mock import MockBackend

    p = SparseAttentionParams.minimax_m3(tp_size=2)                    # H = 2: the bug shows
    c = build_case(p, decodes=[3000, 9000, 700], prefills=[(300, 2000), (77, 77)])

    def layer(plugin: Any, guard: bool) -> SparseAttention:
        return SparseAttention(p, device="cuda", max_num_tokens=512, backend=plugin.capabilities.name,
                               registry=Registry([plugin], entry_points=False),
                               settings=Settings(check_contracts=guard))

    def buggy() -> MockBackend:
        return MockBackend("vllm_gpu", topk_layout="token_major", fault="wrong_layout", delegate="cuda",
                           device_types={"cuda"})

    honest = layer(MockBackend("honest", topk_layout="token_major", delegate="cuda", device_types={"cuda"}),
                   False)(c.q, c.index_q, c.caches, c.batch)
    assert torch.isfinite(honest).all()
    for guard in (False, True):                  # TopkBuffer refuses the mislabelled storage itself
        with pytest.raises(PluginError, match="not laid out outermost-to-innermost"):
            layer(buggy(), guard)
    _figures(test="vllm_bug_gpu", unguarded="PluginError", guarded="PluginError")
