"""Decode steps timed the way an engine runs them: the public layer in a CUDA graph, beside the bare hooks.

An engine warms its model up on a side stream, then captures a decode step
with ``torch.cuda.graph(g)`` (which captures on a stream of its own, often
with a memory pool shared between graphs), with every tensor made under
``torch.inference_mode()``. A model's decode graph holds every layer, so one
graph here holds ``layers`` steps on rotated inputs (disjoint pages), and a
step's time is a replay's over ``layers``. Rows, captured the same way and
timed in one run:

* ``layer``: ``mm3.SparseAttention.forward`` (what an engine calls);
* ``step op``: ``torch.ops.mm3.sparse_attention`` (what a compiled layer calls);
* ``ops``: ``torch.ops.mm3.index_topk`` / ``attention`` (its halves, for an engine that schedules them apart);
* ``hooks``: the plugin's two hooks on the bound backends, nothing of mm3 around them
  (a diagnostic: the gap between it and ``layer`` is mm3's own device work).

``--profile`` lists the kernels of one replay of the single-step layer graph.

Example (the arguments; a run needs a CUDA device):
    >>> args = parser().parse_args(["--tp", "1", "--batch", "1", "--context", "65536"])
    >>> args.tp, args.batch, args.layers, args.inference_mode
    (1, 1, 8, True)
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any, Callable, Optional

import torch

import mm3
from mm3.contract.hookspecs import Op
from mm3.runtime.ops import batch_args

from mm3_benchmarks import inputs
from mm3_benchmarks.timing import median_event_us

__all__ = ["parser", "measure", "main"]

Fn = Callable[[], object]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mm3_benchmarks.engine_path", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of M3's heads (1 or 8)")
    ap.add_argument("--batch", type=int, default=1, help="decode requests per step")
    ap.add_argument("--context", type=int, default=65536, help="tokens of context per request")
    ap.add_argument("--index-dtype", default="bfloat16", choices=sorted(inputs.INDEX_DTYPES))
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--layers", type=int, default=8, help="steps (rotated inputs) captured in one graph")
    ap.add_argument("--replays", type=int, default=50, help="timed replays per row")
    ap.add_argument("--shared-pool", action="store_true", help="capture with pool=torch.cuda.graph_pool_handle()")
    ap.add_argument("--no-inference-mode", dest="inference_mode", action="store_false",
                    help="make the tensors and run the steps outside torch.inference_mode()")
    ap.add_argument("--profile", action="store_true", help="list the kernels of one single-step layer replay")
    ap.add_argument("--backend", default=None, help="backend name (default: selection's choice)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    return ap


def _capture(fns: list[Fn], pool: Any = None) -> torch.cuda.CUDAGraph:
    """Warm-up on a side stream, then ``torch.cuda.graph(g)``: how engines capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        for f in fns:
            f()
    torch.cuda.synchronize()
    return g


def _kernels(g: torch.cuda.CUDAGraph) -> list[tuple[str, float]]:
    """The kernels of one replay of ``g`` with their device microseconds (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.name, e.device_time))
    return rows


#: the rows, in the order they are timed
ROWS = ("layer", "step op", "ops", "hooks")


def measure(tp: int = 1, batch: int = 1, context: int = 65536, index_dtype: str = "bfloat16",
            kv_dtype: str = "bfloat16", layers: int = 8, replays: int = 50, shared_pool: bool = False,
            inference_mode: bool = True, profile: bool = False, backend: Optional[str] = None) -> dict[str, Any]:
    """Time the rows of the module docstring for one decode shape on the current CUDA device."""
    mode = torch.inference_mode() if inference_mode else contextlib.nullcontext()
    with mode:
        p = mm3.SparseAttentionParams.minimax_m3(tp_size=tp)
        dev = torch.device("cuda")
        nb = -(-context // p.block_size)
        pool = inputs.Pool(p, num_pages=max(64, (layers + 1) * batch * nb), device=dev, seed=0)
        sets = inputs.decode_sets(pool, batch=batch, context=context, qlen=1, num_sets=layers,
                                  index_dtype=index_dtype, kv_dtype=kv_dtype)
        kv = inputs.INDEX_DTYPES[kv_dtype] if kv_dtype != "bfloat16" else None
        layer = mm3.SparseAttention(p, device=dev, dtype=torch.bfloat16,
                                    index_dtype=inputs.INDEX_DTYPES[index_dtype], kv_dtype=kv,
                                    max_num_tokens=batch, backend=backend, cuda_graph=True)
        target = layer.op_target
        idx, att = target.indexer, target.attention
        buf = layer.topk_buffer

        def layer_step(s: inputs.StepInputs) -> Fn:
            return lambda: layer(s.q, s.index_q, s.caches, s.batch, out=s.out)

        def ops_step(s: inputs.StepInputs) -> Fn:
            args, c, h = batch_args(s.batch), s.caches, target.handle

            def run() -> None:
                torch.ops.mm3.index_topk(s.index_q, c.k, c.v, c.index, buf.storage, *args, h, c.k_scale, c.v_scale)
                torch.ops.mm3.attention(s.q, c.k, c.v, c.index, buf.storage, *args, h, s.out, c.k_scale,
                                        c.v_scale)
            return run

        def step_op(s: inputs.StepInputs) -> Fn:
            args, c, h = batch_args(s.batch), s.caches, target.handle
            return lambda: torch.ops.mm3.sparse_attention(s.q, s.index_q, c.k, c.v, c.index, buf.storage, *args, h,
                                                          s.out, c.k_scale, c.v_scale)

        def hooks_step(s: inputs.StepInputs) -> Fn:
            rows = buf.rows(0, s.batch.num_tokens)

            def run() -> None:
                idx.invoke(Op.INDEX_TOPK, (s.index_q, s.caches, s.batch, p, rows, None))
                att.invoke(Op.ATTENTION, (s.q, s.caches, rows, s.batch, p, s.out))
            return run

        result: dict[str, Any] = dict(tp=tp, batch=batch, context=context, index_dtype=index_dtype,
                                      kv_dtype=kv_dtype, layers=layers, shared_pool=shared_pool,
                                      inference_mode=inference_mode, backend=layer.selection.attention.name)
        gpool = torch.cuda.graph_pool_handle() if shared_pool else None
        for name, make in zip(ROWS, (layer_step, step_op, ops_step, hooks_step)):
            g = _capture([make(s) for s in sets], gpool)
            result[f"{name}_us"] = median_event_us(g.replay, replays) / layers
            if profile:
                one = _capture([make(sets[0])], gpool)
                result[f"{name}_kernels"] = _kernels(one)
        layer.check_page_ids()
        result["layer_minus_hooks_us"] = result["layer_us"] - result["hooks_us"]
        return result


def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("engine_path needs a CUDA device (it times CUDA-graph replays)")
    r = measure(args.tp, args.batch, args.context, args.index_dtype, args.kv_dtype, args.layers, args.replays,
                args.shared_pool, args.inference_mode, args.profile, args.backend)
    print(f"decode TP{r['tp']} B{r['batch']} ctx {r['context']} index {r['index_dtype']} kv {r['kv_dtype']} "
          f"({r['backend']}, {r['layers']} steps per graph, shared pool {r['shared_pool']}, "
          f"inference mode {r['inference_mode']}):")
    for name in ROWS:
        print(f"  {name:7s} {r[name + '_us']:8.1f} us per step")
    print(f"  layer - hooks {r['layer_minus_hooks_us']:+.1f} us")
    for name in ROWS:
        for kname, us in r.get(f"{name}_kernels", []):
            print(f"    [{name}] {us:7.1f} us  {kname[:110]}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
