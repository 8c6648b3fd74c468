"""backends/triton/interpreter_speed.py computes what Triton's interpreter computes, bit for bit.

Each kernel here runs twice, through the shortcuts (installed by the kernel
modules' import) and through the interpreter's own code (``bypassed()``), on
inputs with NaN, signed zeros and infinities, and the outputs must be equal
bit for bit. The shortcuts must also still be taken on this Triton (else
``mm3 check`` and the suite silently slow down) and leave ``triton.language``
as the interpreter leaves it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the shortcuts patch Triton's CPU interpreter only")

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from mm3_backends.triton.block_max import _max_keep_nan
    from mm3_backends.triton.interpreter_speed import _originals, bypassed, is_elementwise, missing

    @triton.jit
    def _argmax_combine(v1, i1, v2, i2):
        take = (v2 > v1) | ((v2 == v1) & (i2 < i1))
        return tl.where(take, v2, v1), tl.where(take, i2, i1)

    @triton.jit
    def _add(a, b):
        return a + b       # fp16 adds in the fold's order: any other order rounds differently

    @triton.jit
    def _branchy(a, b):
        if a > b:          # a truth value: on a block it would test one for all elements
            return a
        return b

    @triton.jit
    def _reduce_kernel(x_ptr, out_ptr, idx_ptr, R: tl.constexpr, C: tl.constexpr, WHICH: tl.constexpr):
        rows, cols = tl.arange(0, R), tl.arange(0, C)
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :])
        if WHICH == 0:
            tl.store(out_ptr + cols, tl.reduce(x, 0, _max_keep_nan))
            tl.store(out_ptr + C + rows, tl.reduce(x, 1, _max_keep_nan))
            tl.store(out_ptr + C + R + tl.arange(0, 1), tl.reduce(x, None, _max_keep_nan, keep_dims=True))
        elif WHICH == 1:
            ids = rows[:, None] * C + cols[None, :]
            v, i = tl.reduce((x, ids), 1, _argmax_combine)
            tl.store(out_ptr + rows, v)
            tl.store(idx_ptr + rows, i)
        elif WHICH == 2:
            tl.store(out_ptr + cols, tl.reduce(x.to(tl.float16), 0, _add).to(tl.float32))
        else:
            tl.store(out_ptr + rows, tl.reduce(x, 1, _branchy))

    @triton.jit
    def _helper(x, k):
        return tl.max(x, axis=0) * k + tl.sum(tl.zeros([4], tl.float32), axis=0)

    @triton.jit
    def _helper_kernel(x_ptr, out_ptr, scale):
        pid = tl.program_id(0)
        x = tl.load(x_ptr + pid * 4 + tl.arange(0, 4))
        tl.store(out_ptr + pid, _helper(x, 2.0) + _helper(x * scale, 1.0) + pid)

    @triton.jit
    def _overflow_kernel(out_ptr, a):
        tl.store(out_ptr, a * 3)

    @triton.jit
    def _sort_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, K: tl.constexpr):
        rows, cols = tl.arange(0, R), tl.arange(0, C)
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :])
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], tl.sort(x, descending=True))
        tl.store(out_ptr + R * C + rows[:, None] * K + tl.arange(0, K)[None, :], tl.topk(x, K))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _both(run) -> tuple:
    fast = run()
    with bypassed():
        slow = run()
    return fast, slow


def _inputs(R: int, C: int) -> torch.Tensor:
    x = torch.randn(R, C, generator=torch.Generator().manual_seed(R * C)) * 300
    x[1, 3] = float("nan")
    x[2, :] = 0.0
    x[2, ::2] = -0.0
    x[3, 5] = float("inf")
    x[4, 7] = float("-inf")
    x[5, :] = 1.5                   # ties for the argmax combine
    return x


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_custom_reduction_equals_the_interpreters(which: int) -> None:
    R, C = 8, 16
    x = _inputs(R, C)

    def run():
        out = torch.full((C + R + 1,), 7.0)
        idx = torch.full((R,), -1, dtype=torch.int32)
        _reduce_kernel[(1,)](x, out, idx, R, C, which)
        return out, idx

    (out, idx), (ref, ref_idx) = _both(run)
    assert torch.equal(_bits(out), _bits(ref)) and torch.equal(idx, ref_idx)
    if which == 0:                  # the NaN is carried, and the max is right where there is none
        assert out[3].isnan() and out[C + 1].isnan() and out[-1].isnan()
        assert out[C + 3] == float("inf") and out[C] == x[0].max()


def test_the_fold_is_taken_for_the_kernels_combine_only_where_exact() -> None:
    assert is_elementwise(_max_keep_nan.fn) and is_elementwise(_argmax_combine.fn) and is_elementwise(_add.fn)
    assert not is_elementwise(_branchy.fn)
    assert (interpreter.ReduceOps, "generic_reduce") in _originals


def test_helper_calls_equal_the_interpreters_and_patch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(12, generator=torch.Generator().manual_seed(3))
    x[5] = float("nan")

    def run():
        out = torch.zeros(3)
        _helper_kernel[(3,)](x, out, 0.5)
        return out

    with bypassed():
        ref = run()
    assert (interpreter.GridExecutor, "__call__") in _originals, "shortcut 2 is not installed"
    patch = _originals[interpreter, "_patch_lang"]
    calls = []
    monkeypatch.setitem(_originals, (interpreter, "_patch_lang"), lambda fn: calls.append(fn) or patch(fn))
    out = run()
    assert torch.equal(_bits(out), _bits(ref))
    # the kernel's patch and one for the first helper that sees tl.core, of the 6 helper and 12 tl.max... calls
    assert calls[0].__name__ == "_helper_kernel" and len(calls) <= 2, [f.__name__ for f in calls]
    assert tl.core.is_builtin(tl.load)          # the kernel's patch of tl was restored


def test_int32_overflow_is_still_caught_in_debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (interpreter.interpreter_semantic, "binary_op_sanitize_overflow_impl") in _originals, "not installed"
    out = torch.zeros(1, dtype=torch.int32)
    _overflow_kernel[(1,)](out, 2**30)          # no debug: no check, int32 wraps, as in the interpreter
    assert out.item() == 2**30 * 3 - 2**32
    monkeypatch.setattr(interpreter.interpreter_builder, "options",
                        dataclasses.replace(interpreter.interpreter_builder.options, debug=True))
    with pytest.raises(Exception, match="int32 overflow"):
        _overflow_kernel[(1,)](out, 2**30)


def test_every_shortcut_is_taken_on_this_triton() -> None:
    assert missing() == [], f"Triton {triton.__version__}'s interpreter lacks what these replace: {missing()}"


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_sorts_equal_the_interpreters_network(dtype: torch.dtype) -> None:
    """Integer keys (the indexer's packed ones, with ties) are sorted by numpy; a float sort keeps the
    interpreter's network. Either way: the network's values."""
    R, C, K = 4, 32, 8
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-50, 50, (R, C), generator=g).to(dtype)   # many ties

    def run():
        out = torch.zeros(R * C + R * K, dtype=dtype)
        _sort_kernel[(1,)](x, out, R, C, K)
        return out
    fast, slow = _both(run)
    assert torch.equal(fast, slow)
    assert torch.equal(fast[:R * C].view(R, C), x.sort(dim=1, descending=True).values)
