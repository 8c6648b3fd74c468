"""MiniMax-M3 block-sparse attention, tensor-parallel, under ``torchrun``.

Every rank builds the same realistic step (long decodes with a speculative
draft token, a padding decode slot, a chunked prefill and a fresh prompt) from
one seed, keeps its share of the heads (``mm3.TensorParallelSparseAttention``), runs its own
:class:`~mm3.SparseAttention` - each rank selects its backend through the
registry and settings, exactly as a single process would - and all-gathers the
outputs. Rank 0 then runs the whole layer on one rank and checks that the
gathered output matches. Timings of every rank are printed; the exit status is
0 on every rank when the check passed.

GPUs (NCCL, one rank per GPU)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 8 examples/torchrun_tp.py

``NCCL_NVLS_ENABLE=0`` is required on shared hosts (machines whose GPUs are
partitioned between jobs, as in most clusters and CI pools): NVLink SHARP
multicast needs fabric resources a shared host does not hand to one job, and
NCCL fails or hangs while setting it up. This script sets it to ``0`` unless
you set it yourself; on a dedicated NVSwitch host you may export
``NCCL_NVLS_ENABLE=1``.

CPU (gloo), e.g. on a laptop or in CI::

    torchrun --nproc-per-node 2 examples/torchrun_tp.py --small

Options: ``--small`` uses M3's structure scaled down (16/4/4 heads, D = 32,
16-token blocks, top-4) so the CPU run takes seconds; ``--backend NAME`` or
``MM3_BACKEND`` picks a backend (default: auto); ``--dist-backend`` forces
``nccl`` or ``gloo``. The world size must divide the query heads and divide or
be a multiple of the KV heads (M3: 1, 2, 4 or 8).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from mm3 import MM3Error, PagedKVCache, SparseAttention, SparseAttentionParams, TensorParallelSparseAttention
from mm3.contract import TORCH_DTYPES
from mm3.testing.factories import Case, make_case

# Gathered vs single-rank output, same backend and dtype (bf16 rounding of fp32 results).
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-5}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="scaled-down M3 shapes (fast on CPU)")
    ap.add_argument("--backend", default=None, help="mm3 backend (default: MM3_BACKEND, then auto)")
    ap.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                    help="torch.distributed backend (default: nccl when every rank has a GPU, else gloo)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def _step(full: SparseAttentionParams, small: bool, dtype: str, seed: int) -> Case:
    """One realistic decode-first step, built on the CPU from ``seed`` (identical on every rank)."""
    if small:
        return make_case(full, decodes=[300, 170, 95, 240], decode_query_len=2, padding_decodes=1,
                         prefills=[(48, 256), (37, 37)], dtype=dtype, seed=seed)
    return make_case(full, decodes=[7000, 5200, 3100, 6400], decode_query_len=2, padding_decodes=1,
                     prefills=[(512, 3072), (200, 200)], dtype=dtype, seed=seed)


def _on(caches: PagedKVCache, device: torch.device) -> PagedKVCache:
    return PagedKVCache(caches.k.to(device), caches.v.to(device), caches.index.to(device))


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int, *, all_ranks: bool = True) -> float:
    """Median wall time of ``fn`` with the device drained; ``all_ranks``: every rank starts together
    (a barrier before each run; off for work that only one rank does)."""
    fn()  # warm-up: kernel compilation, allocator
    times = []
    for _ in range(repeats):
        if all_ranks:
            dist.barrier()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    args = _args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist_backend = args.dist_backend or (
        "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo")
    if dist_backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # see the module docstring: shared hosts need it
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # ranks share the cores
    dist.init_process_group(dist_backend)  # env:// rendezvous from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = TORCH_DTYPES[args.dtype]

    if args.small:
        full = SparseAttentionParams(num_heads=16, num_kv_heads=4, head_dim=32, num_index_heads=4,
                                     index_head_dim=32, block_size=16, topk=4)
    else:
        full = SparseAttentionParams.minimax_m3(tp_size=1)
    case = _step(full, args.small, args.dtype, args.seed)
    T = case.batch.num_tokens
    try:
        tp = TensorParallelSparseAttention(full, device=device, dtype=dtype, max_num_tokens=T,
                                           max_decode_query_len=case.batch.decode_query_len,
                                           backend=args.backend)
    except MM3Error as e:
        print(f"[rank {rank}] {type(e).__name__}: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2

    # An engine's sharded projections and per-rank caches would produce these directly.
    q, index_q, caches = tp.shard_inputs(case.q, case.index_q, case.caches, contiguous_caches=True)
    q, index_q, caches, batch = q.to(device), index_q.to(device), _on(caches, device), case.batch.to(device)
    s = tp.shard
    sel = tp.selection
    line = (f"[rank {rank}/{world}] {device}: query heads [{s.q_heads.start}, {s.q_heads.stop}), "
            f"KV/index heads [{s.kv_heads.start}, {s.kv_heads.stop})"
            f"{f' (replicated x{s.kv_replicas})' if s.kv_replicated else ''}; "
            f"indexer {sel.indexer.name}, attention {sel.attention.name}")

    local = tp(q, index_q, caches, batch)
    t_fwd = _median_ms(lambda: tp(q, index_q, caches, batch), device, args.repeats)
    t_gather = _median_ms(lambda: tp.gather(local), device, args.repeats)
    gathered = tp.gather(local)
    lines: list[object] = [None] * world
    dist.all_gather_object(lines, f"{line}\n    forward {t_fwd:8.2f} ms | all_gather {t_gather:6.2f} ms")

    ok = torch.ones(1, device=device)
    if rank == 0:
        print(f"mm3 tensor parallel: {world} ranks over {dist_backend}, {T} tokens "
              f"({batch.num_decode_tokens} decode), heads {full.num_heads}/{full.num_kv_heads}/"
              f"{full.num_index_heads} D={full.head_dim}, block {full.block_size}, top-{full.topk}, "
              f"{args.dtype}, median of {args.repeats}")
        for x in lines:
            print(x)
        single = SparseAttention(full, device=device, dtype=dtype, max_num_tokens=T,
                                 max_decode_query_len=case.batch.decode_query_len, backend=args.backend)
        ref_case = case.to(device)
        ref = single(ref_case.q, ref_case.index_q, ref_case.caches, ref_case.batch)
        t_single = _median_ms(lambda: single(ref_case.q, ref_case.index_q, ref_case.caches, ref_case.batch),
                              device, args.repeats, all_ranks=False)
        err = (gathered.double() - ref.double()).abs()
        passed = float(err.max()) <= TOLERANCE[args.dtype]
        print(f"single rank ({single.selection.attention.name}): {t_single:8.2f} ms")
        print(f"gathered vs single rank: max |err| {float(err.max()):.2e}, mean {float(err.mean()):.2e} "
              f"(<= {TOLERANCE[args.dtype]:.0e}): {'PASS' if passed else 'FAIL'}", flush=True)
        ok.fill_(1.0 if passed else 0.0)
    dist.broadcast(ok, src=0)  # every rank exits with the verdict, so torchrun reports it
    dist.destroy_process_group()
    return 0 if bool(ok.item()) else 1


if __name__ == "__main__":
    sys.exit(main())
