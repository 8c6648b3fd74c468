"""The contract guard's own cost per step (:mod:`mm3.debug.guard`).

Overhead, measured in the development container (cpu_ref, 2 CPU cores, torch
2.13, bf16, MiniMax-M3 shapes; one step of 16 decodes with 4K-8K contexts and
two 256-token prefills, 528 tokens; best of 9, interleaved). ``guard ms`` is
the guard's own cost per step (both hooks), timed around a backend that only
copies precomputed results::

    $ python -m mm3_benchmarks.guard_overhead
    shape                        tokens   off ms    on ms  guard ms guard/off
    M3 TP8 (Hq 8, Hkv 1)            528     74.7     73.0      2.09      2.8%
    M3 TP2 (Hq 32, Hkv 2)           528    455.1    430.6      5.58      1.2%

About 2 ms (TP8) and 5.6 ms (TP2) per step in two runs on a quiet machine:
1-3 % of a cpu_ref step, below the whole-step noise (a loaded machine scatters
these figures by up to 10x). On a GPU the step is much faster,
so the share is much larger (tests/gpu/test_graph_soak.py prints it);
docs/errors.md has the details.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from mm3 import SparseAttention, SparseAttentionParams, TopkBuffer
from mm3.contract.hookspecs import Op
from mm3.debug.guard import checked_call, fill_sentinel
from mm3.plugin import BackendCapabilities, hookimpl
from mm3.runtime.config import Settings
from mm3.runtime.registry import Registry
from mm3.testing.factories import make_case

__all__ = ["measure_overhead"]


class _Replay:
    """A plugin that copies precomputed results: timing it isolates the guard's own cost."""

    def __init__(self, caps: BackendCapabilities, topk: TopkBuffer, out: torch.Tensor) -> None:
        self.caps, self.topk, self.out = caps.model_copy(update={"name": "replay"}), topk, out

    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return self.caps

    @hookimpl
    def index_topk(self, out: TopkBuffer) -> None:
        out.copy_(self.topk)

    @hookimpl
    def attention_forward(self, out: torch.Tensor) -> None:
        out.copy_(self.out)


def measure_overhead(repeat: int = 9, shapes: Sequence[int] = (8, 2)) -> list[dict[str, Any]]:
    """Best-of-``repeat`` ms per step with the guard off and on, at MiniMax-M3 shapes (TP ``shapes``).

    ``off``/``on``: a whole ``SparseAttention`` step on cpu_ref; ``guard``: the
    guard's own cost per step (both hooks), timed around a backend that only
    copies precomputed results. Needs the cpu_ref backend installed.
    """
    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    results = []
    for tp in shapes:
        p = SparseAttentionParams.minimax_m3(tp_size=tp)
        decodes = [4096 + 256 * i for i in range(16)]
        case = make_case(p, decodes=decodes, prefills=[(256, 2048), (256, 256)], seed=0)
        T = case.batch.num_tokens
        row: dict[str, Any] = {"shape": f"M3 TP{tp} (Hq {p.num_heads}, Hkv {p.num_kv_heads})",
                               "tokens": T}
        layers = {label: SparseAttention(p, max_num_tokens=1024, backend="cpu_ref",
                                         settings=Settings(check_contracts=on, backend="cpu_ref"))
                  for label, on in (("off", False), ("on", True))}
        be = layers["off"]._resolve().indexer
        topk = be.alloc_topk_buffer(T, p.num_kv_heads, p.topk, "cpu")
        out = torch.empty_like(case.q)
        be.index_topk(case.index_q, case.caches, case.batch, p, topk)
        be.attention_forward(case.q, case.caches, topk, case.batch, p, out)
        replay = Registry(plugins=[_Replay(be.capabilities, topk, out)], entry_points=False).get("replay")
        buf = fill_sentinel(replay.alloc_topk_buffer(1024, p.num_kv_heads, p.topk, "cpu"))
        step_out = torch.empty_like(out)

        def step(run: Any) -> None:     # the hook calls a step makes once admitted, plain or guarded
            rows = buf.rows(0, T)
            run(replay, Op.INDEX_TOPK, (case.index_q, case.caches, case.batch, p, rows, None))
            run(replay, Op.ATTENTION, (case.q, case.caches, rows, case.batch, p, step_out))

        times: dict[str, list[float]] = {"off": [], "on": [], "replay": [], "replay+guard": []}
        for i in range(repeat + 2):
            # Interleaved, so allocator warm-up and machine noise hit all alike.
            got = {label: timed(lambda: layer(case.q, case.index_q, case.caches, case.batch))
                   for label, layer in layers.items()}
            got["replay"] = timed(lambda: step(lambda b, op, args: b.invoke(op, args)))
            got["replay+guard"] = timed(lambda: step(checked_call))
            if i >= 2:  # the first two rounds warm up
                for k, v in got.items():
                    times[k].append(v)
        # The fastest run of each: on a shared machine, noise only ever adds time.
        med = {k: min(v) for k, v in times.items()}
        row.update(off=med["off"], on=med["on"], guard=med["replay+guard"] - med["replay"])
        row["overhead"] = row["guard"] / row["off"]
        results.append(row)
    return results


if __name__ == "__main__":  # python -m mm3_benchmarks.guard_overhead
    print(f"{'shape':<28} {'tokens':>6} {'off ms':>8} {'on ms':>8} {'guard ms':>9} {'guard/off':>9}")
    for r in measure_overhead():
        print(f"{r['shape']:<28} {r['tokens']:>6} {r['off']:>8.1f} {r['on']:>8.1f} {r['guard']:>9.2f} "
              f"{100 * r['overhead']:>8.1f}%")
