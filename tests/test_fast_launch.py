"""The fast launch path's bookkeeping, on the CPU, with a stand-in for a JIT function and its binary.

What a GPU must show (the direct launch writes what Triton's launch writes, bit
for bit, also under CUDA-graph capture) is tests/gpu/test_fast_launch_gpu.py;
here: which launches go direct, with which arguments in which order, every
fallback (each said by a warning), and that the installed Triton is one the
adapter fits: its JIT calls a compiled kernel's launcher as the adapter does,
its launchers take that call, and its launch hooks are seen. A Triton release
that changes any of these fails here, before a GPU run would find the host
time back at Triton's own binding.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from mm3_backends.triton import fast_launch as fl  # noqa: E402


class _Param:
    def __init__(self, name: str, default: Any, constexpr: bool, num: int = 0, free: bool = False) -> None:
        self.name, self.default, self.is_constexpr = name, default, constexpr
        self.num, self.do_not_specialize = num, free


class _Launcher:
    """A compiled kernel's launcher, called as Triton's JIT calls it: records direct launches."""

    def __init__(self, calls: list, raise_on_run: bool) -> None:
        self._calls, self._raise = calls, raise_on_run

    def __call__(self, g0: int, g1: int, g2: int, stream: int, function: Any, meta: Any, launch_meta: Any,
                 enter: Any, exit_: Any, *args: Any) -> None:
        if self._raise:
            raise TypeError("another calling convention")
        self._calls.append(("direct", (g0, g1, g2), args))


class _Binary:
    """A compiled kernel: its launcher, and a source signature that says Triton >= 3.3."""

    def __init__(self, names: list[str], calls: list, raise_on_run: bool = False, launcher: Any = None) -> None:
        self.src = type("Src", (), {"signature": {n: "x" for n in names}})()
        self.function, self.packed_metadata = object(), object()
        self.run = launcher if launcher is not None else _Launcher(calls, raise_on_run)


class _Jit:
    """A JIT function ``k(x_ptr, n, s, BLOCK: constexpr, FLAG: constexpr = True)``."""

    arg_names = ["x_ptr", "n", "s", "BLOCK", "FLAG"]
    device_caches: dict = {}

    def __init__(self, raise_on_run: bool = False, old_triton: bool = False, free_n: bool = False,
                 launcher: Any = None) -> None:
        e = inspect.Parameter.empty
        # free_n: ``n`` declared ``do_not_specialize`` (tl_utils.step_kernel)
        self.params = [_Param("x_ptr", e, False, 0), _Param("n", e, False, 1, free_n), _Param("s", e, False, 2),
                       _Param("BLOCK", e, True, 3), _Param("FLAG", True, True, 4)]
        self.calls: list = []
        self._raise, self._old, self._launcher = raise_on_run, old_triton, launcher

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> _Binary:
            self.calls.append(("triton", tuple(grid), args, kwargs))
            names = self.arg_names[:3] if self._old else self.arg_names
            return _Binary(names, self.calls, self._raise, self._launcher)
        return launch


@pytest.fixture(autouse=True)
def _driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.driver import driver

    monkeypatch.setattr(fl, "_WARNED", set())   # each test sees its fallbacks said

    active = type("Active", (), {"get_current_device": staticmethod(lambda: 0),
                                 "get_current_stream": staticmethod(lambda d: 1234)})()
    monkeypatch.setattr(driver, "_active", active)   # what driver.active returns


def test_the_first_launch_of_a_class_is_tritons_then_direct_with_the_constexprs_appended() -> None:
    fast, k, x = fl.FastLauncher(), _Jit(), torch.zeros(8)
    for grid in ((3,), (5, 2)):
        fast(k, grid, (x, 7, 16), {"BLOCK": 32}, {"num_warps": 4})
    assert k.calls[0] == ("triton", (3,), (x, 7, 16), {"BLOCK": 32, "num_warps": 4})
    # the default of FLAG is filled in, in parameter order; the grid is the call's own
    assert k.calls[1] == ("direct", (5, 2, 1), (x, 7, 16, 32, True))
    assert fast.stats() == {"direct": 1, "triton": 1, "disabled": 0}


@pytest.mark.parametrize("change", ["int", "alignment", "dtype", "constexpr", "option"])
def test_anything_triton_specializes_on_makes_a_new_class(change: str) -> None:
    fast, k = fl.FastLauncher(), _Jit()
    x = torch.zeros(64)
    args, const, opts = (x, 7, 16), {"BLOCK": 32}, {"num_warps": 4}
    fast(k, (1,), args, const, opts)
    if change == "int":
        args = (x, 1, 16)                      # 1 is specialized by Triton
    elif change == "alignment":
        args = (x[1:], 7, 16)                  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args = (x.half(), 7, 16)
    elif change == "constexpr":
        const = {"BLOCK": 64}
    else:
        opts = {"num_warps": 8}
    fast(k, (1,), args, const, opts)
    assert [c[0] for c in k.calls] == ["triton", "triton"]


def test_an_unspecialized_parameter_keeps_the_class_across_values_but_not_across_widths() -> None:
    fast, k, x = fl.FastLauncher(), _Jit(free_n=True), torch.zeros(8)
    for n in (7, 1, 32, 2**31 - 1, -2**31):   # one binary: Triton compiles n as an i32 whatever its value
        fast(k, (1,), (x, n, 16), {"BLOCK": 32}, {"num_warps": 4})
    assert [c[0] for c in k.calls] == ["triton"] + ["direct"] * 4
    assert [c[2][1] for c in k.calls[1:]] == [1, 32, 2**31 - 1, -2**31]   # each launch passes its own value
    fast(k, (1,), (x, 2**31, 16), {"BLOCK": 32}, {"num_warps": 4})    # an i64 is another binary
    fast(k, (1,), (x, 7, 1), {"BLOCK": 32}, {"num_warps": 4})         # s is still specialized
    assert [c[0] for c in k.calls[5:]] == ["triton", "triton"]


def test_the_prefill_kernels_leave_their_per_step_counts_unspecialized() -> None:
    """The step's offsets and counts (which change every prefill step) are ``do_not_specialize``:
    without it every step is a new call class and the fast launch never goes direct."""
    from mm3_backends.triton import attention, indexer, prefill_attention, prefill_plan
    from mm3_backends.triton.tl_utils import unspecialized_params

    per_step = {prefill_plan._pair_count_kernel: {"tok0", "Tc", "first_request", "num_req", "nb_max"},
                prefill_plan._pair_place_kernel: {"tok0", "Tc", "first_request", "num_req", "nb_max"},
                prefill_plan._segment_scan_kernel: {"S"},
                prefill_attention._block_run_kernel: {"nb_max", "num_req"},
                prefill_attention._merge_slots_kernel: {"tok0", "Tc"},
                indexer._prefill_index_kernel: {"first_request", "s_ws_s", "first_token"},
                indexer._prefill_index_merge_kernel: {"s_ws_s", "num_rows", "first_token"},
                attention._prefill_attention_kernel: {"first_request"}}
    for kernel, names in per_step.items():
        assert unspecialized_params(kernel) == names, kernel


def test_a_launcher_that_raises_falls_back_to_triton_for_good_and_says_so() -> None:
    fast, k, x = fl.FastLauncher(), _Jit(raise_on_run=True), torch.zeros(8)
    with pytest.warns(fl.FastLaunchWarning, match="a direct launch raised TypeError: another calling convention"):
        for _ in range(3):
            fast(k, (1,), (x, 7, 16), {"BLOCK": 32}, {})
    assert [c[0] for c in k.calls] == ["triton"] * 3
    assert fast.stats() == {"direct": 0, "triton": 1, "disabled": 2}


def test_an_old_triton_whose_launcher_drops_constexprs_keeps_tritons_path_and_says_so() -> None:
    fast, k, x = fl.FastLauncher(), _Jit(old_triton=True), torch.zeros(8)
    with pytest.warns(fl.FastLaunchWarning, match="Triton < 3.3 launches the runtime ones only"):
        for _ in range(2):
            fast(k, (1,), (x, 7, 16), {"BLOCK": 32}, {})
    assert [c[0] for c in k.calls] == ["triton", "triton"]


class _OtherLauncher:
    """A launcher that takes the kernel's arguments as one tuple: not the call Triton's JIT makes."""

    def __call__(self, gx: int, gy: int, gz: int, stream: int, function: Any, meta: Any, launch_meta: Any,
                 enter: Any, exit_: Any, args: tuple) -> None:
        raise AssertionError("never called")


def test_a_launcher_that_takes_another_call_is_never_called_and_said() -> None:
    fast, k, x = fl.FastLauncher(), _Jit(launcher=_OtherLauncher()), torch.zeros(8)
    with pytest.warns(fl.FastLaunchWarning, match=r"_OtherLauncher\(.*\) does not take 9 launch arguments"):
        for _ in range(3):
            fast(k, (1,), (x, 7, 16), {"BLOCK": 32}, {})
    assert [c[0] for c in k.calls] == ["triton"] * 3 and fast.stats()["direct"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # said once per reason, not per launch
        fast(_Jit(launcher=_OtherLauncher()), (1,), (x, 7, 16), {"BLOCK": 32}, {})


def _jit_launch_call() -> ast.Call:
    """The call of a compiled kernel's launcher in the installed Triton's ``JITFunction.run``."""
    from triton.runtime.jit import JITFunction

    tree = ast.parse(textwrap.dedent(inspect.getsource(JITFunction.run)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "run" and isinstance(n.func.value, ast.Name) and n.func.value.id == "kernel"]
    assert len(calls) == 1, f"JITFunction.run calls kernel.run {len(calls)} times"
    return calls[0]


def test_the_installed_tritons_jit_calls_the_launcher_as_the_adapter_does() -> None:
    """The adapter calls ``run(grid x 3, stream, function, packed_metadata, launch metadata, enter hook,
    exit hook, *every parameter)``: the call Triton's own JIT makes. Another call here (a new argument,
    another order, the parameters passed otherwise) is a Triton the adapter does not fit."""
    call = _jit_launch_call()
    head = [ast.unparse(a) for a in call.args[:fl.LAUNCH_HEAD]]
    assert head[:7] == ["grid_0", "grid_1", "grid_2", "stream", "kernel.function", "kernel.packed_metadata",
                        "launch_metadata"], head
    assert head[7].endswith("launch_enter_hook") and head[8].endswith("launch_exit_hook"), head
    rest = call.args[fl.LAUNCH_HEAD:]
    assert len(rest) == 1 and isinstance(rest[0], ast.Starred) and "bound_args" in ast.unparse(rest[0]), \
        "the kernel's parameters are passed otherwise than as *bound_args.values() (every parameter)"
    assert not call.keywords


def test_the_installed_tritons_launchers_take_that_call() -> None:
    from triton.backends.amd.driver import HIPLauncher
    from triton.backends.nvidia.driver import CudaLauncher

    for launcher in (CudaLauncher, HIPLauncher):
        assert fl.launcher_problem(launcher) == "", fl.launcher_problem(launcher)


def test_a_launch_hook_of_the_installed_triton_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profiler's launch hook needs Triton's launch metadata: while one is installed every launch
    takes Triton's path. Where this Triton keeps its hooks is looked up; a move fails here."""
    holder = fl._hook_holder()
    assert not fl._hooks_installed()
    hook = getattr(holder, "launch_enter_hook")

    def profiler(metadata: Any) -> None:
        return None
    if hasattr(hook, "add"):     # a chain of hooks (Triton >= 3.8)
        hook.add(profiler)
        try:
            assert fl._hooks_installed()
        finally:
            hook.remove(profiler)
    else:
        monkeypatch.setattr(holder, "launch_enter_hook", profiler)
        assert fl._hooks_installed()
        monkeypatch.undo()
    assert not fl._hooks_installed()


class _Interpreted(_Jit):
    """As Triton's InterpretedFunction: no per-device caches of binaries."""

    device_caches = property(lambda self: (_ for _ in ()).throw(AttributeError("device_caches")))


def test_an_interpreted_kernel_and_an_installed_launch_hook_take_tritons_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fast, x = fl.FastLauncher(), torch.zeros(8)
    interp = _Interpreted()
    for _ in range(2):
        fast(interp, (1,), (x, 7, 16), {"BLOCK": 32}, {})
    hooked = _Jit()
    monkeypatch.setattr(fl, "_hooks_installed", lambda: True)
    for _ in range(2):
        fast(hooked, (1,), (x, 7, 16), {"BLOCK": 32}, {})
    assert [c[0] for c in interp.calls + hooked.calls] == ["triton"] * 4
    assert fast.stats()["direct"] == 0


def test_launch_without_fast_is_the_plain_triton_call() -> None:
    k, x = _Jit(), torch.zeros(8)
    fl.launch(k, (2,), (x, 7, 16), {"BLOCK": 32}, {"num_warps": 4}, fast=False)
    assert k.calls == [("triton", (2,), (x, 7, 16), {"BLOCK": 32, "num_warps": 4})]


def test_equal_constexprs_in_new_dicts_are_one_class_and_kept_dicts_are_known_by_identity() -> None:
    fast, k, x = fl.FastLauncher(), _Jit(), torch.zeros(8)
    for _ in range(3):   # a caller that builds its dicts per call still launches directly
        fast(k, (1,), (x, 7, 16), {"BLOCK": 32}, {"num_warps": 4})
    const, opts = {"BLOCK": 32}, {"num_warps": 4}
    fast(k, (1,), (x, 7, 16), const, opts)
    assert [c[0] for c in k.calls] == ["triton", "direct", "direct", "direct"]
    kernel = fast._kernel(k)
    assert kernel.static_token(const, opts) == kernel.static_token({"BLOCK": 32}, {"num_warps": 4})
    assert kernel.static_token({"BLOCK": 64}, opts) != kernel.static_token(const, opts)
