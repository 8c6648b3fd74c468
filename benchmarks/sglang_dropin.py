"""What SGLang's op signatures cost over mm3's own layer, and how both compare with SGLang's own kernels.

One step at MiniMax-M3's shapes (``--tp`` 1 or 8; decode: ``--batch`` requests of
``--context`` tokens; prefill: each request a chunk of ``--tokens`` query tokens
at the end of its ``--context``), its tensors in SGLang's layout: token-major
``[slots, Hkv, D]`` K/V, ``[slots, 1, Di]`` index keys, a ``req_to_token`` pool
of 128-token pages (``--page-size 128``) and the step's ``slot_ids``. Rows, on
the same memory, timed in one run with CUDA events (the median of ``--iters``
calls after warm-up, each call timed by its own events):

* ``dropin``: :func:`mm3.integrations.sglang.minimax_sparse_decode` / ``minimax_sparse_prefill``
  (what SGLang's MiniMax-M3 backend calls after the one-import change; it builds the block table
  and the batch itself);
* ``dropin_slots``: the same call with ``page_size=1``: mm3 then reads ``req_to_token`` per token (token
  slots) instead of deriving a block table of 128-token pages and checking them each call; the
  kernels' cost of that addressing, beside the host work it saves;
* ``layer``: ``mm3.SparseAttention.forward`` on paged views of the same caches, its batch built
  before timing;
* ``sglang``: SGLang's own Triton functions of the same name
  (``sglang.srt.layers.attention.minimax_sparse_ops.minimax_sparse``), from an installed
  ``sglang``; without one the column is skipped with a note.

``--graph`` captures each decode row's call in a CUDA graph (warm-up on a side stream, as engines
capture) and times replays. ``dropin - layer`` is the drop-in's cost per step.

Example (on a CPU: the rows once each, eagerly, on tiny shapes, through cpu_ref):
    >>> r = check(device="cpu")
    >>> r["backend"], r["decode_dropin_vs_layer_max_abs"] < 1e-5, r["prefill_dropin_vs_layer_max_abs"] < 1e-5
    ('cpu_ref', True, True)
    >>> r["decode_slots_vs_layer_max_abs"] < 1e-5, r["prefill_slots_vs_layer_max_abs"] < 1e-5
    (True, True)
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import mm3
from mm3.integrations import sglang as dropin
from mm3.integrations import targets
from mm3.runtime.config import Settings
from mm3_benchmarks.timing import capture_graph, median_event_us

__all__ = ["parser", "build", "measure", "check", "main", "sglang_kernels"]

Fn = Callable[[], object]
#: where SGLang 0.5.23 keeps the two entry points
SGLANG_MODULE = "sglang.srt.layers.attention.minimax_sparse_ops.minimax_sparse"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mm3_benchmarks.sglang_dropin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="tensor-parallel sizes of M3's heads")
    ap.add_argument("--kind", choices=("decode", "prefill", "both"), default="both")
    ap.add_argument("--batch", type=int, default=8, help="requests per step")
    ap.add_argument("--context", type=int, default=65536, help="tokens of context per request (the chunk's included)")
    ap.add_argument("--tokens", type=int, default=2048, help="prefill: query tokens per request")
    ap.add_argument("--iters", type=int, default=50, help="timed calls (or replays) per row")
    ap.add_argument("--graph", action="store_true", help="decode: time CUDA-graph replays of each row's call")
    ap.add_argument("--backend", default="cuda", help="mm3 backend name (the layer and the drop-in)")
    ap.add_argument("--json", default=None, help="also append the results to this file")
    return ap


def sglang_kernels() -> tuple[Optional[Any], str]:
    """``(SGLang's module of the two entry points, "")``, or ``(None, why not)``."""
    try:
        return importlib.import_module(SGLANG_MODULE), ""
    except Exception as e:     # not installed, or built for another platform: the column is skipped
        return None, f"sglang column skipped: cannot import {SGLANG_MODULE} ({type(e).__name__}: {e})"


@dataclass
class Step:
    """One step in SGLang's tensors, and the layer's views of the same memory."""

    kind: str
    args: tuple[Any, ...]       # SGLang's positional arguments of the entry point
    kwargs: dict[str, Any]
    q: torch.Tensor
    index_q: torch.Tensor
    caches: mm3.PagedKVCache
    batch: mm3.BatchMetadata


def build(p: mm3.SparseAttentionParams, kind: str, *, batch: int, context: int, tokens: int, device: torch.device,
          dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Step:
    """A step of ``kind`` with N(0, 1) data; each request's pages a random permutation of the pool's."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, H, D, Di = p.block_size, p.num_kv_heads, p.head_dim, p.index_head_dim
    nb = -(-context // B)
    pages = batch * nb + 8
    slots = pages * B
    k, v = (torch.randn((slots, H, D), generator=g, device=device).to(dtype) for _ in range(2))
    index = torch.randn((slots, 1, Di), generator=g, device=device).to(dtype)
    bt = torch.randperm(pages, generator=g, device=device)[:batch * nb].to(torch.int32).view(batch, nb)
    offsets = torch.arange(B, dtype=torch.int32, device=device)
    req_to_token = (bt.unsqueeze(2) * B + offsets).flatten(1)                 # SGLang's pool, --page-size B
    slot_ids = torch.arange(batch, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    sel = (B, p.topk, p.init_blocks, p.local_blocks)
    caches = mm3.PagedKVCache(k.view(pages, B, H, D), v.view(pages, B, H, D), index[:, 0].view(pages, B, Di))
    kw = dict(sm_scale=p.softmax_scale, disable_index_value=True, page_size=B)
    if kind == "decode":
        T = batch
        q = torch.randn((T, p.num_heads, D), generator=g, device=device).to(dtype)
        iq = torch.randn((T, H, Di), generator=g, device=device).to(dtype)
        args: tuple[Any, ...] = (q, None, k, v, iq, None, index, None, req_to_token, slot_ids, seq_lens, context,
                                 1, *sel)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        meta = mm3.BatchMetadata.from_device(qsl, seq_lens.to(torch.int32), bt, num_decodes=batch, num_tokens=T,
                                             max_query_len=1, block_size=B)
    else:
        n = min(tokens, context)
        T = batch * n
        q = torch.randn((T, p.num_heads, D), generator=g, device=device).to(dtype)
        iq = torch.randn((T, H, Di), generator=g, device=device).to(dtype)
        cu = torch.arange(0, T + 1, n, dtype=torch.int32, device=device)
        prefix = torch.full((batch,), context - n, dtype=torch.int32, device=device)
        args = (q, k, v, None, iq, index, None, None, req_to_token, slot_ids, cu, seq_lens, prefix, n, context, 1,
                *sel)
        meta = mm3.BatchMetadata.from_device(cu, seq_lens.to(torch.int32), bt, num_decodes=0, num_tokens=T,
                                             max_query_len=n, block_size=B, context_lens=prefix)
    return Step(kind, args, kw, q, iq, caches, meta)


def _rows(step: Step, layer: mm3.SparseAttention, sglang: Optional[Any]) -> dict[str, Callable[[], Fn]]:
    """Each row's call, made once (its output tensor kept on the call for the comparison)."""
    fn = "minimax_sparse_decode" if step.kind == "decode" else "minimax_sparse_prefill"
    out = torch.empty_like(step.q)

    def ours() -> Fn:
        f = getattr(dropin, fn)
        return lambda: f(*step.args, **step.kwargs)

    def layer_step() -> Fn:
        return lambda: layer(step.q, step.index_q, step.caches, step.batch, out=out)

    def ours_on_slots() -> Fn:
        f, kw = getattr(dropin, fn), {**step.kwargs, "page_size": 1}
        return lambda: f(*step.args, **kw)

    rows: dict[str, Callable[[], Fn]] = {"dropin": ours, "dropin_slots": ours_on_slots, "layer": layer_step}
    if sglang is not None:
        theirs = getattr(sglang, fn)
        rows["sglang"] = lambda: (lambda: theirs(*step.args, **step.kwargs))
    return rows


def _time(call: Fn, iters: int, graph: bool) -> float:
    """Median microseconds of one call (or one replay of its captured graph), each timed by its own events."""
    return median_event_us(capture_graph(call, warmups=2).replay if graph else call, iters)


def _layer(p: mm3.SparseAttentionParams, device: torch.device, tokens: int, backend: str,
           graph: bool) -> mm3.SparseAttention:
    targets.configure(Settings(backend=backend))
    return mm3.SparseAttention(p, device=device, dtype=torch.bfloat16, max_num_tokens=tokens, backend=backend,
                               cuda_graph=graph)


def measure(tp: int, kind: str, batch: int = 8, context: int = 65536, tokens: int = 2048, iters: int = 50,
            graph: bool = False, backend: str = "cuda") -> dict[str, Any]:
    """Time the rows of the module docstring for one shape on the current CUDA device."""
    sglang, note = sglang_kernels()
    graph = graph and kind == "decode"
    with torch.inference_mode():
        p = mm3.SparseAttentionParams.minimax_m3(tp_size=tp)
        dev = torch.device("cuda")
        step = build(p, kind, batch=batch, context=context, tokens=tokens, device=dev)
        layer = _layer(p, dev, step.batch.num_tokens, backend, graph)
        r: dict[str, Any] = dict(tp=tp, kind=kind, batch=batch, context=context, backend=backend, graph=graph,
                                 tokens=step.batch.num_tokens, notes=[note] if note else [])
        try:
            for name, make in _rows(step, layer, sglang).items():
                try:
                    r[f"{name}_us"] = _time(make(), iters, graph)
                except Exception as e:     # SGLang's kernels on a shape or platform they refuse: say so
                    if name != "sglang":
                        raise
                    r["notes"].append(f"sglang column failed: {type(e).__name__}: {e}")
            r["dropin_backends"] = sorted({(x.indexer.name, x.attention.name) for x in targets.selections()})
        finally:
            targets.configure()
    r["dropin_minus_layer_us"] = r["dropin_us"] - r["layer_us"]
    return r


def check(device: str = "cpu", backend: str = "cpu_ref") -> dict[str, Any]:
    """The drop-in (on pages and on token slots) and the layer once each, eagerly, on tiny shapes, decode and
    prefill: their outputs' largest difference (no timing; SGLang's kernels are not called)."""
    p = mm3.SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2, index_head_dim=32,
                                  block_size=16, topk=4, init_blocks=0, local_blocks=1)
    dev = torch.device(device)
    res: dict[str, Any] = {}
    with torch.inference_mode():
        for kind in ("decode", "prefill"):
            step = build(p, kind, batch=2, context=100, tokens=9, device=dev, dtype=torch.float32)
            layer = mm3.SparseAttention(p, device=dev, dtype=torch.float32, index_dtype=torch.float32,
                                        max_num_tokens=step.batch.num_tokens, backend=backend)
            targets.configure(Settings(backend=backend))
            f = getattr(dropin, f"minimax_sparse_{kind}")
            try:
                o = f(*step.args, **step.kwargs)[1]
                o_slots = f(*step.args, **{**step.kwargs, "page_size": 1})[1]
            finally:
                targets.configure()
            ref = layer(step.q, step.index_q, step.caches, step.batch).float()
            res[f"{kind}_dropin_vs_layer_max_abs"] = float((o.float() - ref).abs().max())
            res[f"{kind}_slots_vs_layer_max_abs"] = float((o_slots.float() - ref).abs().max())
            res["backend"] = layer.selection.attention.name
    return res


def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sglang_dropin needs a CUDA device (it times CUDA kernels with CUDA events); check() runs "
                         "the rows once on a CPU")
    kinds = ("decode", "prefill") if args.kind == "both" else (args.kind,)
    for tp in args.tp:
        for kind in kinds:
            r = measure(tp, kind, args.batch, args.context, args.tokens, args.iters, args.graph, args.backend)
            line = (f"{kind} TP{tp} B{r['batch']} ctx {r['context']} ({r['tokens']} tokens, {r['backend']}"
                    f"{', CUDA graphs' if r['graph'] else ''}, drop-in on {r['dropin_backends']}):")
            print(line)
            for name in ("dropin", "dropin_slots", "layer", "sglang"):
                if f"{name}_us" in r:
                    print(f"  {name:12s} {r[name + '_us']:10.2f} us per step (median of {args.iters})")
            print(f"  dropin - layer: {r['dropin_minus_layer_us']:+.2f} us per step")
            for note in r["notes"]:
                print(f"  note: {note}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
