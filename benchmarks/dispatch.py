"""Dispatch overhead: pluggy's ``pm.hook``, the plugin's own function, and mm3's checked boundary.

mm3 binds each backend's own hook functions once (:class:`~mm3.runtime.backend.Backend`)
instead of calling ``pm.hook`` per forward, and that bound call checks its
arguments once (:mod:`mm3.contract.checks`) before the plugin runs. This
measures, on a hookimpl that returns at once and a small MiniMax-M3 TP8 step
(median of ``repeat`` x ``number`` calls, the cost of an empty lambda
subtracted), microseconds per ``index_topk`` call::

    $ python -m mm3_benchmarks.dispatch
    {'pm.hook': ..., 'plugin': ..., 'backend': ...}

* ``pm.hook``: ``pm.hook.index_topk(...)``, pluggy's dispatch, no checks;
* ``plugin``: the hookimpl called directly, what a bound call adds nothing to;
* ``backend``: ``backend.index_topk(...)``, the checked boundary mm3 calls.

Measured in the development container before the boundary checked
(x86-64, CPython 3.11, pluggy 1.6; six runs): ``pm.hook`` 1.18 - 1.37 us,
the bound call 0.04 - 0.06 us (it was exactly the plugin's function).
"""

from __future__ import annotations

import statistics
import timeit
from typing import Any

import torch

from mm3.plugin import BackendCapabilities, SparseAttentionParams, TopkBuffer, hookimpl
from mm3.runtime.registry import Registry
from mm3.testing.factories import make_case

__all__ = ["measure_dispatch"]


class _Trivial:
    @hookimpl
    def backend_capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(name="trivial", ops={"index_topk"}, device_types={"cpu"},
                                   topk_layout="head_major")

    @hookimpl
    def index_topk(self, index_q: Any, caches: Any, batch: Any, params: Any, out: Any) -> None:
        return None


def measure_dispatch(number: int = 20_000, repeat: int = 7) -> dict[str, float]:
    """Per-call overhead (microseconds, median) of the three ways to call a hook."""
    plugin = _Trivial()
    reg = Registry([plugin], entry_points=False)
    be = reg.get("trivial")
    hook = reg.plugin_manager.hook.index_topk
    p = SparseAttentionParams.minimax_m3(tp_size=8)
    case = make_case(p, decodes=[300, 200], prefills=[(20, 100)], dtype="bfloat16")
    out = TopkBuffer.allocate(case.batch.num_tokens, p.num_kv_heads, p.topk)
    args = (case.index_q, case.caches, case.batch, p, out)
    kwargs = dict(zip(("index_q", "caches", "batch", "params", "out"), args))
    calls = {
        "pm.hook": lambda: hook(**kwargs),
        "plugin": lambda: plugin.index_topk(*args),
        "backend": lambda: be.index_topk(*args),
    }
    base = statistics.median(timeit.repeat(lambda: None, number=number, repeat=repeat))
    return {name: (statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) - base) / number * 1e6
            for name, fn in calls.items()}


if __name__ == "__main__":  # python -m mm3_benchmarks.dispatch
    torch.set_num_threads(1)
    print({k: round(v, 2) for k, v in measure_dispatch().items()})
