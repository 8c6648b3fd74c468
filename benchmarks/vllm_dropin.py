"""What vLLM's op signatures cost over mm3's own layer: decode steps in CUDA graphs, side by side.

One decode step at MiniMax-M3's shapes (default TP1, batch 1, 64K context), its
tensors in vLLM's layout (one ``[num_blocks, Hkv, 128, 2 * head_dim]`` KV cache,
the index cache, token-major top-k storage behind a head-major view), made under
``torch.inference_mode()`` and captured as engines capture (warm-up on a side
stream, ``torch.cuda.graph``), ``layers`` steps on rotated inputs (disjoint
pages) per graph. Rows, on the same memory, timed in one run:

* ``dropin``: ``minimax_m3_index_decode`` + ``minimax_m3_sparse_attn_decode``
  (:mod:`mm3.integrations.vllm`, what vLLM's layer calls; it builds the step's
  metadata from ``seq_lens`` inside the graph);
* ``layer``: ``mm3.SparseAttention.forward`` on views of the same caches, its
  batch built before the capture;
* ``layer_refill``: the layer with ``batch.update_from_device_(...)`` captured
  before it (an engine's per-step metadata refill, inside the graph);
* ``hooks``: the bound backends' two hooks alone.

``dropin - layer`` over 2 is the drop-in's cost per call (the target: <= 1 us on
the H200). ``--profile`` lists the kernels of a single-step replay of each row.

Example (on a CPU: the rows once each, eagerly, on tiny shapes, through cpu_ref):
    >>> r = check(device="cpu")
    >>> r["backend"], r["dropin_vs_layer_max_abs"] == 0.0
    ('cpu_ref', True)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import mm3
from mm3.contract.hookspecs import Op
from mm3.integrations import targets
from mm3.integrations import vllm as ops
from mm3.runtime.config import Settings
from mm3_benchmarks.timing import median_event_us

__all__ = ["parser", "build", "measure", "check", "main"]

Fn = Callable[[], object]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mm3_benchmarks.vllm_dropin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of M3's heads")
    ap.add_argument("--batch", type=int, default=1, help="decode requests per step")
    ap.add_argument("--context", type=int, default=65536, help="tokens of context per request")
    ap.add_argument("--layers", type=int, default=8, help="steps (rotated inputs) captured in one graph")
    ap.add_argument("--replays", type=int, default=50, help="timed replays per row")
    ap.add_argument("--backend", default="cuda", help="backend name (both the layer and the drop-in)")
    ap.add_argument("--profile", action="store_true", help="list the kernels of one single-step replay per row")
    ap.add_argument("--json", default=None, help="also append the results to this file")
    return ap


@dataclass
class Step:
    """One rotated decode step: vLLM's tensors, and the layer's views of the same memory."""

    q: torch.Tensor
    index_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    topk_storage: torch.Tensor     # [T, Hkv, K], token-major (vLLM's NVIDIA model allocates it so)
    out: torch.Tensor
    layer_out: torch.Tensor
    batch: mm3.BatchMetadata


def build(p: mm3.SparseAttentionParams, *, batch: int, context: int, layers: int, device: torch.device,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, mm3.PagedKVCache, list[Step]]:
    """``(kv_cache, index_cache, the layer's caches on the same memory, steps)``: N(0, 1) data."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, H, D, Di = p.block_size, p.num_kv_heads, p.head_dim, p.index_head_dim
    nb = -(-context // B)
    N = layers * batch * nb + 8
    kv = torch.randn((N, H, B, 2 * D), generator=g, device=device).to(torch.bfloat16)
    index = torch.randn((N, B, Di), generator=g, device=device).to(torch.bfloat16)
    k, v = kv.transpose(1, 2).chunk(2, dim=-1)
    caches = mm3.PagedKVCache(k, v, index)
    pages = torch.randperm(N, generator=g, device=device)[: layers * batch * nb].to(torch.int32)
    pages = pages.view(layers, batch, nb)
    steps = []
    for s in range(layers):
        sl = torch.full((batch,), context, dtype=torch.int32, device=device)
        bt = pages[s].contiguous()
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn((batch, p.num_heads, D), generator=g, device=device).to(torch.bfloat16)
        iq = torch.randn((batch, H, Di), generator=g, device=device).to(torch.bfloat16)
        meta = mm3.BatchMetadata.from_device(qsl, sl, bt, num_decodes=batch, num_tokens=batch, max_query_len=1,
                                             block_size=B)
        steps.append(Step(q, iq, sl, bt, qsl, torch.full((batch, H, p.topk), -1, dtype=torch.int32, device=device),
                          torch.empty_like(q), torch.empty_like(q), meta))
    return kv, index, caches, steps


def _rows(p: mm3.SparseAttentionParams, kv: torch.Tensor, index: torch.Tensor, caches: mm3.PagedKVCache,
          layer: mm3.SparseAttention, context: int) -> dict[str, Callable[[Step], Fn]]:
    H, K = p.num_kv_heads, p.topk
    idx, att = layer.op_target.indexer, layer.op_target.attention
    buf = layer.topk_buffer

    def dropin(s: Step) -> Fn:
        view = s.topk_storage.permute(1, 0, 2)

        def run() -> None:
            ops.minimax_m3_index_decode(s.index_q, index, s.block_table, s.seq_lens, context, K, p.init_blocks,
                                        p.local_blocks, H, 1, 1, out=view)
            ops.minimax_m3_sparse_attn_decode(s.q, kv, view, s.block_table, s.seq_lens, H, p.softmax_scale, s.out, 1)
        return run

    def layer_step(s: Step) -> Fn:
        return lambda: layer(s.q, s.index_q, caches, s.batch, out=s.layer_out)

    def layer_refill(s: Step) -> Fn:
        def run() -> None:
            s.batch.update_from_device_(s.query_start_loc, s.seq_lens, s.block_table)
            layer(s.q, s.index_q, caches, s.batch, out=s.layer_out)
        return run

    def hooks(s: Step) -> Fn:
        rows = buf.rows(0, s.batch.num_tokens)

        def run() -> None:
            idx.invoke(Op.INDEX_TOPK, (s.index_q, caches, s.batch, p, rows, None))
            att.invoke(Op.ATTENTION, (s.q, caches, rows, s.batch, p, s.layer_out))
        return run

    return {"dropin": dropin, "layer": layer_step, "layer_refill": layer_refill, "hooks": hooks}


def _capture(fns: list[Fn]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    torch.cuda.synchronize()
    return graph


def _kernels(graph: torch.cuda.CUDAGraph) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _layer(p: mm3.SparseAttentionParams, device: torch.device, batch: int, backend: str,
           graph: bool) -> mm3.SparseAttention:
    targets.configure(Settings(backend=backend))
    return mm3.SparseAttention(p, device=device, dtype=torch.bfloat16, max_num_tokens=batch, backend=backend,
                               cuda_graph=graph)


def measure(tp: int = 1, batch: int = 1, context: int = 65536, layers: int = 8, replays: int = 50,
            backend: str = "cuda", profile: bool = False) -> dict[str, Any]:
    """Time the rows of the module docstring on the current CUDA device."""
    with torch.inference_mode():
        p = mm3.SparseAttentionParams.minimax_m3(tp_size=tp)
        dev = torch.device("cuda")
        kv, index, caches, steps = build(p, batch=batch, context=context, layers=layers, device=dev)
        layer = _layer(p, dev, batch, backend, graph=True)
        rows = _rows(p, kv, index, caches, layer, context)
        result: dict[str, Any] = dict(tp=tp, batch=batch, context=context, layers=layers, backend=backend)
        try:
            for name, make in rows.items():
                result[f"{name}_us"] = median_event_us(_capture([make(s) for s in steps]).replay, replays) / layers
                if profile:
                    result[f"{name}_kernels"] = _kernels(_capture([make(steps[0])]))
            result["dropin_backends"] = sorted({(x.indexer.name, x.attention.name) for x in targets.selections()})
        finally:
            targets.configure()
        s = steps[0]
        result["dropin_vs_layer_max_abs"] = float((s.out.float() - s.layer_out.float()).abs().max())
        result["dropin_minus_layer_us_per_call"] = (result["dropin_us"] - result["layer_us"]) / 2
        return result


def check(device: str = "cpu", backend: str = "cpu_ref") -> dict[str, Any]:
    """Each row once, eagerly, on tiny shapes: the drop-in's output against the layer's (no timing)."""
    p = mm3.SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                                  block_size=16, topk=4)
    dev = torch.device(device)
    with torch.inference_mode():
        kv, index, caches, steps = build(p, batch=2, context=100, layers=2, device=dev)
        layer = _layer(p, dev, 2, backend, graph=False)
        try:
            for make in _rows(p, kv, index, caches, layer, 100).values():
                make(steps[0])()
        finally:
            targets.configure()
    s = steps[0]
    return {"backend": layer.selection.attention.name,
            "dropin_vs_layer_max_abs": float((s.out.float() - s.layer_out.float()).abs().max())}


def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("vllm_dropin needs a CUDA device (it times CUDA-graph replays); check() runs on a CPU")
    r = measure(args.tp, args.batch, args.context, args.layers, args.replays, args.backend, args.profile)
    print(f"decode TP{r['tp']} B{r['batch']} ctx {r['context']} ({r['backend']}, {r['layers']} steps per graph, "
          f"inference mode, drop-in on {r['dropin_backends']}):")
    for name in ("dropin", "layer", "layer_refill", "hooks"):
        print(f"  {name:13s} {r[name + '_us']:8.2f} us per step")
    print(f"  dropin - layer: {r['dropin_minus_layer_us_per_call']:+.2f} us per call (2 calls per step); "
          f"outputs differ by at most {r['dropin_vs_layer_max_abs']:.3g}")
    for name in ("dropin", "layer", "layer_refill", "hooks"):
        for kname, us in r.get(f"{name}_kernels", []):
            print(f"    [{name}] {us:7.1f} us  {kname[:110]}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
