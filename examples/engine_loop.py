"""The loop an inference engine runs around mm3: pages, a scheduler, a compiled model, CUDA graphs.

* a **paged KV allocator** hands out 128-token pages (page 0 is scratch: padding
  tokens write there) and takes them back when a request finishes;
* a **scheduler** runs decodes first (each with ``1 + draft`` tokens; a random
  number of drafts is accepted) and then one chunk of a waiting prompt
  (chunked prefill), over several requests that arrive and finish;
* a **model** of a few ``SparseAttention`` layers writes each step's keys into its
  pages and attends; it is compiled with ``torch.compile(fullgraph=True)``, and
  on a GPU the decode-only steps (padded to a fixed batch) run through
  ``mode="reduce-overhead"``: captured in a CUDA graph once, then replayed;
* the metadata of every step is built from device tensors
  (``BatchMetadata.from_device``), with host ints the scheduler already knows;
* **checks**: every compiled step equals the eager model on the same inputs, and
  layer 0's output of every eager step matches the fp64 oracle.

Tokens are random: this exercises the attention plumbing of an engine, not a
language model. Run::

    python examples/engine_loop.py                   # CPU, cpu_ref, small shapes (CI)
    python examples/engine_loop.py --device cuda     # GPU: M3 TP8 shapes, cuda backend, CUDA graphs

It prints one line per step and exits non-zero when a check fails. A step's
times are the compiled call's wall time, which includes compilation whenever
that step has a shape the model was not yet compiled for, and the same call
repeated (compiled already: the step's own time).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

import torch

import mm3
from mm3.testing.oracle import oracle_attention

SMALL = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                                  index_head_dim=16, block_size=16, topk=4)
#: docs/spec.md §4, max |error| against fp64
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class PageAllocator:
    """Fixed-size pages of the paged caches; page 0 is reserved for padding writes."""

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, 0, -1))

    def grow(self, pages: list[int], tokens: int, block_size: int) -> None:
        while len(pages) * block_size < tokens:
            if not self.free:
                raise RuntimeError("out of KV pages: lower --requests or raise --pages")
            pages.append(self.free.pop())

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)
        pages.clear()


@dataclass
class Request:
    prompt: int
    to_generate: int
    done_prompt: int = 0
    generated: int = 0
    pages: list[int] = None  # type: ignore[assignment]

    @property
    def seq_len(self) -> int:
        return self.done_prompt + self.generated


class Scheduler:
    """Decodes first (uniform ``1 + draft`` tokens), then one prefill chunk, within ``max_batch`` requests."""

    def __init__(self, requests: list[Request], alloc: PageAllocator, *, block_size: int, chunk: int,
                 max_batch: int, draft: int, seed: int) -> None:
        self.waiting, self.running = list(requests), []  # type: list[Request], list[Request]
        self.alloc, self.B, self.chunk, self.max_batch, self.dql = alloc, block_size, chunk, max_batch, 1 + draft
        self.rng = random.Random(seed)

    def next_step(self) -> tuple[list[Request], list[int], int]:
        """The step's requests (decodes first), their query lengths, and the number of decodes."""
        decodes = [r for r in self.running if r.done_prompt == r.prompt]
        prefill = [r for r in self.running if r.done_prompt < r.prompt][:1]
        if not prefill and self.waiting and len(self.running) < self.max_batch:
            r = self.waiting.pop(0)
            r.pages = []
            self.running.append(r)
            prefill = [r]
        reqs = decodes + prefill
        qlens = [self.dql] * len(decodes) + [min(self.chunk, r.prompt - r.done_prompt) for r in prefill]
        for r, q in zip(reqs, qlens):
            self.alloc.grow(r.pages, r.seq_len + q, self.B)
        return reqs, qlens, len(decodes)

    def finish_step(self, reqs: list[Request], qlens: list[int], num_decodes: int) -> None:
        for i, (r, q) in enumerate(zip(reqs, qlens)):
            if i < num_decodes:  # speculative decoding: 1 + some of the drafts are accepted
                r.generated += self.rng.randint(1, q)
            else:
                r.done_prompt += q
            if r.generated >= r.to_generate:
                self.running.remove(r)
                self.alloc.release(r.pages)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running


class Model(torch.nn.Module):
    """``layers`` SparseAttention layers; each writes the step's keys into its pages, then attends."""

    def __init__(self, p: mm3.SparseAttentionParams, layers: int, num_pages: int, *, device: str,
                 dtype: torch.dtype, backend: str, max_tokens: int, max_dql: int) -> None:
        super().__init__()
        self.p, self.dtype, hidden = p, dtype, p.num_heads * p.head_dim
        g = torch.Generator().manual_seed(0)

        def w(n: int) -> torch.nn.Parameter:  # fp32, no bias: compiled and eager matmuls agree bitwise
            return torch.nn.Parameter((torch.randn(hidden, n, generator=g) / hidden ** 0.5).to(device),
                                      requires_grad=False)

        self.embed = torch.nn.Parameter(torch.randn(101, hidden, generator=g).to(device), requires_grad=False)
        self.wq, self.wiq, self.wk, self.wv, self.wi = (torch.nn.ParameterList([w(n) for _ in range(layers)]) for n in (
            hidden, p.num_index_heads * p.index_head_dim, p.num_kv_heads * p.head_dim,
            p.num_kv_heads * p.head_dim, p.index_head_dim))
        self.caches = [mm3.PagedKVCache.allocate(num_pages, p.block_size, p.num_kv_heads, p.head_dim,
                                                 p.index_head_dim, dtype, dtype, device=device) for _ in range(layers)]
        for c in self.caches:
            for t in (c.k, c.v, c.index):
                t.normal_()
        self.attn = [mm3.SparseAttention(p, device=device, dtype=dtype, index_dtype=dtype, max_num_tokens=max_tokens, backend=backend,
                                         max_decode_query_len=max_dql) for _ in range(layers)]
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # eager only: layer 0's q and output

    def forward(self, tokens: torch.Tensor, batch: mm3.BatchMetadata) -> torch.Tensor:
        p, T = self.p, tokens.shape[0]
        pos, req = batch.token_positions, batch.token_to_request
        at = pos.clamp(min=0)
        page = batch.block_table[req, at // p.block_size].masked_fill(pos < 0, 0)  # padding -> scratch page 0
        slot = at % p.block_size
        h = self.embed[tokens]
        for i, (layer, c) in enumerate(zip(self.attn, self.caches)):
            def proj(wl: torch.nn.ParameterList, *shape: int) -> torch.Tensor:
                return (h @ wl[i]).to(self.dtype).view(T, *shape)

            c.k[page, slot] = proj(self.wk, p.num_kv_heads, p.head_dim)
            c.v[page, slot] = proj(self.wv, p.num_kv_heads, p.head_dim)
            c.index[page, slot] = proj(self.wi, p.index_head_dim)
            q = proj(self.wq, p.num_heads, p.head_dim)
            out = layer(q, proj(self.wiq, p.num_index_heads, p.index_head_dim), c, batch)
            if i == 0 and not torch.compiler.is_compiling():
                self.seen.append((q, out))
            h = h + out.float().flatten(1)
        return h


def _timed(run: "torch.nn.Module", tokens: torch.Tensor, batch: mm3.BatchMetadata,
           gpu: bool) -> tuple[float, torch.Tensor]:
    """Milliseconds of one call of ``run`` (device work included), and its output."""
    t0 = time.perf_counter()
    out = run(tokens, batch).clone()
    if gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def _usable(device: str) -> str:
    """Why this process cannot compute on ``device``, or "" when it can."""
    try:
        torch.empty(1, device=device).add_(1)
    except (RuntimeError, AssertionError) as e:  # a CPU-only build raises AssertionError for "cuda"
        return f"{type(e).__name__}: {e}"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu",
                    help="torch device; any other than cpu runs M3 TP8 shapes in bf16 with CUDA graphs (default cpu)")
    ap.add_argument("--backend", default=None, help="mm3 backend of every layer (default: cpu_ref on CPU, cuda on a GPU)")
    ap.add_argument("--layers", type=int, default=2, help="SparseAttention layers in the model (default 2)")
    ap.add_argument("--requests", type=int, default=5, help="requests that arrive, prefill and decode (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="seed of prompt lengths and accepted drafts (default 0)")
    args = ap.parse_args(argv)
    why = _usable(args.device)
    if why:
        ap.error(f"--device {args.device} cannot be used by this PyTorch build on this machine ({why}); "
                 f"run on the CPU (--device cpu, the default) or on a machine with that device")
    gpu = args.device != "cpu"
    p = mm3.SparseAttentionParams.minimax_m3(tp_size=8) if gpu else SMALL
    dtype = torch.bfloat16 if gpu else torch.float32
    backend = args.backend or ("cuda" if gpu else "cpu_ref")
    B, draft, max_batch = p.block_size, 1, 4
    chunk = 8 * B if gpu else 2 * B
    rng = random.Random(args.seed)
    scale = 20 if gpu else 3  # prompts of a few (CPU) or a few tens (GPU) of pages
    requests = [Request(prompt=rng.randint(B, scale * B), to_generate=rng.randint(3, 8)) for _ in range(args.requests)]
    pages = 1 + sum(-(-(r.prompt + r.to_generate + draft + 1) // B) for r in requests)
    width = max(-(-(r.prompt + r.to_generate + draft + 1) // B) for r in requests)
    alloc = PageAllocator(pages)
    sched = Scheduler(requests, alloc, block_size=B, chunk=chunk, max_batch=max_batch, draft=draft, seed=args.seed)
    model = Model(p, args.layers, pages, device=args.device, dtype=dtype, backend=backend,
                  max_tokens=max_batch * (1 + draft) + chunk, max_dql=1 + draft)
    # CPU: dynamo + AOT (Inductor's C++ build is slow on a small machine); GPU: Inductor, CUDA graphs for decodes
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if gpu else "aot_eager")
    graphed = torch.compile(model, fullgraph=True, mode="reduce-overhead") if gpu else compiled
    if gpu:
        for c in model.caches:  # persistent tensors: a CUDA graph reads them where they are
            for t in (c.k, c.v, c.index):
                torch._dynamo.mark_static_address(t)
        for layer in model.attn:
            torch._dynamo.mark_static_address(layer.topk_buffer.storage)
    i32 = dict(dtype=torch.int32, device=args.device)
    worst, step, failed = 0.0, 0, False
    print("per step: the compiled call's wall time (it includes compilation whenever the step has a shape "
          "not compiled before), then the same call repeated")
    with torch.no_grad():
        while not sched.idle:
            reqs, qlens, nd = sched.next_step()
            decode_only = nd == len(reqs)
            if decode_only:  # a fixed shape for the graph: pad to max_batch with padding decodes
                qlens = qlens + [1 + draft] * (max_batch - nd)
                nd = max_batch
            seqs = [r.seq_len + q for r, q in zip(reqs, qlens)] + [0] * (len(qlens) - len(reqs))
            table = [r.pages + [0] * (width - len(r.pages)) for r in reqs] + [[0] * width] * (len(qlens) - len(reqs))
            # what an engine holds on the device: host lists are copied up, nothing comes back
            starts = [0]
            for q in qlens:
                starts.append(starts[-1] + q)
            batch = mm3.BatchMetadata.from_device(
                torch.tensor(starts, **i32), torch.tensor(seqs, **i32), torch.tensor(table, **i32),
                num_decodes=nd, num_tokens=starts[-1], max_query_len=max(qlens), block_size=B,
                decode_query_len=1 + draft, num_decode_tokens=nd * (1 + draft))
            if step == 0:
                batch.validate()  # the host-side check, once per shape class (a device sync)
            tokens = torch.randint(0, 101, (starts[-1],), device=args.device)
            run = graphed if decode_only else compiled
            ms_first, got = _timed(run, tokens, batch, gpu)   # the step writes the same keys again: idempotent
            ms_again, _ = _timed(run, tokens, batch, gpu)
            model.seen.clear()
            want = model(tokens, batch)
            diff = (got - want).abs().max().item() if got.numel() else 0.0
            (q, out), = model.seen
            sel = model.attn[0].topk_buffer.rows(0, batch.num_tokens)
            err = (out.double().cpu() - oracle_attention(q, model.caches[0], sel, batch, p)).abs().max().item() \
                if out.numel() else 0.0
            worst = max(worst, err)
            ok = diff <= 1e-3 and err <= TOLERANCE[dtype]
            failed |= not ok
            kind = "decode (graph)" if decode_only and gpu else "decode" if decode_only else "mixed"
            print(f"step {step:3d} {kind:14s} requests={len(qlens)} tokens={starts[-1]:4d} "
                  f"|compiled-eager|={diff:.2e} |layer0-oracle|={err:.2e} call {ms_first:8.2f} ms, "
                  f"repeated {ms_again:7.2f} ms {'ok' if ok else 'FAIL'}")
            sched.finish_step(reqs, [q for q in qlens[:len(reqs)]], min(nd, len(reqs)))
            step += 1
    print(f"{'FAILED' if failed else 'passed'}: {step} steps, {args.requests} requests, {args.layers} layers, "
          f"backend {backend} on {args.device}; worst layer-0 error vs fp64 {worst:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
