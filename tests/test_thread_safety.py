"""Safety under load: concurrent first use of the registry and of SparseAttention.

Every test releases its threads through one barrier, so they really do race
for the first load; slow fake entry points widen the window. Each test runs
several rounds on fresh objects.
"""

from __future__ import annotations

import threading
import time
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest
import torch

import mm3.runtime.discovery as discovery
import mm3.runtime.registry as registry_module
import mm3_backends.cpu_ref.plugin as cpu_ref
from mm3 import SparseAttentionParams
from mm3.runtime.config import Settings
from mm3.runtime.layer import SparseAttention
from mm3.runtime.discovery import PluginLoadWarning
from mm3.runtime.registry import Registry, default_registry, reset_default_registry
from mm3.runtime.scope import use_backend
from mm3.testing.factories import make_case
from mm3.testing.mock import MockBackend

THREADS = 32
ROUNDS = 5


def _race(fn: Callable[[int], Any], threads: int = THREADS) -> list[Any]:
    """Run ``fn(i)`` in ``threads`` threads released together; return results in thread order."""
    barrier = threading.Barrier(threads)

    def run(i: int) -> Any:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(run, range(threads)))


class _SlowEntryPoint:
    """A fake ``mm3.backends`` entry point whose import takes a while (widens the race)."""

    def __init__(self, name: str, target: Any, delay: float = 0.01) -> None:
        self.name, self.value = name, f"fake.{name}:plugin"
        self.dist = types.SimpleNamespace(name=f"fake-{name}", version="1.0")
        self._target, self._delay = target, delay
        self.loads = 0

    def load(self) -> Any:
        self.loads += 1
        time.sleep(self._delay)
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


@pytest.fixture
def fake_entry_points(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Entry points: cpu_ref, a mock and a broken plugin; counts how often they are listed."""
    state: dict[str, Any] = {"listed": 0, "eps": []}

    def listing(group: str = discovery.ENTRY_POINT_GROUP) -> tuple[Any, ...]:
        state["listed"] += 1
        time.sleep(0.005)
        return tuple(state["eps"])

    def fresh() -> None:
        state["eps"] = [_SlowEntryPoint("cpu_ref", cpu_ref),
                        _SlowEntryPoint("mock", MockBackend("mock", priority=5)),
                        _SlowEntryPoint("broken", ImportError("no module named vendor_kernels"))]
        state["listed"] = 0

    state["fresh"] = fresh
    monkeypatch.setattr(discovery, "list_entry_points", listing)
    return state


def test_fresh_registry_hammered_by_32_threads_loads_once_and_agrees(fake_entry_points: dict[str, Any]) -> None:
    ops: list[Callable[[Registry], Any]] = [
        lambda r: r.get("cpu_ref"), lambda r: r.get("mock"), lambda r: tuple(r.backends()),
        lambda r: tuple(r.names()), lambda r: tuple(r.problems()), lambda r: "mock" in r, lambda r: len(r),
    ]
    for _ in range(ROUNDS):
        fake_entry_points["fresh"]()
        reg = Registry(settings=Settings(check_contracts=False))
        loads: list[int] = []
        inner_load = reg._load

        def counted_load() -> None:
            loads.append(threading.get_ident())
            inner_load()

        reg._load = counted_load  # type: ignore[method-assign]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = _race(lambda i: (i % len(ops), ops[i % len(ops)](reg)))
        assert len(loads) == 1, f"registry loaded {len(loads)} times"
        assert fake_entry_points["listed"] == 1
        assert all(ep.loads == 1 for ep in fake_entry_points["eps"])
        by_op: dict[int, set[Any]] = {}
        for op, value in results:
            by_op.setdefault(op, set()).add(value if not isinstance(value, tuple) else
                                            tuple(id(v) if not isinstance(v, str) else v for v in value))
        assert all(len(v) == 1 for v in by_op.values()), by_op       # every thread saw the same answer
        assert reg.get("cpu_ref") is next(v for op, v in results if op == 0)
        assert reg.names() == ["mock", "cpu_ref"]
        broken = [w for w in caught if issubclass(w.category, PluginLoadWarning)]
        assert len(broken) == 1 and "vendor_kernels" in str(broken[0].message)
        assert [p.name for p in reg.problems()] == ["broken"]


def test_default_registry_is_created_once_under_contention(fake_entry_points: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(ROUNDS):
        fake_entry_points["fresh"]()
        monkeypatch.setattr(registry_module, "_default", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PluginLoadWarning)
            regs = _race(lambda i: default_registry())
            names = _race(lambda i: tuple(default_registry().names()))
        assert len({id(r) for r in regs}) == 1
        assert set(names) == {("mock", "cpu_ref")}
        assert fake_entry_points["listed"] == 1
    reset_default_registry()


def _case() -> Any:
    p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
                              index_head_dim=16, block_size=16, topk=4)
    return make_case(p, decodes=[70, 40, 90], prefills=[(9, 30), (5, 5)], padding_decodes=1, dtype="float32",
                     index_dtype="bfloat16", seed=1)


@pytest.mark.parametrize("mode", ["never", "first", "always"])
def test_sparse_attention_built_and_run_from_32_threads(mode: str) -> None:
    case = _case()
    settings = Settings(check_contracts=mode)
    guard = mode != "never"

    def build(reg: Registry) -> SparseAttention:
        return SparseAttention(case.params, dtype=torch.float32, index_dtype=torch.bfloat16, max_num_tokens=32,
                               registry=reg, settings=settings)

    expected = build(Registry([cpu_ref], entry_points=False))(case.q, case.index_q, case.caches, case.batch)
    for _ in range(ROUNDS):
        reg = Registry([cpu_ref, MockBackend("mock", priority=5)], entry_points=False)

        def worker(i: int) -> tuple[str, str, bool, torch.Tensor]:
            layer = build(reg)                        # selection, binding and buffer allocation race here
            out = layer(case.q, case.index_q, case.caches, case.batch)
            b = layer._resolve()
            return b.target.indexer.name, b.target.attention.name, b.target.mode != "never", out

        results = _race(worker)
        assert {(r[0], r[1]) for r in results} == {("mock", "mock")}   # auto picked the same one everywhere
        assert {r[2] for r in results} == {guard}
        for r in results:
            assert torch.equal(r[3], expected)     # mock delegates to cpu_ref: bitwise the same


def test_threads_driving_their_own_layers_over_shared_backends_do_not_cross_talk() -> None:
    """Each thread runs its own layer (default checks) on its own steps of every kind, all at once,
    through one registry's backends; every output equals the same step run alone, bit for bit."""
    from mm3.testing.factories import make_case

    p = _case().params
    kinds = [dict(decodes=[70, 40]), dict(decodes=[50, 90], decode_query_len=2), dict(prefills=[(9, 30)]),
             dict(decodes=[33], prefills=[(5, 5), (7, 60)])]
    steps = [[make_case(p, dtype="float32", index_dtype="bfloat16", seed=10 * i + j, **kinds[(i + j) % 4])
              for j in range(3)] for i in range(8)]
    reg = Registry([cpu_ref], entry_points=False)

    def run(cases: list[Any]) -> list[torch.Tensor]:
        layer = SparseAttention(p, dtype=torch.float32, index_dtype=torch.bfloat16, max_num_tokens=32,
                                max_decode_query_len=2, registry=reg, settings=Settings(check_contracts="first"))
        return [layer(c.q, c.index_q, c.caches, c.batch).clone() for c in cases]

    alone = [run(cases) for cases in steps]
    together = _race(lambda i: run(steps[i]), threads=len(steps))
    for a, b in zip(alone, together):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_layer_under_different_scopes_in_threads() -> None:
    """``use_backend`` is per thread; a shared layer binds each choice once and serves the right one."""
    case = _case()
    for _ in range(ROUNDS):
        a, b = MockBackend("mock_a"), MockBackend("mock_b", topk_layout="token_major")
        reg = Registry([a, b], entry_points=False)
        layer = SparseAttention(case.params, dtype=torch.float32, index_dtype=torch.bfloat16, max_num_tokens=32,
                                registry=reg, settings=Settings(check_contracts=False, backend="mock_a"))

        def worker(i: int) -> tuple[str, str, str]:
            want = "mock_a" if i % 2 else "mock_b"
            with use_backend(want, registry=reg):
                time.sleep(0.001)                      # let the other threads enter their scopes
                sel = layer.selection
                return want, sel.attention.name, layer.topk_buffer.layout

        for want, got, layout in _race(worker):
            assert got == want
            assert layout == ("head_major" if want == "mock_a" else "token_major")
        # each (backend, indexer) key was bound, and its buffer allocated, exactly once
        assert len(a.calls_to("alloc_topk_buffer")) == 1
        assert len(b.calls_to("alloc_topk_buffer")) == 1
        assert layer.selection.attention.name == "mock_a"            # outside any scope: the setting
