"""Dispatch overhead: a bound backend call against pluggy's ``pm.hook`` dispatch.

mm3 binds each backend's own hook functions once (:class:`mm3.runtime.backend.Backend`)
instead of calling ``pm.hook`` per forward. This measures both on a trivial
hookimpl that returns None (median of ``repeat`` x ``number`` calls, the cost
of an empty lambda subtracted)::

    $ python -m mm3_benchmarks.dispatch
    {'pm.hook': 1.26, 'bound': 0.039}     # microseconds per call (typical run)

Measured in the development container (x86-64, CPython 3.11, pluggy 1.6; six runs)::

    pm.hook.index_topk(index_q=..., ...)   1.18 - 1.37 us / call
    backend.index_topk(...)                0.04 - 0.06 us / call (one outlier 0.10)

A bound call costs about 1/20-1/30 of a ``pm.hook`` call (it is exactly one
call of the plugin's function; the remaining cost is Python's call overhead).
"""

from __future__ import annotations

from mm3 import BackendCapabilities, Registry, hookimpl

__all__ = ["measure_dispatch"]


def measure_dispatch(number: int = 200_000, repeat: int = 7) -> dict[str, float]:
    """Per-call overhead (microseconds, median) of a bound call vs ``pm.hook`` dispatch."""
    import statistics
    import timeit

    class _Trivial:
        @hookimpl
        def backend_capabilities(self) -> BackendCapabilities:
            return BackendCapabilities(name="trivial", ops={"index_topk"}, device_types={"cpu"},
                                       topk_layout="head_major")

        @hookimpl
        def index_topk(self, index_q, caches, batch, params, out):  # type: ignore[no-untyped-def]
            return None

    reg = Registry([_Trivial()], entry_points=False)
    be = reg.get("trivial")
    hook = reg.plugin_manager.hook.index_topk
    bound = timeit.repeat(lambda: be.index_topk(1, 2, 3, 4, 5), number=number, repeat=repeat)
    via_pm = timeit.repeat(lambda: hook(index_q=1, caches=2, batch=3, params=4, out=5),
                           number=number, repeat=repeat)
    empty = timeit.repeat(lambda: None, number=number, repeat=repeat)
    base = statistics.median(empty)
    return {
        "pm.hook": (statistics.median(via_pm) - base) / number * 1e6,
        "bound": (statistics.median(bound) - base) / number * 1e6,
    }


if __name__ == "__main__":  # python -m mm3_benchmarks.dispatch
    print({k: round(v, 3) for k, v in measure_dispatch().items()})
