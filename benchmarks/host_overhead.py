"""Host time per ``SparseAttention`` forward: eager, back-to-back calls, one sync at the end.

Where the GPU work of a step is ~10 us, the host decides the step time: each
row is (wall time of ``iters`` back-to-back calls, synchronised once) / iters,
median of ``repeat`` runs, in microseconds, for one decode step at MiniMax-M3
shapes::

    python -m mm3_benchmarks.host_overhead --device cuda --tp 8 --batch 1 --context 4096

Rows (a row is skipped when the installed mm3 lacks what it needs, so the same
script measures an older checkout for the "before" column):

* ``layer``: ``layer(q, index_q, caches, batch)`` with a ``BatchMetadata.build`` batch;
* ``layer, device batch``: the same with a batch of ``BatchMetadata.from_device``;
* ``ops``: ``torch.ops.mm3.index_topk`` + ``torch.ops.mm3.attention`` (the dispatcher path
  a compiled graph takes, called eagerly);
* ``backends``: the two bound ``Backend`` calls (mm3's checks, then the plugin);
* ``plugin hooks``: the two hook functions, no checks (the kernels' own launch code);
* ``graph replay``: the step captured in a ``torch.cuda.CUDAGraph`` and replayed (GPU only).

Run it in the new and the old checkout on the same machine and compare side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Optional

import torch

import mm3
from mm3.testing.factories import make_case

__all__ = ["measure_host_overhead"]


def _time(fn: Callable[[], object], iters: int, repeat: int, sync: Callable[[], None]) -> float:
    for _ in range(3):
        fn()
    sync()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(runs)


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
        from mm3.runtime.ops import batch_args

        args, h, st = batch_args(b), layer.op_target.handle, layer.topk_buffer.storage

        def ops() -> None:
            torch.ops.mm3.index_topk(iq, c.k, c.v, c.index, st, *args, h)
            torch.ops.mm3.attention(q, c.k, c.v, c.index, st, *args, h, out)
        rows["ops"] = ops
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
    result = {k: _time(fn, iters, repeat, sync) for k, fn in rows.items()}
    if device.startswith("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                layer(q, iq, c, b, out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(q, iq, c, b, out)
        result["graph replay"] = _time(graph.replay, iters, repeat, sync)
    return result


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description="host time per SparseAttention forward (us)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = measure_host_overhead(a.device, a.backend, a.tp, a.batch, a.context, a.iters, a.repeat)
    if a.json:
        print(json.dumps(res))
        return
    print(f"host us per forward, TP{a.tp} decode batch {a.batch} / {a.context}, {a.device}:")
    for k, v in res.items():
        print(f"  {k:22s} {v:9.1f}")


if __name__ == "__main__":
    main()
