"""First timings of the Triton GPU backend at the MiniMax-M3 TP1 decode shape.

Measures, in one run on one GPU:

* the ceilings: device-to-device copy bandwidth (bytes read + written) and a
  pure-read bandwidth (a large reduction);
* the ``cuda`` plugin's decode indexer, decode attention and whole decode step
  (indexer + attention on a persistent top-k buffer), each captured in a CUDA
  graph and timed by ``triton.testing.do_bench`` (median; it clears the L2
  between runs), at batch 64 with a 64K context (bf16 and fp8 index caches)
  and at batch 1;
* the minimal bytes of each (index keys of every visible token + the selected
  K/V blocks + q/out) and the achieved bandwidth as a share of the copy's.

Before timing it checks a sample of tokens against the fp64 GPU reference of
tests/gpu, so a fast wrong kernel cannot report a number.

Run on a GPU machine, from the repository (it takes the reference from tests/gpu, so it is a
tool, not part of the installed benchmarks)::

    python tools/first_timings.py --json first_timings.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import torch

from mm3.contract import BatchMetadata
from mm3.contract import PagedKVCache
from mm3.contract import SparseAttentionParams
from mm3_benchmarks.timing import capture_graph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))

__all__ = ["main"]


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (L2 cleared between runs by do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def _graph(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    return capture_graph(fn, warmups=2)


def ceilings(nbytes: int = 2 << 30) -> dict[str, float]:
    """Copy (read + write) and pure-read bandwidth in GB/s on ``nbytes`` buffers."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    copy_ms = _bench(lambda: y.copy_(x))
    xf = x.view(torch.float32)
    read_ms = _bench(lambda: xf.sum())
    return {"copy_GBps": 2 * nbytes / copy_ms / 1e6, "read_GBps": nbytes / read_ms / 1e6,
            "copy_ms": copy_ms, "read_ms": read_ms, "buffer_bytes": nbytes}


def decode_case(p: SparseAttentionParams, batch: int, context: int, seed: int = 0):
    """Caches for ``batch`` requests of ``context`` tokens each (pages permuted), q and index_q."""
    B = p.block_size
    nb = context // B
    pages = batch * nb
    g = torch.Generator(device="cuda").manual_seed(seed)
    caches = PagedKVCache.allocate(pages, B, p.num_kv_heads, p.head_dim, p.index_head_dim,
                                   torch.bfloat16, torch.bfloat16, "NHD", "cuda")
    for t in (caches.k, caches.v, caches.index):
        t.normal_(generator=g)
    bt = torch.randperm(pages, device="cuda", generator=g).to(torch.int32).view(batch, nb)
    meta = BatchMetadata.build([1] * batch, [context] * batch, bt, block_size=B, num_decodes=batch,
                               device="cuda")
    q = torch.randn(batch, p.num_heads, p.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    iq = torch.randn(batch, p.num_index_heads, p.index_head_dim, device="cuda", generator=g,
                     dtype=torch.bfloat16)
    return caches, meta, q, iq


def minimal_bytes(p: SparseAttentionParams, batch: int, context: int, index_elt: int) -> dict[str, int]:
    """Fewest bytes one decode step must move (each input read once, each output written once)."""
    index_keys = batch * context * p.index_head_dim * index_elt
    kv = batch * p.num_kv_heads * min(p.topk, context // p.block_size) * p.block_size * p.head_dim * 2 * 2
    q_out = batch * p.num_heads * p.head_dim * 2 * 2 + batch * p.num_index_heads * p.index_head_dim * 2
    topk = batch * p.num_kv_heads * p.topk * 4
    return {"indexer": index_keys + batch * p.num_index_heads * p.index_head_dim * 2 + topk,
            "attention": kv + batch * p.num_heads * p.head_dim * 2 * 2 + topk,
            "step": index_keys + kv + q_out + topk}


def check_sample(plugin, p, caches, meta, q, iq, tokens) -> dict[str, float]:
    """Selection rules and attention error of ``tokens`` against the fp64 GPU reference."""
    from gpu_reference import attention_reference, block_scores, selection_errors

    buf = plugin.alloc_topk_buffer(meta.num_tokens, p.num_kv_heads, p.topk, q.device)
    out = torch.full_like(q, float("nan"))
    plugin.index_topk(iq, caches, meta, p, buf)
    plugin.attention_forward(q, caches, buf, meta, p, out)
    errors = selection_errors(buf, block_scores(iq, caches, meta, p, tokens), p)
    ref = attention_reference(q, caches, buf, meta, p, tokens)
    err = torch.stack([(out[t].double() - ref[t]).abs() for t in tokens])
    if errors or not torch.isfinite(err).all():
        raise SystemExit(f"wrong results, not timing: {errors[:3]} max err {err.max().item()}")
    return {"selection_errors": len(errors), "attn_max_err": err.max().item(), "attn_mean_err": err.mean().item()}


def time_step(plugin, p, caches, meta, q, iq) -> dict[str, float]:
    """Median ms of indexer, attention and the whole step, each replayed from a CUDA graph."""
    buf = plugin.alloc_topk_buffer(meta.num_tokens + 8, p.num_kv_heads, p.topk, q.device)
    step = buf.rows(0, meta.num_tokens)
    out = torch.empty_like(q)
    g_index = _graph(lambda: plugin.index_topk(iq, caches, meta, p, step))
    g_attn = _graph(lambda: plugin.attention_forward(q, caches, step, meta, p, out))

    def whole() -> None:
        plugin.index_topk(iq, caches, meta, p, step)
        plugin.attention_forward(q, caches, step, meta, p, out)

    g_step = _graph(whole)
    res = {"indexer_ms": _bench(g_index.replay), "attention_ms": _bench(g_attn.replay),
           "step_ms": _bench(g_step.replay)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        whole()
    torch.cuda.synchronize()
    res["eager_step_ms_wall"] = (time.perf_counter() - t0) / 20 * 1e3
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default="first_timings.json")
    args = ap.parse_args(argv)
    from mm3_backends.cuda import plugin

    p = SparseAttentionParams.minimax_m3(tp_size=1)
    dev = torch.cuda.get_device_properties(0)
    report: dict = {"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
                    "params": "M3 TP1 (64/4/4 heads, D=128, B=128, K=16), decode query len 1, bf16"}
    import triton
    report["triton"] = triton.__version__
    report["ceilings"] = ceil = ceilings()
    print(f"copy {ceil['copy_GBps']:.0f} GB/s, read {ceil['read_GBps']:.0f} GB/s", flush=True)

    caches, meta, q, iq = decode_case(p, args.batch, args.context)
    fp8 = PagedKVCache(caches.k, caches.v, caches.index.to(torch.float8_e4m3fn))
    one = BatchMetadata.build([1], [args.context], meta.block_table[:1].clone(), block_size=p.block_size,
                              num_decodes=1, device="cuda")
    rows = []
    for label, c, m, qq, ii, elt in (
            (f"batch {args.batch}, bf16 index", caches, meta, q, iq, 2),
            (f"batch {args.batch}, fp8 index", fp8, meta, q, iq, 1),
            ("batch 1, bf16 index", caches, one, q[:1].clone(), iq[:1].clone(), 2)):
        n = m.num_tokens
        sample = sorted({0, n // 3, n // 2, n - 1})
        entry = {"case": label, **check_sample(plugin, p, c, m, qq, ii, sample),
                 **time_step(plugin, p, c, m, qq, ii)}
        mb = minimal_bytes(p, n, args.context, elt)
        for part in ("indexer", "attention", "step"):
            gbps = mb[part] / entry[f"{part}_ms"] / 1e6
            entry[f"{part}_bytes"] = mb[part]
            entry[f"{part}_GBps"] = gbps
            entry[f"{part}_pct_copy"] = 100 * gbps / ceil["copy_GBps"]
        rows.append(entry)
        print(json.dumps(entry), flush=True)
    report["rows"] = rows
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)

    print(f"\n{report['device']}: copy {ceil['copy_GBps']:.0f} GB/s, read {ceil['read_GBps']:.0f} GB/s")
    print(f"{'case':28} {'part':10} {'us':>9} {'MB':>9} {'GB/s':>7} {'%copy':>6}")
    for e in rows:
        for part in ("indexer", "attention", "step"):
            print(f"{e['case']:28} {part:10} {e[f'{part}_ms'] * 1e3:9.1f} {e[f'{part}_bytes'] / 1e6:9.1f} "
                  f"{e[f'{part}_GBps']:7.0f} {e[f'{part}_pct_copy']:6.1f}")
        print(f"{e['case']:28} {'eager':10} {e['eager_step_ms_wall'] * 1e3:9.1f}  (wall, host included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
