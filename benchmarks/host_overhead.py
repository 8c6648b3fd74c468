"""Host time per ``SparseAttention`` forward: eager, back-to-back calls, one sync at the end.

Where the GPU work of a step is ~10 us, the host decides the step time: each
row is (wall time of ``iters`` back-to-back calls, synchronised once) / iters,
median of ``repeat`` rounds, in microseconds, for one decode step at MiniMax-M3
shapes::

    python -m mm3_benchmarks.host_overhead --device cuda --tp 8 --batch 1 --context 4096

Rows (a row is skipped when the installed mm3 lacks what it needs, so the same
script measures an older checkout for the "before" column):

* ``layer``: ``layer(q, index_q, caches, batch)`` with a ``BatchMetadata.build`` batch;
* ``layer, device batch``: the same with a batch of ``BatchMetadata.from_device``;
* ``ops``: ``torch.ops.mm3.index_topk`` + ``torch.ops.mm3.attention`` (the dispatcher path of an
  engine that schedules the two apart, called eagerly; a compiled layer calls ``sparse_attention``, the
  ``--stream`` rows time it);
* ``backends``: the two bound ``Backend`` calls (mm3's checks, then the plugin);
* ``plugin hooks``: the two hook functions, no checks (the kernels' own launch code);
* ``graph replay``: the step captured in a ``torch.cuda.CUDAGraph`` and replayed (GPU only);
* ``layer, fast launch`` / ``plugin hooks, fast launch`` (``cuda`` backend, when the plugin has
  ``Algorithms.fast_launch``): the same with the compiled kernels launched directly;
* ``layer, top-k and merge launched`` / ``graph replay, top-k and merge launched`` (``cuda``
  backend): the decode top-k and merge as launches of their own always
  (``Algorithms.topk_in_last_program`` / ``merge_in_last_program`` = False), beside the default,
  which takes them into the last program of their group where ``LaunchConfig``'s rules say.

Within a call the rows are timed in turn in each of ``repeat`` rounds (the eager ones, then the
replays), so rows of one call are side by side.

Run it in the new and the old checkout on the same machine and compare side by side.

``--prefill TOKENS`` (GPU) instead times one eager prefill step's host time alone (the device
synchronised before each call), with the launches direct and through Triton's own launch::

    python benchmarks/host_overhead.py --device cuda --tp 8 --prefill 8192 --context 32768

``--stub`` measures mm3's own host code on any machine (CPU tensors, no kernel
runs): a backend whose hooks do nothing after their first (guarded) step, so
``layer``, ``ops`` and ``backends`` time only mm3's Python; and the Triton
plugin's launch code (``attention_forward`` + ``index_topk``) with every
kernel launch replaced by a no-op (in this process only), so it times the
plugin's Python without Triton's own launch. Minimum of ``repeat`` runs (a
shared CI machine is noisy)::

    python benchmarks/host_overhead.py --stub --tp 8 --batch 1 --context 4096

``--stream`` instead replays an engine's traffic, a step of a new shape almost every step
(:mod:`mm3_benchmarks.stream` says what the stream is and what each row and measure means): host
reads, mm3's host time and torch ops per step through the layer, the custom ops, vLLM's decode
pair and a tensor-parallel rank, on a first pass over the stream and a second; and
``BatchMetadata.from_device``'s own cost. ``--stub`` on the CPU, or the ``cuda`` backend on a GPU.
``--base REF`` measures the git ref REF too (a temporary worktree, this script in a subprocess
importing that ref's ``mm3`` and ``mm3_backends``) and prints both side by side::

    python benchmarks/host_overhead.py --stub --stream --base 41597a9
    python benchmarks/host_overhead.py --stream --device cuda --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Optional

import torch

import mm3
from mm3.plugin import BackendCapabilities, hookimpl
from mm3.runtime.registry import Registry, default_registry
from mm3.testing.factories import make_case

__all__ = ["measure_host_overhead"]


def _ops_row(layer: "mm3.SparseAttention", q: torch.Tensor, iq: torch.Tensor, c: "mm3.PagedKVCache",
             b: "mm3.BatchMetadata", out: torch.Tensor) -> Callable[[], None]:
    """The two custom ops of one step, called eagerly (the dispatcher path of an engine that calls them apart)."""
    from mm3.runtime.ops import batch_args

    args, h, st = batch_args(b), layer.op_target.handle, layer.topk_buffer.storage

    def ops() -> None:
        torch.ops.mm3.index_topk(iq, c.k, c.v, c.index, st, *args, h)
        torch.ops.mm3.attention(q, c.k, c.v, c.index, st, *args, h, out)
    return ops


def _variant_registry(**algorithms: bool) -> Optional[Registry]:
    """A registry whose ``cuda`` backend runs with these ``Algorithms`` fields (None: this plugin has not them)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from mm3_backends.cuda.plugin import PLATFORM
    from mm3_backends.triton.algorithms import Algorithms
    from mm3_backends.triton.launch import override
    from mm3_backends.triton.plugin_factory import make_hookimpls

    if not set(algorithms) <= set(getattr(Algorithms, "__dataclass_fields__", {})):
        return None
    hooks = make_hookimpls(replace(PLATFORM, launch=override(PLATFORM.launch, algorithms=algorithms)))
    return Registry([SimpleNamespace(**hooks._asdict())], entry_points=False)


def _interleaved(rows: dict[str, Callable[[], object]], iters: int, repeat: int,
                 sync: Callable[[], None]) -> dict[str, float]:
    """Median us per call of each row, the rows timed in turn within each round (side by side: this
    host's state drifts between calls by more than the differences measured)."""
    for fn in rows.values():
        for _ in range(3):
            fn()
    sync()
    runs: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(repeat):
        for k, fn in rows.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            runs[k].append((time.perf_counter() - t0) / iters * 1e6)
    return {k: statistics.median(v) for k, v in runs.items()}


def measure_host_overhead(device: str = "cuda", backend: Optional[str] = None, tp: int = 8, batch: int = 1,
                          context: int = 4096, iters: int = 200, repeat: int = 5) -> dict[str, float]:
    """Microseconds per forward for each row of the module docstring that this mm3 supports."""
    p = mm3.SparseAttentionParams.minimax_m3(tp_size=tp)
    name = backend or ("cuda" if device.startswith("cuda") else "cpu_ref")
    layer = mm3.SparseAttention(p, device=device, max_num_tokens=max(64, batch), backend=name)
    case = make_case(p, decodes=[context] * batch, device=device, seed=0)
    q, iq, c, b = case.q, case.index_q, case.caches, case.batch
    out = torch.empty_like(q)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows: dict[str, Callable[[], object]] = {"layer": lambda: layer(q, iq, c, b, out)}
    if hasattr(mm3.BatchMetadata, "from_device"):
        db = mm3.BatchMetadata.from_device(b.query_start_loc, b.seq_lens, b.block_table, num_decodes=b.num_decodes,
                                           num_tokens=b.num_tokens, max_query_len=b.max_query_len,
                                           block_size=b.block_size, num_decode_tokens=b.num_decode_tokens)
        rows["layer, device batch"] = lambda: layer(q, iq, c, db, out)
    if hasattr(layer, "op_target"):
        rows["ops"] = _ops_row(layer, q, iq, c, b, out)
    sel = layer.selection
    topk = layer.topk_buffer.rows(0, b.num_tokens)
    T = b.num_tokens

    def backends() -> None:
        sel.indexer.index_topk(iq, c, b, p, topk)
        sel.attention.attention_forward(q, c, topk, b, p, out[:T])
    rows["backends"] = backends
    idx_hook = sel.indexer.plugin.index_topk  # type: ignore[attr-defined]
    att_hook = sel.attention.plugin.attention_forward  # type: ignore[attr-defined]

    def hooks() -> None:
        idx_hook(index_q=iq, caches=c, batch=b, params=p, out=topk)
        att_hook(q=q, caches=c, topk=topk, batch=b, params=p, out=out[:T])
    rows["plugin hooks"] = hooks
    reg = _variant_registry(fast_launch=True) if name == "cuda" else None
    if reg is not None:
        fast_layer = mm3.SparseAttention(p, device=device, max_num_tokens=max(64, batch), backend="cuda",
                                         registry=reg)
        rows["layer, fast launch"] = lambda: fast_layer(q, iq, c, b, out)
        fsel = fast_layer.selection
        f_idx, f_att = fsel.indexer.plugin.index_topk, fsel.attention.plugin.attention_forward  # type: ignore[attr-defined]

        def fast_hooks() -> None:
            f_idx(index_q=iq, caches=c, batch=b, params=p, out=topk)
            f_att(q=q, caches=c, topk=topk, batch=b, params=p, out=out[:T])
        rows["plugin hooks, fast launch"] = fast_hooks
    launched = _variant_registry(merge_in_last_program=False, topk_in_last_program=False) if name == "cuda" else None
    if launched is not None:   # the decode top-k and merge as launches of their own, beside the rules
        launched_layer = mm3.SparseAttention(p, device=device, max_num_tokens=max(64, batch), backend="cuda",
                                             registry=launched)
        rows["layer, top-k and merge launched"] = lambda: launched_layer(q, iq, c, b, out)
    result = _interleaved(rows, iters, repeat, sync)
    if device.startswith("cuda"):
        from mm3_benchmarks.timing import capture_graph

        graph = capture_graph(lambda: layer(q, iq, c, b, out), warmups=3)
        replays = {"graph replay": graph.replay}
        if launched is not None:
            replays["graph replay, top-k and merge launched"] = capture_graph(
                lambda: launched_layer(q, iq, c, b, out), warmups=3).replay
        result.update(_interleaved(replays, iters, repeat, sync))
    return result


def measure_prefill_host(device: str = "cuda", tp: int = 8, query: int = 8192, context: int = 0,
                         iters: int = 20, repeat: int = 5) -> dict[str, float]:
    """Host time of one eager prefill step (``--prefill``), microseconds: the ``cuda`` layer with its
    launches direct (the default) and through Triton's own launch (``fast_launch=False``), side by side.

    A prefill step's GPU work (~0.4 ms at TP8 for an 8K chunk) hides its host time in a back-to-back
    loop, so each call is timed alone: the device is synchronised before it, and the time until
    the call returns is the host's (the launches are asynchronous); ``wall`` adds the wait for the
    GPU. Medians over ``iters`` calls, of the median round of ``repeat`` (rows in turn per round).
    """
    p = mm3.SparseAttentionParams.minimax_m3(tp_size=tp)
    case = make_case(p, prefills=[(query, query + context)], device=device, seed=0)
    q, iq, c, b = case.q, case.index_q, case.caches, case.batch
    out = torch.empty_like(q)
    layers = {"direct launches": mm3.SparseAttention(p, device=device, max_num_tokens=query, backend="cuda",
                                                     registry=_variant_registry(fast_launch=True)),
              "Triton's launches": mm3.SparseAttention(p, device=device, max_num_tokens=query, backend="cuda",
                                                       registry=_variant_registry(fast_launch=False))}
    for layer in layers.values():
        for _ in range(3):
            layer(q, iq, c, b, out)
    runs: dict[str, list[float]] = {f"{k}, {m}": [] for k in layers for m in ("host", "wall")}
    for _ in range(repeat):
        for name, layer in layers.items():
            host, wall = [], []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                layer(q, iq, c, b, out)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host.append((t1 - t0) * 1e6)
                wall.append((time.perf_counter() - t0) * 1e6)
            runs[f"{name}, host"].append(statistics.median(host))
            runs[f"{name}, wall"].append(statistics.median(wall))
    return {k: statistics.median(v) for k, v in runs.items()}


class _StubPlugin:
    """A backend that computes (through ``cpu_ref``) only while ``real``: after the guarded first
    step, its hooks return at once, so a step times mm3's own Python."""

    real = True

    def __init__(self) -> None:
        self._ref = default_registry().get("cpu_ref").plugin

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(name="stub", ops={"index_topk", "attention"}, device_types={"cpu"},
                                   topk_layout="head_major", max_decode_query_len=8,
                                   kv_cache_dtypes={"bfloat16", "float16", "float32"})

    @hookimpl
    def index_topk(self, index_q: torch.Tensor, caches: object, batch: object, params: object, out: object) -> None:
        if self.real:
            self._ref.index_topk(index_q=index_q, caches=caches, batch=batch, params=params, out=out)

    @hookimpl
    def attention_forward(self, q: torch.Tensor, caches: object, topk: object, batch: object, params: object,
                          out: torch.Tensor) -> None:
        if self.real:
            self._ref.attention_forward(q=q, caches=caches, topk=topk, batch=batch, params=params, out=out)


def _min_time(fn: Callable[[], object], iters: int, repeat: int) -> float:
    for _ in range(20):
        fn()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return min(runs)


def measure_stub_overhead(tp: int = 8, batch: int = 1, context: int = 4096, iters: int = 2000,
                          repeat: int = 7) -> dict[str, float]:
    """Microseconds per forward of mm3's own host code and of the Triton plugin's launch code, on the
    CPU, no kernel running (``--stub`` in the module docstring); NaN where this checkout cannot."""
    torch.set_num_threads(1)
    p = mm3.SparseAttentionParams.minimax_m3(tp_size=tp)
    stub = _StubPlugin()
    layer = mm3.SparseAttention(p, max_num_tokens=max(64, batch), backend="stub",
                                registry=Registry([stub], entry_points=False))
    case = make_case(p, decodes=[context] * batch, seed=0)
    q, iq, c, b = case.q, case.index_q, case.caches, case.batch
    out = torch.empty_like(q)
    T = b.num_tokens
    rows: dict[str, Callable[[], object]] = {"layer": lambda: layer(q, iq, c, b, out)}
    if hasattr(layer, "op_target"):
        rows["ops"] = _ops_row(layer, q, iq, c, b, out)
    sel, topk = layer.selection, layer.topk_buffer.rows(0, T)

    def backends() -> None:
        sel.indexer.index_topk(iq, c, b, p, topk)
        sel.attention.attention_forward(q, c, topk, b, p, out[:T])
    rows["backends"] = backends
    result: dict[str, float] = {}
    for k, fn in rows.items():
        try:
            fn()                      # the guarded first step of the kind: computed for real
            stub.real = False
            result[k] = _min_time(fn, iters, repeat)
        except mm3.MM3Error:          # e.g. ops guarded on every call (the guard sees the empty hooks)
            result[k] = float("nan")
        stub.real = True
    result.update(_triton_launch_code(p, case, iters, repeat))
    return result


def _triton_launch_code(p: mm3.SparseAttentionParams, case: object, iters: int, repeat: int) -> dict[str, float]:
    """The cuda plugin's ``attention_forward`` + ``index_topk`` launch code, its launches recorded, not made."""
    try:
        from mm3_backends.cuda.plugin import NVIDIA_LAUNCH
        from mm3_backends.triton import attention, indexer
        from mm3_backends.triton.fast_launch import recording
        from mm3_backends.triton.launch import override
    except ImportError:
        return {}
    # an H200's config; Triton's own launch (recorded below), as the fast launch needs a GPU driver
    cfg = NVIDIA_LAUNCH.for_device_sms(132)
    if "fast_launch" in getattr(cfg.algorithms, "__dataclass_fields__", {}):
        cfg = override(cfg, algorithms=dict(fast_launch=False))
    c, b = case.caches, case.batch  # type: ignore[attr-defined]
    q, iq = case.q, case.index_q  # type: ignore[attr-defined]
    topk = mm3.TopkBuffer.allocate(b.num_tokens, p.num_kv_heads, p.topk, layout="token_major")
    out = torch.empty_like(q)

    def step() -> None:
        indexer.index_topk(iq, c, b, p, topk, cfg)
        attention.attention_forward(q, c, topk, b, p, out, cfg)
    with recording():
        return {"triton launch code": _min_time(step, iters, repeat)}


def profile_layer(device: str, backend: Optional[str], tp: int, batch: int, context: int, n: int,
                  top: int = 30) -> None:
    """Print where the host time of ``n`` eager layer forwards goes (cProfile, by own and by cumulative time)."""
    import cProfile
    import pstats

    p = mm3.SparseAttentionParams.minimax_m3(tp_size=tp)
    name = backend or ("cuda" if device.startswith("cuda") else "cpu_ref")
    layer = mm3.SparseAttention(p, device=device, max_num_tokens=max(64, batch), backend=name)
    case = make_case(p, decodes=[context] * batch, device=device, seed=0)
    out = torch.empty_like(case.q)
    for _ in range(20):
        layer(case.q, case.index_q, case.caches, case.batch, out)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        layer(case.q, case.index_q, case.caches, case.batch, out)
    prof.disable()
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(order).print_stats(top)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description="host time per SparseAttention forward (us)")
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu (--stub: cpu)")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--stub", action="store_true", help="mm3's and the Triton plugin's host code alone, on the CPU")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="instead: N layer forwards under cProfile, the top functions by own and cumulative time")
    ap.add_argument("--stream", action="store_true",
                    help="instead: an engine-like stream of steps of new shapes through each entry point")
    ap.add_argument("--steps", type=int, default=200, help="--stream: steps in the stream")
    ap.add_argument("--seed", type=int, default=0, help="--stream: the stream's seed")
    ap.add_argument("--base", default=None, metavar="REF",
                    help="--stream: also measure git ref REF (a temporary worktree), side by side")
    ap.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                    help="instead: the host time of one eager prefill step of TOKENS new tokens after "
                         "--context cached ones (cuda backend; direct vs Triton's launches)")
    a = ap.parse_args(argv)
    if a.stub and a.stream and a.device not in (None, "cpu"):
        ap.error(f"--stub --stream runs on the CPU (the stand-in for a GPU), got --device {a.device}")
    a.device = a.device or ("cuda" if torch.cuda.is_available() and not (a.stub and a.stream) else "cpu")
    if a.base and not a.stream:
        ap.error("--base REF compares --stream runs; add --stream")
    if a.stream:
        _stream_main(ap, a)
        return
    if a.prefill:
        if not a.device.startswith("cuda"):
            ap.error(f"--prefill times the cuda backend's launches and needs a CUDA device, got --device "
                     f"{a.device}; run it on a GPU machine (or drop --prefill for the decode rows)")
        res = measure_prefill_host(a.device, a.tp, a.prefill, a.context)
        print(f"host us per eager prefill step, TP{a.tp} {a.prefill} new tokens after {a.context}, {a.device}:")
        for k, v in res.items():
            print(f"  {k:32s} {v:9.1f}")
        return
    if a.cprofile:
        profile_layer(a.device, a.backend, a.tp, a.batch, a.context, a.cprofile)
        return
    if a.stub:
        res = measure_stub_overhead(a.tp, a.batch, a.context, max(a.iters, 2000), max(a.repeat, 7))
    else:
        res = measure_host_overhead(a.device, a.backend, a.tp, a.batch, a.context, a.iters, a.repeat)
    if a.json:
        print(json.dumps(res))
        return
    where = "stub hooks, no kernels, cpu" if a.stub else a.device
    print(f"host us per forward, TP{a.tp} decode batch {a.batch} / {a.context}, {where}:")
    for k, v in res.items():
        print(f"  {k:22s} {v:9.1f}")


def _stream_main(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``--stream``: this checkout's measures (and ``--base``'s), as JSON or a table."""
    from mm3_benchmarks import stream

    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    if not a.stub:
        if not a.device.startswith("cuda") or not torch.cuda.is_available():
            ap.error(f"--stream without --stub runs the cuda backend's kernels and needs a CUDA device (got --device "
                     f"{a.device}, CUDA available: {torch.cuda.is_available()}); on a CPU machine use --stub")
    base = stream.measure_ref(a.base, a.steps, stub=a.stub, device=a.device, seed=a.seed) if a.base else None
    here = stream.measure_stream(a.steps, stub=a.stub, device=a.device, seed=a.seed)
    if a.json:
        print(json.dumps(here if base is None else {"base": base, "this": here}))
        return
    print(stream.format_table(here, base, a.base))


if __name__ == "__main__":
    main()
