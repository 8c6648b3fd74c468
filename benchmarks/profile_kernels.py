"""One step of a bench configuration, bracketed for Nsight Compute: where the kernels' time goes.

Timings say how long a kernel takes; the hardware counters say what bounds it
(memory, tensor cores, instruction issue, which stall). This script builds the
inputs of one ``mm3 bench`` case, runs its step a few times to compile and
warm up, then runs it once more between ``cudaProfilerStart`` and
``cudaProfilerStop``, so that ``ncu --profile-from-start off`` collects
exactly that step's kernels::

    ncu --profile-from-start off --clock-control none --set full \\
        python -m mm3_benchmarks.profile_kernels --case prefill-TP1-32K

``--case graph-TP8-b1`` instead captures one ``SparseAttention`` decode
forward in a CUDA graph and prints the kernels of its replays from the
PyTorch profiler (no ncu needed): what a replay runs and for how long.

Cases (M3 shapes, bf16, the bench's random inputs): ``prefill-TP1-32K``,
``prefill-TP8-32K``, ``prefill-TP1-0`` (8K-token chunk after 32K / 0 cached
tokens, random queries), ``decode-TP1-b64`` and ``decode-TP1-b64-fp8kv``
(batch 64 at 64K, bf16 index; bf16 or fp8 K/V), ``graph-TP8-b1`` (batch 1 at 4K).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

import mm3
from mm3.contract import SparseAttentionParams
from mm3.runtime.registry import default_registry

from . import inputs
from .timing import capture_graph, kernel_breakdown

__all__ = ["CASES", "step_of", "main"]

CASES = ("prefill-TP1-32K", "prefill-TP8-32K", "prefill-TP1-0", "decode-TP1-b64", "decode-TP1-b64-fp8kv",
         "graph-TP8-b1")


def step_of(case: str, backend: str = "cuda", device: str = "cuda") -> Callable[[], None]:
    """The step (indexer, then attention) of a ``prefill-*`` / ``decode-*`` case, ready to call."""
    kind, tp, rest = case.split("-", 2)
    p = SparseAttentionParams.minimax_m3(tp_size=int(tp[2:]))
    be = default_registry().get(backend)
    if kind == "prefill":
        context = int(rest.rstrip("K")) * 1024
        pool = inputs.Pool(p, -(-(context + 8192) // p.block_size) + 8, torch.device(device))
        s = inputs.prefill_inputs(pool, chunk=8192, context=context, index_dtype="bfloat16")
    else:
        batch = int(rest.split("-")[0][1:])
        kv = "float8_e4m3fn" if rest.endswith("fp8kv") else "bfloat16"
        pool = inputs.Pool(p, batch * 512 + 8, torch.device(device))
        s = inputs.decode_sets(pool, batch=batch, context=65536, qlen=1, num_sets=1, index_dtype="bfloat16",
                               kv_dtype=kv)[0]
    buf = be.alloc_topk_buffer(s.batch.num_tokens, p.num_index_heads, p.topk, torch.device(device))

    def step() -> None:
        be.index_topk(s.index_q, s.caches, s.batch, p, buf)
        be.attention_forward(s.q, s.caches, buf, s.batch, p, s.out)
    return step


def _graph_kernels(device: str = "cuda") -> dict[str, tuple[float, float]]:
    """(device us, launches) per replay of each kernel of one TP8 batch-1 / 4K layer forward in a CUDA graph."""
    from mm3.testing.factories import make_case

    p = SparseAttentionParams.minimax_m3(tp_size=8)
    layer = mm3.SparseAttention(p, device=device, max_num_tokens=64, backend="cuda")
    case = make_case(p, decodes=[4096], device=device, seed=0)
    out = torch.empty_like(case.q)

    graph = capture_graph(lambda: layer(case.q, case.index_q, case.caches, case.batch, out), warmups=3)
    return kernel_breakdown(graph.replay, reps=20, counts=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--warmup", type=int, default=3, help="unprofiled steps first (compile, caches)")
    args = ap.parse_args(argv)
    if args.case.startswith("graph"):
        rows = _graph_kernels()
        for name, (us, n) in rows.items():
            print(f"{us:9.2f} us {n:5.1f}x  {name}")
        print(f"{sum(us for us, _ in rows.values()):9.2f} us {sum(n for _, n in rows.values()):5.1f}x  in all")
        return
    step = step_of(args.case, args.backend)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{args.case}: one step profiled")


if __name__ == "__main__":
    main()
