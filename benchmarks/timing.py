"""Timing: CUDA graphs or events on a GPU, the host clock on a CPU; medians; the hardware ceilings.

A measurement takes a *list* of step functions, one per rotated input set
(each set lives in different memory, so together they are several times the
L2 and no step finds its inputs cached by the previous one). On a GPU with
``graph=True`` the whole list is captured in one CUDA graph, replayed many
times, each replay timed with a pair of events; the reported time is the
median replay divided by the number of sets, i.e. the steady-state time of
one step with launch gaps as a graph-captured engine sees them.

Example:
    >>> import torch
    >>> t = Timer(torch.device("cpu"), target_ms=5)
    >>> x = torch.ones(1000)
    >>> r = t.measure([lambda: x.mul_(1.0)])
    >>> r.mode, r.reps >= 3, r.ms > 0
    ('host', True, True)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

__all__ = ["Timing", "Timer", "ceilings", "kernel_breakdown", "median_event_us"]

Fn = Callable[[], object]


@dataclass
class Timing:
    """One measurement: median (and spread) of the time of one step, in milliseconds."""

    ms: float
    p10: float
    p90: float
    reps: int
    sets: int
    mode: str                 # "graph" | "events" | "host"
    first_ms: float = 0.0     # wall time of the first (warm-up/compile) pass
    note: str = ""
    samples: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("samples")
        return d


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class Timer:
    """Times lists of step functions on ``device``; see the module docstring."""

    def __init__(self, device: torch.device, *, target_ms: float = 40.0, min_reps: int = 5,
                 max_reps: int = 200, warmup: int = 2) -> None:
        self.device = device
        self.target_ms = target_ms
        self.min_reps = min_reps
        self.max_reps = max_reps
        self.warmup = warmup
        self.gpu = device.type == "cuda"

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def _reps(self, one_ms: float) -> int:
        return int(min(self.max_reps, max(self.min_reps, self.target_ms / max(one_ms, 1e-4))))

    def measure(self, fns: Sequence[Fn], *, graph: bool = False, max_reps: int | None = None) -> Timing:
        """Median time of one step over ``fns`` (one function per rotated input set)."""
        fns = list(fns)
        t0 = time.perf_counter()
        for f in fns:            # compile / autotune / allocate outside the timed region
            f()
        self.sync()
        first = (time.perf_counter() - t0) * 1e3
        cap = self.max_reps if max_reps is None else max_reps
        if not self.gpu:
            return self._host(fns, first, cap)
        note = ""
        if graph:
            try:
                return self._graph(fns, first, cap)
            except Exception as e:  # e.g. a peer that syncs: fall back to events, say so
                note = f"graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); events"
                torch.cuda.synchronize()
        t = self._events(fns, first, cap)
        t.note = note
        return t

    def _host(self, fns: list[Fn], first: float, cap: int) -> Timing:
        samples = []
        reps = max(3, min(cap, self._reps(first / len(fns))))
        for _ in range(reps):
            t0 = time.perf_counter()
            for f in fns:
                f()
            samples.append((time.perf_counter() - t0) * 1e3 / len(fns))
        return self._result(samples, len(fns), "host", first)

    def _run_events(self, body: Fn, n: int, reps: int, first: float, mode: str) -> Timing:
        for _ in range(self.warmup):
            body()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
        for a, b in ev:
            a.record()
            body()
            b.record()
        torch.cuda.synchronize()
        samples = [a.elapsed_time(b) / n for a, b in ev]
        return self._result(samples, n, mode, first)

    def _probe_ms(self, body: Fn) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        body()
        a.record()
        body()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)

    def _events(self, fns: list[Fn], first: float, cap: int) -> Timing:
        def body() -> None:
            for f in fns:
                f()
        reps = min(cap, self._reps(self._probe_ms(body)))
        return self._run_events(body, len(fns), reps, first, "events")

    def _graph(self, fns: list[Fn], first: float, cap: int) -> Timing:
        def body() -> None:
            for f in fns:
                f()
        g = capture_graph(body)
        reps = min(cap, self._reps(self._probe_ms(g.replay)))
        t = self._run_events(g.replay, len(fns), reps, first, "graph")
        del g
        return t

    @staticmethod
    def _result(samples: list[float], sets: int, mode: str, first: float) -> Timing:
        return Timing(ms=statistics.median(samples), p10=_quantile(samples, 0.1), p90=_quantile(samples, 0.9),
                      reps=len(samples), sets=sets, mode=mode, first_ms=first, samples=samples)


def ceilings(timer: Timer, *, copy_bytes: int, matmul_n: int) -> dict[str, dict]:
    """Device-to-device copy (bytes read + written), pure read (a large sum) and a bf16 matmul.

    Inputs are random (zeros can run faster than real data).
    """
    dev = timer.device
    n = copy_bytes // 4
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    copy = timer.measure([lambda: y.copy_(x)])
    acc = torch.empty((), device=dev)
    read = timer.measure([lambda: torch.sum(x, dim=0, out=acc)])
    del y
    a = torch.randn(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    mm = timer.measure([lambda: torch.mm(a, b, out=c)])
    del x, a, b, c
    nbytes = n * 4
    return {
        "copy": {"bytes": 2 * nbytes, "GBps": 2 * nbytes / copy.ms / 1e6, **copy.as_dict()},
        "read": {"bytes": nbytes, "GBps": nbytes / read.ms / 1e6, **read.as_dict()},
        "matmul_bf16": {"n": matmul_n, "TFLOPs": 2 * matmul_n ** 3 / mm.ms / 1e9, **mm.as_dict()},
    }


def capture_graph(fn: Fn, warmups: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` run ``warmups`` times on a side stream (compiles, allocates, fills caches outside the
    capture), then captured into a CUDA graph; replay with ``.replay()``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_breakdown(fn: Fn, reps: int = 5, counts: bool = False) -> dict[str, Any]:
    """Device time (us) per call of ``fn`` spent in each kernel it runs, from the profiler.

    Launch gaps are not included: compare the sum with the graph time to see them.
    ``counts``: each value is ``(us, launches per call)`` instead.
    """
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0.0)
        if dev_us and e.count:
            out[e.key[:60]] = (dev_us / reps, e.count / reps) if counts else dev_us / reps
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0] if counts else -kv[1]))


def median_event_us(call: Fn, iters: int, warmups: int = 5) -> float:
    """Median microseconds of one ``call`` (a graph's ``replay``, or an eager step), each call timed by its own
    pair of CUDA events after ``warmups`` untimed ones (unlike :class:`Timer`, which times calls back to back)."""
    for _ in range(warmups):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)
