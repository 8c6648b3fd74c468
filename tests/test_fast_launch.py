"""The fast launch path's bookkeeping, on the CPU, with a stand-in for a JIT function and its binary.

What a GPU must show (the direct launch writes what Triton's launch writes, bit
for bit, also under CUDA-graph capture) is tests/gpu/test_fast_launch_gpu.py;
here: which launches go direct, with which arguments in which order, every
fallback (each said by a warning), and the launch recorder. That the installed
Triton is one the adapter fits (its JIT calls a compiled kernel's launcher as
the adapter does, its launchers take that call, its launch hooks are seen) is
tests/test_triton_compat.py.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from mm3_backends.triton import compat  # noqa: E402
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
    monkeypatch.setattr(fl, "_WARNED", set())   # each test sees its fallbacks said

    active = type("Active", (), {"get_current_device": staticmethod(lambda: 0),
                                 "get_current_stream": staticmethod(lambda d: 1234)})()
    monkeypatch.setattr(compat, "active_driver", lambda: active)


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


def test_the_kernels_leave_their_per_step_counts_unspecialized() -> None:
    """The step's offsets and counts (which change every prefill step, and with the decodes of a step) are
    ``do_not_specialize``: without it every step is a new call class and the fast launch never goes direct.
    The block table's width is among them (the bound of every block a kernel reads): one binary serves
    every width."""
    from mm3_backends.triton import attention, index_scores, indexer, prefill_attention, prefill_plan
    from mm3_backends.triton.compat import unspecialized_params

    judge = {"j_R", "j_T", "j_nd", "j_dql", "j_ndt", "j_mpq", "j_M"}
    per_step = {prefill_plan._pair_count_kernel: {"tok0", "Tc", "first_request", "num_req", "nb_max"},
                prefill_plan._pair_place_kernel: {"tok0", "Tc", "first_request", "num_req", "nb_max"},
                prefill_plan._segment_scan_kernel: {"S"},
                prefill_attention._block_run_kernel: {"nb_max", "num_req"},
                prefill_attention._merge_slots_kernel: {"tok0", "Tc"},
                indexer._prefill_index_kernel: {"first_request", "T", "W", "s_ws_s", "first_token"},
                indexer._prefill_index_merge_kernel: {"s_ws_s", "num_rows", "first_token"},
                attention._prefill_attention_kernel: {"first_request", "tok_lo", "tok_hi", "W"},
                index_scores._index_scores_kernel: {"first_request", "N", "tok_lo", "tok_hi", "W"},
                indexer._decode_score_kernel: {"T", "W"} | judge,
                indexer._decode_topk_kernel: {"T", "W"},
                attention._decode_attention_kernel: {"W", "num_decodes"},
                attention._decode_attention_flat_kernel: {"W", "num_decodes"}}
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


def test_a_triton_without_an_internal_the_direct_launch_reads_launches_through_triton_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that moved one of them (compat.INTERNALS): every kernel takes Triton's launch, said once."""
    monkeypatch.setitem(compat.INTERNALS, compat.DIRECT_LAUNCH,
                        (*compat.INTERNALS[compat.DIRECT_LAUNCH], "triton.runtime.jit:JITFunction.moved_away"))
    monkeypatch.setattr(fl, "_UNUSABLE", None)
    fast, x = fl.FastLauncher(), torch.zeros(8)
    with pytest.warns(fl.FastLaunchWarning, match=r"this Triton lacks triton\.runtime\.jit:JITFunction\.moved_away"):
        for k in (_Jit(), _Jit()):
            for _ in range(2):
                fast(k, (1,), (x, 7, 16), {"BLOCK": 32}, {})
    assert fast.stats() == {"direct": 0, "triton": 0, "disabled": 4}


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


def test_recording_sees_every_launch_and_makes_none() -> None:
    k, x = _Jit(), torch.zeros(8)
    with fl.recording() as launches:
        fl.launch(k, (2,), (x, 7, 16), {"BLOCK": 32}, {"num_warps": 4}, fast=True)
        fl.launch(k, (3, 1), (x, 8, 16), {"BLOCK": 64}, {}, fast=False)
        with pytest.raises(RuntimeError, match="already being recorded"):
            with fl.recording():
                pass
    assert k.calls == []
    assert [(r.kernel, r.grid, r.args, r.constexprs, r.options) for r in launches] == [
        (k, (2,), (x, 7, 16), {"BLOCK": 32}, {"num_warps": 4}), (k, (3, 1), (x, 8, 16), {"BLOCK": 64}, {})]
    fl.launch(k, (1,), (x, 7, 16), {"BLOCK": 32}, {}, fast=False)     # after the block: launched again
    assert len(k.calls) == 1
