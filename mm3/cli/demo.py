"""``mm3 demo``: the main job, end to end, on whatever backend is selected.

It builds two realistic paged steps at MiniMax-M3 TP8 shapes (8 query heads,
1 KV head, 1 index head, D = 128, 128-token blocks, top-16):

* a mixed step: long decodes, a padding decode slot, and a chunked prefill
  (a later chunk of a long prompt);
* a speculative step: decodes with 3 draft tokens each, plus the prompt's next chunk;

runs each through :class:`~mm3.runtime.layer.SparseAttention`, prints the selection
trace and timings, then checks the same backends against the fp64 oracle on a
reduced copy of each step (same structure, shorter contexts, smaller blocks).
Exit status 0 means every check passed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mm3.contract.buffers import TORCH_DTYPES
from mm3.cli.main import check_configured_backends
from mm3.runtime.layer import SparseAttention
from mm3.contract.params import SparseAttentionParams
from mm3.testing.factories import Case, make_case
from mm3.testing.oracle import check_topk, oracle_attention

__all__ = ["add_arguments", "run", "describe", "StepSpec"]

# Absolute error limits against the fp64 oracle (docs/spec.md §4): (mean, max).
TOLERANCES = {"bfloat16": (3e-4, 2e-2), "float16": (1.5e-4, 1e-2), "float32": (1e-5, 1e-5)}


@dataclass(frozen=True)
class StepSpec:
    """One demo step: decode contexts, decode query length, prefills (query_len, seq_len)."""

    title: str
    decodes: tuple[int, ...]
    decode_query_len: int
    prefills: tuple[tuple[int, int], ...]
    padding_decodes: int = 0

    def scaled(self, factor: int) -> "StepSpec":
        """The same structure with contexts and prefills ``factor`` times shorter."""
        def s(n: int) -> int:
            return max(n // factor, 1)
        return StepSpec(self.title, tuple(s(d) for d in self.decodes), self.decode_query_len,
                        tuple((s(q), max(s(sl), s(q))) for q, sl in self.prefills), self.padding_decodes)


STEPS = (
    StepSpec("mixed: 4 long decodes + 1 padding slot + chunked prefill (1024 new on 2048 context)",
             decodes=(7000, 5200, 3100, 6400), decode_query_len=1, prefills=((1024, 3072),),
             padding_decodes=1),
    StepSpec("speculative: 3 decodes x (1 + 3 draft tokens) + the prompt's next chunk (512 new)",
             decodes=(6001, 4100, 2600), decode_query_len=4, prefills=((512, 3584),)),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None, help="attention backend (default: settings, then auto)")
    parser.add_argument("--indexer-backend", default=None, help="indexer backend (default: same/auto)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument("--tp", type=int, default=8, choices=(1, 2, 4, 8), help="M3 tensor-parallel size")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype of q, index_q and the KV cache")
    parser.add_argument("--index-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"),
                        help="dtype of the index cache")
    parser.add_argument("--repeats", type=_positive, default=3,
                        help="timed runs of each measurement after one warm-up (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--no-check", action="store_true", help="skip the oracle check")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


#: a warm-up call slower than this prints how long the timed repeats will take
SLOW_CALL_S = 2.0


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _median_ms(what: str, fn: Callable[[], object], device: torch.device, repeats: int,
               backend: str) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up; warns when a call is slow."""
    t0 = time.perf_counter()
    fn()  # warm-up: compilation, allocator, caches
    _sync(device)
    warm = time.perf_counter() - t0
    if warm > SLOW_CALL_S:
        shorten = " (--repeats 1 to shorten)" if repeats > 1 else ""
        print(f"  note: one {what} call on backend {backend!r} took {warm:.1f} s; the {repeats} timed "
              f"repeat(s) take about {warm * repeats:.0f} s more{shorten}", flush=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _build(params: SparseAttentionParams, spec: StepSpec, args: argparse.Namespace,
           device: torch.device, seed: int) -> Case:
    return make_case(params, decodes=spec.decodes, prefills=spec.prefills,
                     decode_query_len=spec.decode_query_len, padding_decodes=spec.padding_decodes,
                     dtype=args.dtype, index_dtype=args.index_dtype, device=device, seed=seed)


def _tokens(spec: StepSpec) -> int:
    """Tokens of ``spec``'s step (padding slots included), known before any input is built."""
    decode_slots = (len(spec.decodes) + spec.padding_decodes) * spec.decode_query_len
    return decode_slots + sum(q for q, _ in spec.prefills)


def _layer(params: SparseAttentionParams, args: argparse.Namespace, device: torch.device,
           max_tokens: int) -> SparseAttention:
    return SparseAttention(params, device=device, dtype=TORCH_DTYPES[args.dtype],
                           index_dtype=TORCH_DTYPES[args.index_dtype], max_num_tokens=max_tokens,
                           max_decode_query_len=max(s.decode_query_len for s in STEPS),
                           backend=args.backend, indexer_backend=args.indexer_backend)


def _time_step(layer: SparseAttention, case: Case, device: torch.device, repeats: int) -> dict[str, float]:
    sel = layer.selection
    p = case.params
    topk = layer.topk_buffer.rows(0, case.batch.num_tokens)
    out = torch.empty_like(case.q)
    print(f"  timing the indexer, the attention and the whole step: 1 warm-up + {repeats} run(s) each ...",
          flush=True)
    t_idx = _median_ms("indexer", lambda: sel.indexer.index_topk(case.index_q, case.caches, case.batch, p,
                                                                 topk), device, repeats, sel.indexer.name)
    att_topk = layer.topk_for_attention(topk)
    t_att = _median_ms("attention", lambda: sel.attention.attention_forward(
        case.q, case.caches, att_topk, case.batch, p, out), device, repeats, sel.attention.name)
    t_all = _median_ms("step", lambda: layer(case.q, case.index_q, case.caches, case.batch), device, repeats,
                       sel.attention.name)
    return {"indexer_ms": t_idx, "attention_ms": t_att, "step_ms": t_all}


def _check(params: SparseAttentionParams, spec: StepSpec, args: argparse.Namespace,
           device: torch.device) -> tuple[bool, str]:
    """Oracle check on a reduced copy of ``spec``: 32-token blocks, top-8, contexts / 8."""
    small = params.model_copy(update={"block_size": 32, "topk": 8})
    reduced = spec.scaled(8)
    case = _build(small, reduced, args, device, args.seed + 1000)
    layer = _layer(small, args, device, case.batch.num_tokens)
    out = layer(case.q, case.index_q, case.caches, case.batch)
    sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
    bad_rows = check_topk(sel, case.index_q, case.caches, case.batch, small)
    ref = oracle_attention(case.q, case.caches, sel, case.batch, small)
    err = (out.detach().to("cpu", torch.float64) - ref).abs()
    mean_tol, max_tol = TOLERANCES[args.dtype]
    ok = not bad_rows and float(err.mean()) <= mean_tol and float(err.max()) <= max_tol
    detail = (f"{case.batch.num_tokens} tokens, {small.num_index_heads * case.batch.num_tokens} top-k rows: "
              f"{len(bad_rows)} wrong; attention |err| mean {float(err.mean()):.2e} (<= {mean_tol:.0e}), "
              f"max {float(err.max()):.2e} (<= {max_tol:.0e})")
    if bad_rows:
        detail += f"; first bad row: {bad_rows[0]}"
    return ok, detail


def describe(params: SparseAttentionParams) -> str:
    """The layer's shapes in words, for the demo's first line.

    Example:
        >>> describe(SparseAttentionParams.minimax_m3(8))
        '8 query / 1 KV / 1 index heads, D=128, blocks of 128, top-16'
    """
    return (f"{params.num_heads} query / {params.num_kv_heads} KV / {params.num_index_heads} index heads, "
            f"D={params.head_dim}, blocks of {params.block_size}, top-{params.topk}")


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit status."""
    device = torch.device(args.device) if args.device else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    params = SparseAttentionParams.minimax_m3(args.tp)
    print(f"mm3 demo: MiniMax-M3 TP{args.tp} block-sparse attention ({describe(params)}) on {device}, "
          f"{args.dtype}, index cache {args.index_dtype}")
    # Select first: a misconfigured backend fails here, before any input is built.
    if args.backend is None and args.indexer_backend is None:
        check_configured_backends()      # names the MM3_* variable or file a bad name came from
    layer = _layer(params, args, device, max(_tokens(spec) for spec in STEPS))
    print("\nbackend selection:")
    print("  " + layer.explain().replace("\n", "\n  "))
    all_ok = True
    for i, spec in enumerate(STEPS):
        print(f"\n[step {i + 1}/{len(STEPS)}] {spec.title}")
        t0 = time.perf_counter()
        case = _build(params, spec, args, device, args.seed + i)
        b = case.batch
        print(f"  built {b.num_requests} requests, {b.num_tokens} tokens ({b.num_decode_tokens} decode), "
              f"longest context {b.max_seq_len} in {time.perf_counter() - t0:.1f} s", flush=True)
        t = _time_step(layer, case, device, args.repeats)
        print(f"  indexer {t['indexer_ms']:8.2f} ms | attention {t['attention_ms']:8.2f} ms | "
              f"step {t['step_ms']:8.2f} ms  ({b.num_tokens / t['step_ms'] * 1e3:,.0f} tokens/s, "
              f"median of {args.repeats})")
        if not args.no_check:
            print("  checking against the fp64 oracle on a reduced copy ...", flush=True)
            t0 = time.perf_counter()
            ok, detail = _check(params, spec, args, device)
            all_ok &= ok
            print(f"  oracle check (reduced copy, {time.perf_counter() - t0:.1f} s): "
                  f"{'PASS' if ok else 'FAIL'} - {detail}")
    print("\nall checks passed" if all_ok else "\nSOME CHECKS FAILED", file=sys.stdout if all_ok else sys.stderr)
    return 0 if all_ok else 1
