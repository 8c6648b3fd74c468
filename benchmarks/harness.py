"""The mm3 benchmark harness: ceilings, decode and prefill grids, peers, in one run.

Run on a GPU (``mm3 bench --out DIR`` or ``python -m benchmarks.harness --out DIR``);
``--tiny`` runs the whole pipeline on tiny shapes (CPU is fine: the reference
backend, eager FlexAttention, SDPA's CPU kernels) in a few seconds.

What one run does, in priority order (configurations of priority > 0 are
skipped once ``--budget-s`` is spent, so the required ones always run):

1. ceilings: device-to-device copy (read + write), a pure read (a large sum),
   a large bf16 matmul;
2. decode (CUDA graphs, inputs rotated over enough disjoint page sets to be
   several times the L2): the backend's indexer, attention and whole step at
   M3 TP1 (64/4/4 heads) and TP8 (8/1/1), batch 1..256, context 8K..128K,
   decode query length 1 and 4, bf16 and fp8 index caches; peers on the same
   inputs: dense SDPA (flash, cuDNN, efficient) over the whole context,
   FlexAttention with a block mask from the same selection, cpu_ref;
3. prefill (8K-token chunks after 0 / 32K / 64K cached tokens): indexer,
   attention, step; dense causal SDPA, FlexAttention, cpu_ref;
4. writes ``results.json``, ``results.md``, ``decode_vs_context.png``,
   ``prefill_vs_context.png`` and ``blockmap.png`` into ``--out``.

Every configuration first checks the backend against cpu_ref on a few
requests (selection agreement, attention error) and FlexAttention's output
against the backend's, so a fast wrong kernel shows up in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import warnings

import torch

from mm3.contract import BatchMetadata, Op
from mm3.contract import TopkBuffer
from mm3.contract import SparseAttentionParams

from . import counts, inputs, peers, report
from .timing import Timer, Timing, ceilings, kernel_breakdown

__all__ = ["add_arguments", "run", "main", "DecodeCfg", "PrefillCfg", "full_grid", "tiny_grid"]

K = 1024


# -- configurations ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeCfg:
    shape: str
    batch: int
    context: int
    qlen: int = 1
    index_dtype: str = "bfloat16"
    priority: int = 1
    peers: tuple[str, ...] = ("sdpa",)
    kv_dtype: str = "bfloat16"
    q_dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        idx = {"nvfp4": "nvfp4"}.get(self.index_dtype, "fp8" if self.index_dtype.startswith("float8") else "bf16")
        return f"decode {self.shape} b{self.batch} ctx{_k(self.context)} q{self.qlen} idx-{idx}{_fmt_tag(self)}"


@dataclass(frozen=True)
class PrefillCfg:
    shape: str
    context: int
    chunk: int = 8 * K
    locality: float = 0.0
    priority: int = 1
    peers: tuple[str, ...] = ("sdpa", "flex")
    parts: tuple[str, ...] = ("indexer", "attention", "step")
    blockmap: bool = False
    kv_dtype: str = "bfloat16"
    q_dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        sel = "random" if self.locality == 0 else f"shared{self.locality:g}"
        return f"prefill {self.shape} {_k(self.chunk)} new ctx{_k(self.context)} sel-{sel}{_fmt_tag(self)}"


def _fmt_tag(c: Any) -> str:
    """The name's tail for K/V and query formats other than bf16: kv-fp8 (scaled), kv-fp8u (unscaled e4m3),
    kv-nvfp4, q-fp8."""
    kv = {FP8: " kv-fp8", "float8_e4m3fn_unscaled": " kv-fp8u", "nvfp4": " kv-nvfp4"}.get(c.kv_dtype, "")
    return kv + (" q-fp8" if c.q_dtype == FP8 else "")


def _k(n: int) -> str:
    return f"{n // K}K" if n >= K and n % K == 0 else str(n)


SHAPES_FULL = {"TP1": SparseAttentionParams.minimax_m3(tp_size=1),
               "TP8": SparseAttentionParams.minimax_m3(tp_size=8)}
SHAPES_TINY = {"tiny": SparseAttentionParams(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2,
                                             index_head_dim=32, block_size=16, topk=4)}

FP8 = "float8_e4m3fn"
Q8KV8 = "float8_e4m3fn_unscaled"
NVFP4 = "nvfp4"


def full_grid() -> list:
    """The H200 grid, required configurations (priority 0) first."""
    cfgs: list = [
        DecodeCfg("TP1", 64, 64 * K, priority=0, peers=("sdpa", "flex")),
        DecodeCfg("TP1", 64, 64 * K, index_dtype=FP8, priority=0, peers=()),
        DecodeCfg("TP1", 1, 64 * K, priority=0, peers=("sdpa", "flex", "cpu_ref")),
        DecodeCfg("TP1", 1, 64 * K, index_dtype=FP8, priority=0, peers=()),
        PrefillCfg("TP1", 0, priority=0, blockmap=True),
        PrefillCfg("TP1", 32 * K, priority=0, blockmap=True),
        PrefillCfg("TP1", 32 * K, locality=0.9, priority=0, peers=("flex",), blockmap=True),
        PrefillCfg("TP1", 0, locality=0.9, priority=0, peers=("flex",)),
        # fp8 K/V, beside the bf16 rows above: same shapes, same run
        DecodeCfg("TP1", 64, 64 * K, kv_dtype=FP8, priority=0, peers=()),
        DecodeCfg("TP1", 64, 64 * K, index_dtype=FP8, kv_dtype=FP8, priority=0, peers=()),
        DecodeCfg("TP1", 1, 64 * K, kv_dtype=FP8, priority=0, peers=()),
        DecodeCfg("TP1", 1, 64 * K, index_dtype=FP8, kv_dtype=FP8, priority=0, peers=()),
        PrefillCfg("TP1", 32 * K, priority=0, peers=(), kv_dtype=FP8),
        PrefillCfg("TP1", 0, priority=0, peers=(), kv_dtype=FP8),
        # the model authors' formats (docs/spec.md §1), beside the bf16 and fp8 rows: q8kv8 (fp8 queries, e4m3
        # K/V without a scale) and q8kv4 (fp8 queries, NVFP4 K/V; also with NVFP4 index keys). A backend that
        # does not declare a format records the refusal as the row's error (priority 1: a refusal does not
        # fail the run; listed here, they run before the budget is spent).
        *[DecodeCfg("TP1", b, 64 * K, index_dtype=idx, kv_dtype=kv, q_dtype=FP8, priority=1, peers=())
          for b in (64, 1) for kv, idx in ((Q8KV8, "bfloat16"), (NVFP4, "bfloat16"), (NVFP4, NVFP4))],
        DecodeCfg("TP8", 64, 64 * K, kv_dtype=NVFP4, q_dtype=FP8, priority=1, peers=()),
        *[PrefillCfg("TP1", ctx, priority=1, peers=(), kv_dtype=kv, q_dtype=FP8)
          for ctx in (32 * K, 0) for kv in (Q8KV8, NVFP4)],
    ]
    seen = {(c.shape, c.batch, c.context, c.qlen, c.index_dtype, c.kv_dtype, c.q_dtype) for c in cfgs
            if isinstance(c, DecodeCfg)}

    def add(c: Any) -> None:
        if isinstance(c, DecodeCfg):
            key = (c.shape, c.batch, c.context, c.qlen, c.index_dtype, c.kv_dtype, c.q_dtype)
            if key in seen:
                return
            seen.add(key)
        cfgs.append(c)

    add(DecodeCfg("TP8", 64, 64 * K, priority=1, peers=("sdpa", "flex")))
    add(DecodeCfg("TP1", 64, 16 * K, priority=1, peers=()))
    add(DecodeCfg("TP1", 64, 64 * K, qlen=4, priority=1, peers=("sdpa", "flex")))
    add(DecodeCfg("TP8", 64, 64 * K, index_dtype=FP8, priority=1, peers=()))
    add(PrefillCfg("TP1", 64 * K, priority=1, peers=(), parts=("indexer", "step")))
    for shape in ("TP1", "TP8"):
        for b in (1, 8, 64, 256):
            for ctx in (8 * K, 32 * K, 64 * K, 128 * K):
                big = shape == "TP1" and b == 256 and ctx == 128 * K
                add(DecodeCfg(shape, b, ctx, priority=2 if big else 1, peers=("sdpa",)))
    for shape in ("TP1", "TP8"):
        for b in (1, 64):
            add(DecodeCfg(shape, b, 64 * K, qlen=4, priority=1, peers=("sdpa",)))
    add(PrefillCfg("TP8", 0, priority=1))
    add(PrefillCfg("TP8", 32 * K, priority=1))
    add(PrefillCfg("TP8", 0, locality=0.9, priority=1, peers=("flex",)))
    add(PrefillCfg("TP8", 32 * K, locality=0.9, priority=1, peers=("flex",)))
    # opportunistic: the rest of the speculative and fp8 grid, cpu_ref on small shapes
    add(DecodeCfg("TP1", 8, 8 * K, priority=2, peers=("cpu_ref",)))
    add(DecodeCfg("TP8", 1, 8 * K, priority=2, peers=("cpu_ref",)))
    add(PrefillCfg("TP8", 0, priority=2, peers=("cpu_ref",), parts=("step",)))
    for shape in ("TP1", "TP8"):
        for b in (8, 256):
            for ctx in (8 * K, 32 * K, 128 * K):
                add(DecodeCfg(shape, b, ctx, qlen=4, priority=2, peers=()))
        for b in (8, 256):
            add(DecodeCfg(shape, b, 64 * K, qlen=4, priority=2, peers=()))
        for b in (1, 8, 64, 256):
            for ctx in (8 * K, 32 * K, 128 * K):
                add(DecodeCfg(shape, b, ctx, index_dtype=FP8, priority=2, peers=()))
    return cfgs


def tiny_grid() -> list:
    """Tiny shapes that exercise every code path in seconds (CPU is fine)."""
    all_peers = ("sdpa", "flex", "cpu_ref")
    return [
        DecodeCfg("tiny", 3, 200, priority=0, peers=all_peers),
        DecodeCfg("tiny", 3, 200, index_dtype=FP8, priority=0, peers=()),
        DecodeCfg("tiny", 3, 200, index_dtype=FP8, kv_dtype=FP8, priority=0, peers=()),
        DecodeCfg("tiny", 1, 64, priority=0, peers=all_peers),
        DecodeCfg("tiny", 2, 256, qlen=2, priority=0, peers=all_peers),
        DecodeCfg("tiny", 1, 256, priority=1, peers=("sdpa",)),
        PrefillCfg("tiny", 0, chunk=48, priority=0, peers=all_peers, blockmap=True),
        PrefillCfg("tiny", 80, chunk=48, priority=0, peers=all_peers, blockmap=True),
        PrefillCfg("tiny", 80, chunk=48, locality=0.9, priority=0, peers=("flex",), blockmap=True),
        PrefillCfg("tiny", 80, chunk=48, priority=0, peers=(), kv_dtype=FP8),
        DecodeCfg("tiny", 3, 200, index_dtype=NVFP4, kv_dtype=NVFP4, q_dtype=FP8, priority=1, peers=()),
        DecodeCfg("tiny", 3, 200, kv_dtype=Q8KV8, q_dtype=FP8, priority=1, peers=()),
        PrefillCfg("tiny", 80, chunk=48, priority=1, peers=(), kv_dtype=NVFP4, q_dtype=FP8),
    ]


# -- progress ---------------------------------------------------------------------------------------

class Progress:
    """One line per finished item, with a counter and the elapsed time."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = total
        self.done = 0
        self.t0 = time.perf_counter()
        # None: sys.stdout when a line is printed (a default bound at import would keep the stream
        # of whoever imported first, e.g. a test's capture that has been closed since)
        self.stream = stream

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def line(self, text: str, advance: bool = False) -> None:
        if advance:
            self.done += 1
        m, s = divmod(int(self.elapsed()), 60)
        print(f"[{self.done:3d}/{self.total} {m:2d}m{s:02d}s] {text}", file=self.stream or sys.stdout, flush=True)


# -- the runner -------------------------------------------------------------------------------------

def _fmt_t(ms: float) -> str:
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.3f} ms"


@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    timer: Timer
    shapes: dict[str, SparseAttentionParams]
    backend: Any
    reference: Any
    ceil: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    blockmaps: list[dict] = field(default_factory=list)
    rotate_bytes: int = 200 << 20
    progress: Optional[Progress] = None
    pool: Optional[inputs.Pool] = None
    pool_key: tuple = ()
    pool_hint: dict = field(default_factory=dict)   # shape -> pages of its largest planned config
    variants: list = field(default_factory=list)     # Variant objects timed beside the backend

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def log(self, text: str, advance: bool = False) -> None:
        if self.progress is not None:
            self.progress.line(text, advance)

    def add(self, **rec: Any) -> dict:
        rec = {k: v for k, v in rec.items() if v is not None}
        copy_bw = self.ceil.get("copy", {}).get("GBps")
        read_bw = self.ceil.get("read", {}).get("GBps")
        if "bytes" in rec and "ms" in rec and rec["ms"] > 0:
            rec["GBps"] = rec["bytes"] / rec["ms"] / 1e6
            if copy_bw:
                rec["pct_copy"] = 100.0 * rec["GBps"] / copy_bw
            if read_bw:
                rec["pct_read"] = 100.0 * rec["GBps"] / read_bw
        if "flops" in rec and "ms" in rec and rec["ms"] > 0:
            rec["TFLOPs"] = rec["flops"] / rec["ms"] / 1e9
        self.records.append(rec)
        return rec

    def get_pool(self, shape: str, pages: int) -> inputs.Pool:
        """The shape's pool with at least ``pages`` pages (one pool alive at a time)."""
        if self.pool is not None and self.pool_key[0] == shape and self.pool.num_pages >= pages:
            return self.pool
        self.pool = None
        if self.gpu:
            torch.cuda.empty_cache()
        p = self.shapes[shape]
        cap = int(self.args.pool_gb * (1 << 30)) // inputs.page_bytes(p)
        want = max(pages, min(cap, self.pool_hint.get(shape, pages)))
        if want > cap:
            raise MemoryError(f"needs {pages} pages ({pages * inputs.page_bytes(p) / 2**30:.1f} GiB) "
                              f"> --pool-gb {self.args.pool_gb}")
        t0 = time.perf_counter()
        self.pool = inputs.Pool(p, want, self.device, seed=self.args.seed)
        self.pool_key = (shape,)
        self.log(f"pool {shape}: {want} pages, {want * inputs.page_bytes(p) / 2**30:.1f} GiB "
                 f"({time.perf_counter() - t0:.1f} s)")
        return self.pool


def _step_bytes_estimate(p: SparseAttentionParams, c: DecodeCfg) -> int:
    nb = -(-c.context // p.block_size)
    kv_tokens = c.batch * p.num_kv_heads * min(p.topk * c.qlen, nb) * p.block_size
    return counts.decode_bytes(p, batch=c.batch, context=c.context, qlen=c.qlen, index_elt=_index_elt(c),
                               kv_elt=_kv_elt(c), kv_tokens=kv_tokens, q_elt=2)["step"]


def _index_elt(c: Any) -> float:
    """Bytes of one index-key element in configuration ``c`` (NVFP4: as :func:`_kv_elt`'s)."""
    return {FP8: 1, NVFP4: 9 / 16}.get(c.index_dtype, 2)


def _kv_elt(c: Any) -> float:
    """Bytes of one K or V element in configuration ``c`` (NVFP4: half a byte and a sixteenth of a scale)."""
    return {FP8: 1, Q8KV8: 1, NVFP4: 9 / 16}.get(c.kv_dtype, 2)


def _num_sets(ctx: Context, p: SparseAttentionParams, c: DecodeCfg) -> int:
    if ctx.args.sets:
        return ctx.args.sets
    return int(min(64, max(1, math.ceil(ctx.rotate_bytes / _step_bytes_estimate(p, c)))))


def _pages_needed(ctx: Context, c: Any) -> int:
    p = ctx.shapes[c.shape]
    if isinstance(c, DecodeCfg):
        return _num_sets(ctx, p, c) * c.batch * -(-c.context // p.block_size)
    return -(-(c.context + c.chunk) // p.block_size)


def _row_sets_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row of ``[..., K]`` id lists: True where both hold the same set."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def _check_against_reference(ctx: Context, be: Any, p: SparseAttentionParams, s: inputs.StepInputs,
                             buf: TopkBuffer, rows: slice, sub: BatchMetadata) -> dict:
    """The reference backend on a sub-batch (the rows ``rows`` of the step that ``be`` computed):
    selection agreement and attention error; ``{}`` when there is no reference other than ``be``."""
    ref = ctx.reference
    if ref is None or ref is be:
        return {}
    n = rows.stop - rows.start
    rbuf = ref.alloc_topk_buffer(n, p.num_index_heads, p.topk, ctx.device)
    ref.index_topk(s.index_q[rows].contiguous(), s.caches, sub, p, rbuf)
    mine = buf.head_major()[:, rows]
    same = _row_sets_equal(mine, rbuf.head_major()[:, :n])
    out = torch.empty_like(s.out[rows])      # the output's dtype: fp8 queries write bf16
    mine_buf = TopkBuffer(mine.contiguous())
    ref.attention_forward(s.q[rows].contiguous(), s.caches, mine_buf, sub, p, out)
    err = (out.float() - s.out[rows].float()).abs()
    return {"sel_match": float(same.float().mean().item()), "rows_checked": int(same.numel()),
            "attn_max_err": float(err.max().item()), "attn_mean_err": float(err.mean().item())}


def _merge_checks(got: list[dict]) -> dict:
    """The worst of several sub-batch checks (``{}`` when none was made)."""
    if not got or not got[0]:
        return {}
    return {"sel_match": min(g["sel_match"] for g in got), "rows_checked": sum(g["rows_checked"] for g in got),
            "attn_max_err": max(g["attn_max_err"] for g in got), "attn_mean_err": max(g["attn_mean_err"] for g in got)}


def _check_text(check: dict) -> str:
    """A check for the progress log: agreement and error, or why there is none."""
    if "sel_match" not in check:
        return "not checked (no reference other than the backend under test)"
    return f"sel {check['sel_match'] * 100:.0f}% max err {check['attn_max_err']:.1e}"


def _time_parts(ctx: Context, be: Any, p: SparseAttentionParams, sets: list[inputs.StepInputs],
                bufs: list[TopkBuffer], parts: tuple[str, ...], graph: bool,
                max_reps: Optional[int] = None) -> dict[str, Any]:
    # The calls were admitted by the caller's warm-up step: time the plugin's hooks as a step runs them
    # once admitted (Backend.invoke), the bare-kernel row the public paths are held against
    def idx(s: inputs.StepInputs, b: TopkBuffer) -> Callable[[], None]:
        return lambda: be.invoke(Op.INDEX_TOPK, (s.index_q, s.caches, s.batch, p, b, None))

    def att(s: inputs.StepInputs, b: TopkBuffer) -> Callable[[], None]:
        return lambda: be.invoke(Op.ATTENTION, (s.q, s.caches, b, s.batch, p, s.out))

    def step(s: inputs.StepInputs, b: TopkBuffer) -> Callable[[], None]:
        i, a = idx(s, b), att(s, b)

        def f() -> None:
            i()
            a()
        return f

    make = {"indexer": idx, "attention": att, "step": step}
    out = {}
    for part in parts:
        out[part] = ctx.timer.measure([make[part](s, b) for s, b in zip(sets, bufs)], graph=graph,
                                      max_reps=max_reps)
    return out


def _time_layer(ctx: Context, p: SparseAttentionParams, c: Any, sets: list[inputs.StepInputs],
                graph: bool) -> Timing:
    """The public path: ``mm3.SparseAttention`` on the bench's backend, called as an engine calls it
    (under ``torch.inference_mode()``; decode steps captured in a CUDA graph as engines capture:
    :func:`.timing.capture_graph`), so any cost of mm3's own beside the hooks shows against ``step``."""
    import mm3

    kv = None if c.kv_dtype == "bfloat16" else inputs.INDEX_DTYPES.get(c.kv_dtype, c.kv_dtype)
    idx = getattr(c, "index_dtype", "bfloat16")
    layer = mm3.SparseAttention(p, device=ctx.device, dtype=torch.bfloat16,
                                index_dtype=inputs.INDEX_DTYPES.get(idx, idx),  # type: ignore[arg-type]
                                kv_dtype=kv, q_dtype=torch.float8_e4m3fn if c.q_dtype == FP8 else None,
                                max_num_tokens=max(s.batch.num_tokens for s in sets),
                                max_decode_query_len=max(1, getattr(c, "qlen", 1)),
                                backend=ctx.backend.name, cuda_graph=graph and ctx.gpu)
    with torch.inference_mode():
        for s in sets:   # each batch kind's first step is guarded: the steady state is what is timed
            layer(s.q, s.index_q, s.caches, s.batch, out=s.out)
        t = ctx.timer.measure([lambda s=s: layer(s.q, s.index_q, s.caches, s.batch, out=s.out) for s in sets],
                              graph=graph)
    layer.check_page_ids()
    return t


def run_decode(ctx: Context, c: DecodeCfg) -> None:
    p = ctx.shapes[c.shape]
    S = _num_sets(ctx, p, c)
    pool = ctx.get_pool(c.shape, _pages_needed(ctx, c))
    sets = inputs.decode_sets(pool, batch=c.batch, context=c.context, qlen=c.qlen, num_sets=S,
                              index_dtype=c.index_dtype, kv_dtype=c.kv_dtype, q_dtype=c.q_dtype)
    be = ctx.backend
    T = c.batch * c.qlen
    bufs = [be.alloc_topk_buffer(T, p.num_index_heads, p.topk, ctx.device) for _ in sets]
    base = dict(kind="decode", shape=c.shape, batch=c.batch, context=c.context, qlen=c.qlen,
                index_dtype=c.index_dtype, kv_dtype=c.kv_dtype, config=c.name, priority=c.priority)

    # correctness first: backend vs cpu_ref on (up to) the first and last request of set 0
    s0, b0 = sets[0], bufs[0]
    be.index_topk(s0.index_q, s0.caches, s0.batch, p, b0)
    be.attention_forward(s0.q, s0.caches, b0, s0.batch, p, s0.out)
    ctx.timer.sync()
    got = []
    for r in sorted({0, c.batch - 1}):
        rows = slice(r * c.qlen, (r + 1) * c.qlen)
        sub = BatchMetadata.build([c.qlen], [c.context], s0.batch.block_table[r:r + 1], block_size=p.block_size,
                                  num_decodes=1, decode_query_len=c.qlen, device=ctx.device)
        got.append(_check_against_reference(ctx, be, p, s0, b0, rows, sub))
    check = _merge_checks(got)
    kv_tokens = counts.distinct_kv_tokens(b0.head_major()[:, :T], s0.batch.seq_lens, c.qlen, p.block_size)
    nbytes = counts.decode_bytes(p, batch=c.batch, context=c.context, qlen=c.qlen, index_elt=_index_elt(c),
                                 kv_elt=_kv_elt(c), kv_tokens=kv_tokens, q_elt=2)

    tm = _time_parts(ctx, be, p, sets, bufs, ("indexer", "attention", "step"), graph=True)
    tm["layer"] = _time_layer(ctx, p, c, sets, graph=True)
    nbytes["layer"] = nbytes["step"]
    kernels = _kernels(ctx, c, lambda: (be.index_topk(s0.index_q, s0.caches, s0.batch, p, b0),
                                        be.attention_forward(s0.q, s0.caches, b0, s0.batch, p, s0.out)))
    summary = []
    for part, t in tm.items():
        rec = ctx.add(**base, impl=f"mm3:{be.name}", part=part, bytes=nbytes[part], **t.as_dict(),
                      check=check if part == "step" else None, kernels=kernels if part == "step" else None)
        summary.append(f"{part} {_fmt_t(t.ms)}" + (f" ({rec['pct_copy']:.0f}% copy)" if "pct_copy" in rec else ""))
    ctx.log(f"{c.name} [{S} sets] mm3:{be.name}: " + ", ".join(summary) + f" | check: {_check_text(check)}")
    for vb in _variants_for(ctx, c, "decode"):
        _run_variant(ctx, p, c, vb, sets, base, nbytes=nbytes, graph=True, ref_ms=tm)

    nb = -(-c.context // p.block_size)
    dense_bytes = S * c.batch * p.num_kv_heads * nb * p.block_size * p.head_dim * 2 * 2
    want_dense = ("sdpa" in c.peers or "flex" in c.peers)
    if want_dense and dense_bytes > ctx.args.dense_limit_gb * (1 << 30):
        ctx.add(**base, impl="sdpa", part="attention", note=f"skipped: dense K/V {dense_bytes / 2**30:.0f} GiB "
                f"> --dense-limit-gb {ctx.args.dense_limit_gb}")
        want_dense = False
    if want_dense:
        dense = [inputs.dense_kv(s.caches, s.batch.block_table, nb, c.context) for s in sets]
        scale = p.softmax_scale
        if "sdpa" in c.peers:
            qf = [peers.fold_decode_q(s.q, c.batch, c.qlen, p.num_kv_heads).contiguous() for s in sets]
            for name in _sdpa_names(ctx):
                impl = f"sdpa:{name or 'default'}"
                try:
                    fns = [peers.sdpa_decode_fn(q, k, v, scale, name) for q, (k, v) in zip(qf, dense)]
                    t = ctx.timer.measure(fns, graph=True)
                    ctx.add(**base, impl=impl, part="attention", bytes=dense_bytes // S + nbytes["q_out"],
                            **t.as_dict())
                    ctx.log(f"  {impl}: {_fmt_t(t.ms)}")
                except Exception as e:  # a backend that does not serve this shape
                    ctx.add(**base, impl=impl, part="attention", error=_err(e))
                    ctx.log(f"  {impl}: n/a ({_err(e)[:100]})")
            del qf
        if "flex" in c.peers:
            _flex_decode(ctx, p, c, sets, bufs, dense, base, nbytes)
        del dense
    if "cpu_ref" in c.peers and ctx.reference is not None and ctx.reference is not be:
        ref = ctx.reference
        few = sets[:2]
        rbufs = [ref.alloc_topk_buffer(T, p.num_index_heads, p.topk, ctx.device) for _ in few]
        tr = _time_parts(ctx, ref, p, few, rbufs, ("indexer", "attention", "step"), graph=False, max_reps=10)
        for part, t in tr.items():
            ctx.add(**base, impl="cpu_ref", part=part, bytes=nbytes[part], **t.as_dict())
        ctx.log(f"  cpu_ref: step {_fmt_t(tr['step'].ms)}")


def _variants_for(ctx: Context, c: Any, kind: str) -> list:
    """The asked-for variants that change ``kind`` steps, if configuration ``c``'s priority is timed with
    variants; else none, and the log says so (a run whose variants all went unmeasured is no comparison)."""
    wanted = [v for v in ctx.variants if kind in v.kinds]
    if wanted and c.priority > ctx.args.variant_priority:
        ctx.log(f"  variants not timed on this configuration: its priority {c.priority} is above "
                f"--variant-priority {ctx.args.variant_priority} (pass --variant-priority {c.priority} to time them)")
        return []
    return wanted


def _run_variant(ctx: Context, p: SparseAttentionParams, c: Any, vb: Any, sets: list, base: dict, *,
                 graph: bool, ref_ms: dict, nbytes: Optional[dict] = None, counts_: Optional[dict] = None,
                 flops: Optional[dict] = None) -> None:
    """Check and time one launch-config variant on the same inputs as the default backend."""
    try:
        T = sets[0].q.shape[0]
        vbe = vb.backend
        bufs = [vbe.alloc_topk_buffer(T, p.num_index_heads, p.topk, ctx.device) for _ in sets]
        s0, b0 = sets[0], bufs[0]
        vbe.index_topk(s0.index_q, s0.caches, s0.batch, p, b0)
        vbe.attention_forward(s0.q, s0.caches, b0, s0.batch, p, s0.out)
        ctx.timer.sync()
        if base["kind"] == "decode":
            r = c.batch - 1
            rows = slice(r * c.qlen, (r + 1) * c.qlen)
            sub = BatchMetadata.build([c.qlen], [c.context], s0.batch.block_table[r:r + 1],
                                      block_size=p.block_size, num_decodes=1, decode_query_len=c.qlen,
                                      device=ctx.device)
        else:
            n = min(c.chunk, 256 if ctx.gpu else 16)
            rows = slice(c.chunk - n, c.chunk)
            sub = BatchMetadata.build([n], [c.context + c.chunk], s0.batch.block_table, block_size=p.block_size,
                                      num_decodes=0, device=ctx.device)
        check = _check_against_reference(ctx, vb, p, s0, b0, rows, sub)
        parts = ("indexer", "attention", "step") if base["kind"] == "decode" else c.parts
        tm = _time_parts(ctx, vbe, p, sets, bufs, parts, graph=graph)
        out = []
        for part, t in tm.items():
            extra = {"bytes": nbytes[part]} if nbytes else {"flops": flops[part], "bytes": counts_[f"{part}_bytes"]}
            ctx.add(**base, impl=f"mm3:{vb.name}", part=part, **extra, **t.as_dict(), variant=vb.overrides,
                    check=check if part == "step" else None)
            ratio = ref_ms[part].ms / t.ms if part in ref_ms else float("nan")
            out.append(f"{part} {_fmt_t(t.ms)} ({ratio:.2f}x)")
        ctx.log(f"  variant {vb.name}: " + ", ".join(out) + f" | {_check_text(check)}")
    except Exception as e:
        ctx.add(**base, impl=f"mm3:{vb.name}", part="step", error=_err(e))
        ctx.log(f"  variant {vb.name}: ERROR {_err(e)[:200]}")
        if ctx.gpu and ("CUDA error" in str(e) or "illegal" in str(e)):
            raise


def _flex_decode(ctx: Context, p: SparseAttentionParams, c: DecodeCfg, sets: list, bufs: list, dense: list,
                 base: dict, nbytes: dict) -> None:
    nb = -(-c.context // p.block_size)
    try:
        masks, fns = [], []
        for s, b, (k, v) in zip(sets, bufs, dense):
            bm = peers.selection_bitmap(b.head_major()[:, :c.batch * c.qlen], c.batch, c.qlen, nb)
            fm = peers.flex_block_mask(bm, offset=c.context - c.qlen, kv_len=c.context, group=p.gqa_group,
                                       block_size=p.block_size)
            q4 = s.q.view(c.batch, c.qlen, p.num_heads, p.head_dim).transpose(1, 2).contiguous()
            masks.append(fm)
            fns.append(peers.flex_fn(q4, k, v, fm, p.softmax_scale, compiled=ctx.gpu))
        o = fns[0]()
        got = o.transpose(1, 2).reshape(c.batch * c.qlen, p.num_heads, p.head_dim)
        err = (got.float() - sets[0].out.float()).abs().max().item()
        t = ctx.timer.measure(fns, graph=True)
        ctx.add(**base, impl="flex", part="attention", bytes=nbytes["attention"], **t.as_dict(),
                check={"max_abs_diff_vs_mm3": err, "blocks_per_tile": masks[0].union_blocks_per_tile})
        ctx.log(f"  flex: {_fmt_t(t.ms)} (first call {t.first_ms / 1e3:.1f} s; |flex - mm3| max {err:.1e})")
    except Exception as e:
        ctx.add(**base, impl="flex", part="attention", error=_err(e))
        ctx.log(f"  flex: n/a ({_err(e)[:160]})")


def run_prefill(ctx: Context, c: PrefillCfg) -> None:
    p = ctx.shapes[c.shape]
    pool = ctx.get_pool(c.shape, _pages_needed(ctx, c))
    s = inputs.prefill_inputs(pool, chunk=c.chunk, context=c.context, index_dtype="bfloat16",
                              locality=c.locality, kv_dtype=c.kv_dtype, q_dtype=c.q_dtype)
    be = ctx.backend
    buf = be.alloc_topk_buffer(c.chunk, p.num_index_heads, p.topk, ctx.device)
    base = dict(kind="prefill", shape=c.shape, context=c.context, chunk=c.chunk, locality=c.locality,
                index_dtype="bfloat16", kv_dtype=c.kv_dtype, config=c.name, priority=c.priority)
    be.index_topk(s.index_q, s.caches, s.batch, p, buf)
    be.attention_forward(s.q, s.caches, buf, s.batch, p, s.out)
    ctx.timer.sync()
    n = min(c.chunk, 256 if ctx.gpu else 16)
    rows = slice(c.chunk - n, c.chunk)
    sub = BatchMetadata.build([n], [c.context + c.chunk], s.batch.block_table, block_size=p.block_size,
                              num_decodes=0, device=ctx.device)
    check = _check_against_reference(ctx, be, p, s, buf, rows, sub)
    sel = buf.head_major()[:, :c.chunk]
    pos = s.batch.token_positions
    cnt = counts.prefill_counts(p, sel, pos, index_elt=2, kv_elt=_kv_elt(c))
    nb = -(-(c.context + c.chunk) // p.block_size)
    bitmap = peers.selection_bitmap(sel, 1, c.chunk, nb)
    pairs = bitmap[:, :, 1:] & bitmap[:, :, :-1]
    check["overlap_next_token"] = float(pairs.sum().item()) / max(1.0, float(bitmap[:, :, :-1].sum().item()))
    if c.blockmap:
        ctx.blockmaps.append({"config": c.name, "shape": c.shape, "context": c.context,
                              "bitmap": bitmap[0].to("cpu"), "overlap": check["overlap_next_token"]})
    flops = {"indexer": cnt["index_flops"], "attention": cnt["sparse_flops"],
             "step": cnt["index_flops"] + cnt["sparse_flops"]}
    tm = _time_parts(ctx, be, p, [s], [buf], c.parts, graph=False)
    if "step" in c.parts:
        tm["layer"] = _time_layer(ctx, p, c, [s], graph=False)
        flops["layer"], cnt["layer_bytes"] = flops["step"], cnt["step_bytes"]
    kernels = _kernels(ctx, c, lambda: (be.index_topk(s.index_q, s.caches, s.batch, p, buf),
                                        be.attention_forward(s.q, s.caches, buf, s.batch, p, s.out)))
    summary = []
    for part, t in tm.items():
        rec = ctx.add(**base, impl=f"mm3:{be.name}", part=part, flops=flops[part],
                      bytes=cnt[f"{part}_bytes"], **t.as_dict(), check=check if part == "step" else None,
                      kernels=kernels if part == "step" else None,
                      dense_flops=cnt["dense_flops"] if part != "indexer" else None)
        summary.append(f"{part} {_fmt_t(t.ms)} ({report.rate(rec['TFLOPs'])} TFLOP/s)")
    ctx.log(f"{c.name} mm3:{be.name}: " + ", ".join(summary) +
            f" | overlap {check['overlap_next_token']:.2f}, check: {_check_text(check)}")
    for vb in _variants_for(ctx, c, "prefill"):
        _run_variant(ctx, p, c, vb, [s], base, counts_=cnt, flops=flops, graph=False, ref_ms=tm)

    if "sdpa" in c.peers or "flex" in c.peers:
        k, v = inputs.dense_kv(s.caches, s.batch.block_table, nb, c.context + c.chunk)
        q4 = s.q.unsqueeze(0).transpose(1, 2).contiguous()          # [1, Hq, L, D]
        if "sdpa" in c.peers:
            for name in _sdpa_names(ctx):
                impl = f"sdpa:{name or 'default'}"
                try:
                    fn, how = peers.sdpa_prefill_fn(q4, k, v, p.softmax_scale, c.context, name)
                    t = ctx.timer.measure([fn])
                    td = t.as_dict()
                    td["note"] = "; ".join(x for x in (how, td.get("note")) if x)
                    ctx.add(**base, impl=impl, part="attention", flops=cnt["dense_flops"], **td)
                    ctx.log(f"  {impl}: {_fmt_t(t.ms)} ({report.rate(cnt['dense_flops'] / t.ms / 1e9)} dense TFLOP/s)")
                except Exception as e:
                    ctx.add(**base, impl=impl, part="attention", error=_err(e))
                    ctx.log(f"  {impl}: n/a ({_err(e)[:100]})")
        if "flex" in c.peers:
            try:
                fm = peers.flex_block_mask(bitmap, offset=c.context, kv_len=c.context + c.chunk,
                                           group=p.gqa_group, block_size=p.block_size)
                fn = peers.flex_fn(q4, k, v, fm, p.softmax_scale, compiled=ctx.gpu)
                o = fn()
                err = (o[0].transpose(0, 1).float() - s.out.float()).abs().max().item()
                t = ctx.timer.measure([fn])
                ctx.add(**base, impl="flex", part="attention", flops=cnt["sparse_flops"], **t.as_dict(),
                        check={"max_abs_diff_vs_mm3": err, "blocks_per_tile": fm.union_blocks_per_tile,
                               "full_fraction": fm.full_fraction})
                ctx.log(f"  flex: {_fmt_t(t.ms)} ({report.rate(cnt['sparse_flops'] / t.ms / 1e9)} sparse TFLOP/s; "
                        f"{fm.union_blocks_per_tile:.0f} blocks per 128-row tile; |flex - mm3| max {err:.1e})")
            except Exception as e:
                ctx.add(**base, impl="flex", part="attention", error=_err(e))
                ctx.log(f"  flex: n/a ({_err(e)[:160]})")
        del k, v
    if "cpu_ref" in c.peers and ctx.reference is not None and ctx.reference is not be:
        ref = ctx.reference
        rbuf = ref.alloc_topk_buffer(c.chunk, p.num_index_heads, p.topk, ctx.device)
        tr = _time_parts(ctx, ref, p, [s], [rbuf], ("step",), graph=False, max_reps=3)
        ctx.add(**base, impl="cpu_ref", part="step", flops=flops["step"], **tr["step"].as_dict())
        ctx.log(f"  cpu_ref: step {_fmt_t(tr['step'].ms)}")


def _kernels(ctx: Context, c: Any, fn: Callable[[], object]) -> Optional[dict[str, float]]:
    """Per-kernel device time of one eager step (profiler), for priority-0 configurations on a GPU."""
    if not ctx.gpu or (c.priority > 0 and not ctx.args.profile_all):
        return None
    try:
        k = kernel_breakdown(fn)
    except Exception as e:  # the profiler is a diagnostic; never fail the run for it
        return {"error": _err(e)}  # type: ignore[dict-item]
    ctx.log("  kernels (us, eager): " + ", ".join(f"{n.split('(')[0]} {v:.1f}" for n, v in list(k.items())[:6]))
    return k


def _sdpa_names(ctx: Context) -> list[Optional[str]]:
    if not ctx.gpu:
        return [None]
    wanted = {n.strip() for n in ctx.args.sdpa.split(",")}
    return [n for n in peers.SDPA_BACKENDS if n in wanted]


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# -- entry points -------------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="bench_out", help="output directory (JSON, Markdown, PNGs)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes through the whole pipeline (CPU is fine; seconds)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--backend", default="auto", help="backend under test (default: auto selection)")
    ap.add_argument("--reference", default="cpu_ref", help="reference backend for checks and as a peer")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="after this many seconds only priority-0 configurations still run")
    ap.add_argument("--max-priority", type=int, default=2, help="skip configurations above this priority")
    ap.add_argument("--only", default=None, help="regex: run only configurations whose name matches")
    ap.add_argument("--target-ms", type=float, default=40.0, help="GPU time spent per measurement")
    ap.add_argument("--sets", type=int, default=0, help="rotated input sets (0: enough for 4x L2)")
    ap.add_argument("--dense-limit-gb", type=float, default=24.0, help="largest dense K/V copy for peers")
    ap.add_argument("--pool-gb", type=float, default=96.0, help="largest paged-cache pool")
    ap.add_argument("--sdpa", default="flash,cudnn,efficient", help="SDPA backends to run as peers")
    ap.add_argument("--peers", default="sdpa,flex,cpu_ref",
                    help="peers to run where a configuration lists them (subset of sdpa,flex,cpu_ref; '' for none)")
    ap.add_argument("--no-ceilings", action="store_true",
                    help="skip measuring the copy-bandwidth and matmul ceilings (rows then show no %% of ceiling)")
    ap.add_argument("--variants", default="",
                    help="launch-config variants of the cuda plugin to time beside it (names, or ALL; "
                         "see benchmarks/variants.py)")
    ap.add_argument("--variant-priority", type=int, default=0,
                    help="time variants on configurations up to this priority")
    ap.add_argument("--profile-all", action="store_true",
                    help="per-kernel profiler breakdown for every configuration (default: priority 0 only)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def _pick_backend(name: str, device: torch.device, params: SparseAttentionParams) -> Any:
    """The backend ``name``, or for ``"auto"`` the one auto selection picks for both ops here
    (the bench times one backend's indexer, attention and step)."""
    from mm3.cli.main import UsageError
    from mm3.runtime.registry import default_registry
    from mm3.runtime.selection import requirements_for, select

    reg = default_registry()
    if name != "auto":
        return reg.get(name)
    req = requirements_for(params, torch.bfloat16, torch.bfloat16, device)
    sel = select(req, reg, device=device)
    if sel.indexer is not sel.attention:
        raise UsageError(f"auto selection picks attention={sel.attention.name} and indexer={sel.indexer.name} "
                         f"on {device}; mm3 bench times one backend for both ops: pass --backend NAME "
                         f"(e.g. --backend {sel.indexer.name})")
    return sel.attention


def _environment(device: torch.device) -> dict:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "host": platform.node(), "device": str(device),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env.update(gpu=prop.name, sms=prop.multi_processor_count, memory_GiB=round(prop.total_memory / 2**30, 1),
                   l2_MB=round(getattr(prop, "L2_cache_size", 0) / 1e6, 1), cuda=torch.version.cuda,
                   capability=f"{prop.major}.{prop.minor}")
    return env


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status (1 when a check failed or a required config errored)."""
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = SHAPES_TINY if args.tiny else SHAPES_FULL
    grid = tiny_grid() if args.tiny else full_grid()
    grid = [c for c in grid if c.priority <= args.max_priority and (not args.only or re.search(args.only, c.name))]
    allowed = {x.strip() for x in args.peers.split(",")}
    grid = [replace(c, peers=tuple(x for x in c.peers if x in allowed)) for c in grid]
    first_shape = next(iter(shapes.values()))
    be = _pick_backend(args.backend, dev, first_shape)
    ref = None
    try:
        ref = _pick_backend(args.reference, dev, first_shape)
    except Exception as e:
        print(f"reference backend {args.reference!r} unavailable: {_err(e)}", flush=True)
    if ref is not None and ref.name == be.name:
        ref = be
    timer = Timer(dev, target_ms=args.target_ms if not args.tiny else 2.0, max_reps=200 if not args.tiny else 5)
    ctx = Context(args, dev, timer, shapes, be, ref)
    if args.variants:
        from .variants import make_variants
        ctx.variants = make_variants(args.variants)
    if dev.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
        ctx.rotate_bytes = 4 * l2
    else:
        ctx.rotate_bytes = 1 << 16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _environment(dev)
    env.update(backend=be.name, reference=ref.name if ref is not None else None, command=_command_line(),
               rotate_bytes=ctx.rotate_bytes, tiny=bool(args.tiny), cuda_graphs=ctx.gpu)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    ctx.progress = Progress(len(grid) + (0 if args.no_ceilings else 1))
    ctx.log(f"mm3 bench on {env.get('gpu', dev)}: backend {be.name}, {len(grid)} configurations, "
            f"budget {args.budget_s:.0f} s for priority > 0")
    # one pool per shape sized for the largest configuration of the current priority
    for c in grid:
        if c.priority <= 1:
            ctx.pool_hint[c.shape] = max(ctx.pool_hint.get(c.shape, 0), _pages_needed(ctx, c))

    if not args.no_ceilings:
        big = dev.type == "cuda"
        ctx.ceil = ceilings(timer, copy_bytes=(2 << 30) if big else (8 << 20), matmul_n=8192 if big else 256)
        c_ = ctx.ceil
        ctx.log(f"ceilings: copy {c_['copy']['GBps']:.0f} GB/s (read+write), read {c_['read']['GBps']:.0f} GB/s, "
                f"bf16 matmul {report.rate(c_['matmul_bf16']['TFLOPs'])} TFLOP/s", advance=True)

    order = sorted(range(len(grid)), key=lambda i: (grid[i].priority, list(shapes).index(grid[i].shape), i))
    failed = False
    dead = False
    for i in order:
        c = grid[i]
        if dead:
            ctx.add(kind=_kind(c), config=c.name, shape=c.shape, priority=c.priority, note="skipped: device error")
            continue
        if c.priority > 0 and ctx.progress.elapsed() > args.budget_s:
            ctx.add(kind=_kind(c), config=c.name, shape=c.shape, priority=c.priority, note="skipped: time budget")
            ctx.log(f"{c.name}: skipped (time budget)", advance=True)
            continue
        try:
            (run_decode if isinstance(c, DecodeCfg) else run_prefill)(ctx, c)
            ctx.progress.done += 1
        except Exception as e:
            msg = _err(e)
            ctx.add(kind=_kind(c), config=c.name, shape=c.shape, priority=c.priority, error=msg)
            ctx.log(f"{c.name}: ERROR {msg}", advance=True)
            if os.environ.get("MM3_BENCH_TRACEBACK"):
                traceback.print_exc()
            failed = failed or c.priority == 0
            dead = "CUDA error" in msg or "illegal memory" in msg or "AcceleratorError" in msg
        if ctx.gpu and not dead:
            torch.cuda.synchronize()
    ctx.pool = None
    bad_checks = report.check_failures(ctx.records)
    for line in bad_checks:
        ctx.log(f"CHECK FAILED: {line}")
    files = report.write_all(out, env, ctx.ceil, ctx.records, ctx.blockmaps)
    ctx.log("wrote " + ", ".join(str(f) for f in files))
    print(report.summary_text(env, ctx.ceil, ctx.records), flush=True)
    return 1 if failed or bad_checks else 0


def _command_line() -> str:
    import shlex
    prog = Path(sys.argv[0]).name if sys.argv else "mm3"
    if prog in ("cli.py", "mm3", "__main__.py"):
        prog = "mm3"
    elif prog == "harness.py":
        prog = "python -m benchmarks.harness"
    return shlex.join([prog, *sys.argv[1:]])


def _kind(c: Any) -> str:
    return "decode" if isinstance(c, DecodeCfg) else "prefill"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
