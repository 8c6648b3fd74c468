"""What the safe defaults cost: the first guarded step vs the steady state, side by side.

With ``check_contracts = "first"`` (the default) a layer runs the contract
guard on the first call of each op and kind of batch, then steps aside; a
step's contents are checked every step (on the host for a host table, by the
indexer's kernels or a few device ops otherwise, no sync). This prints, in
one run, for one step shape:

* ``first step``: the first step of a layer in ``"first"`` mode (guarded) and
  in ``"never"`` mode, after a warm-up layer compiled every kernel;
* ``steady``: best-of-N step time of both layers afterwards;
* ``contents check``: one device-side :class:`FaultFlag` record (the per-step
  cost for a backend whose kernels do not report bad page ids), best of N.

Run (CPU, cpu_ref, the development container's shape)::

    python -m mm3_benchmarks.first_step_cost

and on an H200 (the cuda backend, M3 TP8, 64 decodes of 64K)::

    python -m mm3_benchmarks.first_step_cost --device cuda --backend cuda --decodes 64 --context 65536 --prefills 0
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from mm3 import SparseAttention, SparseAttentionParams
from mm3.runtime.config import Settings
from mm3.contract.contents import FaultFlag
from mm3.testing.factories import make_case

__all__ = ["measure"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def measure(*, device: str = "cpu", backend: str = "cpu_ref", tp: int = 8, decodes: int = 16,
            context: int = 4096, prefills: int = 2, repeat: int = 9) -> dict[str, Any]:
    """Milliseconds: first guarded step, steady state per mode, one device page-id record."""
    dev = torch.device(device)
    p = SparseAttentionParams.minimax_m3(tp_size=tp)
    case = make_case(p, decodes=[context + 256 * (i % 16) for i in range(decodes)],
                     prefills=[(256, 2048), (256, 256)][:prefills], device=dev, seed=0)
    T = case.batch.num_tokens

    def layer(mode: str) -> SparseAttention:
        return SparseAttention(p, device=dev, max_num_tokens=max(T, 16), backend=backend,
                               settings=Settings(check_contracts=mode, backend=backend))

    def run(lay: SparseAttention) -> Callable[[], Any]:
        return lambda: lay(case.q, case.index_q, case.caches, case.batch)

    for _ in range(2):
        run(layer("never"))()                                  # compile and warm every kernel
    first, never = layer("first"), layer("never")
    row: dict[str, Any] = {"device": str(dev), "backend": backend, "tokens": T,
                           "first_step_first": _timed(run(first), dev),
                           "first_step_never": _timed(run(never), dev)}
    steady: dict[str, list[float]] = {"first": [], "never": []}
    for _ in range(repeat):                                    # interleaved: noise hits all alike
        for label, lay in (("first", first), ("never", never)):
            steady[label].append(_timed(run(lay), dev))
    row.update({f"steady_{k}": min(v) for k, v in steady.items()})
    flag = FaultFlag(dev)
    row["contents_record"] = min(_timed(lambda: flag.record(case.batch, case.caches.num_pages, graph=True), dev)
                                 for _ in range(repeat))
    flag.check()
    return row


def main() -> None:  # python -m mm3_benchmarks.first_step_cost
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefills", type=int, default=2, choices=(0, 1, 2))
    ap.add_argument("--repeat", type=int, default=9)
    a = ap.parse_args()
    r = measure(device=a.device, backend=a.backend, tp=a.tp, decodes=a.decodes, context=a.context,
                prefills=a.prefills, repeat=a.repeat)
    print(f"{r['backend']} on {r['device']}, M3 TP{a.tp}, {r['tokens']} tokens "
          f"({a.decodes} decodes of ~{a.context}, {a.prefills} prefills); ms, steady = best of {a.repeat}")
    print(f"{'':<34}{'first':>10}{'never':>10}")
    print(f"{'first step (after warm-up)':<34}{r['first_step_first']:>10.3f}{r['first_step_never']:>10.3f}")
    print(f"{'steady state':<34}{r['steady_first']:>10.3f}{r['steady_never']:>10.3f}")
    print(f"{'contents check on the device':<34}{r['contents_record']:>10.3f}  (a step whose indexer does not "
          f"report bad page ids itself)")


if __name__ == "__main__":
    main()
