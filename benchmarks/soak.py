"""Soak: many steps of randomly drawn batches through one layer per kind of batch, default checks on.

Every step draws a batch of its kind (decode batch sizes, speculative lengths,
prefill chunks, contexts up to ``--max-context``) over one shared paged cache,
runs it through that kind's layer with the default ``check_contracts="first"``
and a poisoned ``out`` with spare rows. Every ``--check-every`` steps the step
is compared with cpu_ref on the CPU (its attention run on the backend's own
selection, so near-ties cannot show up as errors; the selections' agreement
is reported), and the spare rows of ``out`` must still hold the poison. Memory
(allocated before / after, peak) is printed at the end; after the warm-up,
allocated memory must not grow (by more than the few block tables the
page-id check remembers).

H200 (at most about 3.5 minutes: the loop stops at ``--budget-s``, 180 by default, and says how many steps ran)::

    python -m mm3_benchmarks.soak --device cuda --backend cuda --steps 10000

CPU smoke run::

    python -m mm3_benchmarks.soak --steps 12 --max-context 2048 --max-decodes 4 --max-chunk 64 --check-every 4
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from mm3 import BatchMetadata, PagedKVCache, SparseAttention, SparseAttentionParams
from mm3.runtime.config import Settings

__all__ = ["soak"]

KINDS = ("decode", "speculative decode", "prefill", "mixed")
POISON = 7777.0


def _draw(kind: str, rng: random.Random, a: argparse.Namespace) -> tuple[list[int], list[int], int]:
    """query_lens, seq_lens, num_decodes of a random step of ``kind``."""
    ql: list[int] = []
    sl: list[int] = []
    nd = 0
    if kind in ("decode", "speculative decode", "mixed"):
        dq = rng.randint(2, a.max_spec) if kind == "speculative decode" else 1
        nd = rng.randint(1, a.max_decodes)
        for _ in range(nd):
            ql.append(dq)
            sl.append(rng.randint(dq, a.max_context))
    if kind in ("prefill", "mixed"):
        for _ in range(rng.randint(1, 2)):
            q = rng.randint(1, a.max_chunk)
            ql.append(q)
            sl.append(q + rng.choice([0, rng.randint(0, a.max_context - q)]))
    return ql, sl, nd


def soak(a: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(a.device)
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    p = SparseAttentionParams.minimax_m3(tp_size=a.tp)
    B = p.block_size
    pages = a.pages
    caches = PagedKVCache.allocate(pages, B, p.num_kv_heads, p.head_dim, p.index_head_dim,
                                   dtype=torch.bfloat16, device=dev)
    for t in (caches.k, caches.v, caches.index):
        t.normal_()
    max_tokens = a.max_decodes * a.max_spec + 2 * a.max_chunk
    settings = Settings(backend=a.backend)                 # check_contracts: the default, "first"
    layers = {k: SparseAttention(p, device=dev, max_num_tokens=max_tokens, max_decode_query_len=a.max_spec,
                                 backend=a.backend, settings=settings) for k in KINDS}
    ref = SparseAttention(p, device="cpu", max_num_tokens=max_tokens, max_decode_query_len=a.max_spec,
                          backend="cpu_ref", settings=Settings(backend="cpu_ref", check_contracts="never"))
    out_buf = torch.empty(max_tokens + 8, p.num_heads, p.head_dim, dtype=torch.bfloat16, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def mem() -> int:
        return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0

    def one_step(step: int, kind: str) -> None:
        ql, sl, nd = _draw(kind, rng, a)
        nblocks = max(-(-s // B) for s in sl)
        table = torch.randint(0, pages, (len(ql), nblocks), dtype=torch.int32, device=dev)
        batch = BatchMetadata.build(ql, sl, table, block_size=B, num_decodes=nd, device=dev)
        T = batch.num_tokens
        q = torch.randn(T, p.num_heads, p.head_dim, dtype=torch.bfloat16, device=dev)
        iq = torch.randn(T, p.num_index_heads, p.index_head_dim, dtype=torch.bfloat16, device=dev)
        check = a.check_every and step % a.check_every == a.check_every - 1
        if check:
            out_buf.fill_(POISON)
        out = layers[kind](q, iq, caches, batch, out=out_buf)
        if check:
            checks.append(_compare(layers[kind], ref, q, iq, caches, batch, out, out_buf, kind, step))

    sync()
    mem_before = mem()
    checks: list[dict[str, Any]] = []
    mem_warm = None
    warm_steps = 4 * len(KINDS)
    t0 = time.perf_counter()
    done = 0
    for step in range(a.steps):
        if time.perf_counter() - t0 > a.budget_s:
            break
        if step == warm_steps:
            sync()
            mem_warm = mem()
        # every kind in turn while warming up, then drawn at random
        one_step(step, KINDS[step % len(KINDS)] if step < warm_steps else rng.choice(KINDS))
        done += 1
    sync()
    layers["decode"].check_page_ids()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    return {"steps": done, "wall_s": wall, "checks": checks, "mem_before": mem_before,
            "mem_warm": mem_warm, "mem_after": mem(), "mem_peak": peak}


def _compare(layer: SparseAttention, ref: SparseAttention, q: torch.Tensor, iq: torch.Tensor,
             caches: PagedKVCache, batch: BatchMetadata, out: torch.Tensor, out_buf: torch.Tensor,
             kind: str, step: int) -> dict[str, Any]:
    """cpu_ref on the used pages only, on the backend's selection; spare rows still poisoned."""
    T = batch.num_tokens
    used = torch.unique(batch.block_table.to(torch.int64).flatten())
    remap = torch.full((caches.num_pages,), -1, dtype=torch.int64, device=used.device)
    remap[used] = torch.arange(used.numel(), device=used.device)
    small = PagedKVCache(caches.k[used].cpu(), caches.v[used].cpu(), caches.index[used].cpu())
    cb = BatchMetadata.build(batch.query_lens, batch.seq_lens_host, remap[batch.block_table.to(torch.int64)].cpu(),
                             block_size=batch.block_size, num_decodes=batch.num_decodes)
    sel = layer.topk_buffer.rows(0, T).to_layout("head_major").head_major().cpu()
    ref_sel = ref.topk_buffer.rows(0, T)
    ref(q.cpu(), iq.cpu(), small, cb)                                 # cpu_ref's own selection
    agree = float((ref_sel.head_major().sort(-1).values == sel.sort(-1).values).all(-1).float().mean())
    ref_sel.head_major().copy_(sel)                                   # now attend to the backend's
    want = torch.empty_like(out, device="cpu")
    ref._resolve().attention.attention_forward(q.cpu(), small, ref_sel, cb, ref.params, want)
    err = (out.float().cpu() - want.float()).abs()
    spare_ok = bool((out_buf[T:] == POISON).all())
    return {"step": step, "kind": kind, "tokens": T, "max_seq": batch.max_seq_len,
            "mean_err": float(err.mean()), "max_err": float(err.max()), "selection_agree": agree,
            "spare_rows_ok": spare_ok}


def main() -> None:  # python -m mm3_benchmarks.soak
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--budget-s", type=float, default=180.0)
    ap.add_argument("--max-context", type=int, default=131_072)
    ap.add_argument("--max-decodes", type=int, default=64)
    ap.add_argument("--max-spec", type=int, default=4)
    ap.add_argument("--max-chunk", type=int, default=2048)
    ap.add_argument("--pages", type=int, default=16_384)
    ap.add_argument("--check-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    r = soak(a)
    mib = 1 << 20
    print(f"{r['steps']} steps in {r['wall_s']:.1f} s ({1e3 * r['wall_s'] / max(r['steps'], 1):.2f} ms/step "
          f"incl. the sampled cpu_ref checks) on {a.backend}/{a.device}, contexts up to {a.max_context}")
    for c in r["checks"]:
        print(f"  step {c['step']:>6} {c['kind']:<19} T={c['tokens']:<5} max_seq={c['max_seq']:<7} "
              f"mean_err={c['mean_err']:.2e} max_err={c['max_err']:.2e} "
              f"selection_agree={100 * c['selection_agree']:.1f}% spare_rows_ok={c['spare_rows_ok']}")
    print(f"memory MiB: before {r['mem_before'] / mib:.1f}, after warm-up {(r['mem_warm'] or 0) / mib:.1f}, "
          f"after {r['mem_after'] / mib:.1f}, peak {r['mem_peak'] / mib:.1f}")
    bad = [c for c in r["checks"] if not c["spare_rows_ok"] or c["mean_err"] > 3e-4 or c["max_err"] > 2e-2]
    # slack: the page-id memo keeps the last few block tables alive
    grew = r["mem_warm"] is not None and r["mem_after"] > r["mem_warm"] + 4 * mib
    print("SOAK", "FAILED" if bad or grew else "PASSED",
          f"({len(bad)} bad sampled steps; allocated memory {'grew' if grew else 'flat'} after warm-up)")


if __name__ == "__main__":
    main()
