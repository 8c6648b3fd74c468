"""Triton's CPU interpreter made to compute bf16, e4m3 NaNs and e5m2 as a GPU does.

Under ``TRITON_INTERPRET=1`` the interpreter runs each kernel operation in
numpy, which has no bfloat16: it keeps a bf16 value as its 16 bits in a
``uint16`` array, and then

* ``tl.dot`` of bf16 tiles multiplies those integers;
* ``+ - * /``, comparisons, ``min``/``max`` and unary math on bf16 run on the
  integers too (``q * q`` is wrong, and so is ``a < b`` for negative values);
* fp32 -> bf16 truncates, where a GPU rounds to nearest even; an int <-> bf16
  cast converts the bits, not the value;
* an e4m3 NaN (``0x7f``/``0xff``) widens to +-480, as if it were a number;
* e5m2 widens wrongly: its subnormals to fp16 lose bits (``0x01`` gives 0), its
  infinities and NaNs to fp32 and bf16 become numbers (``0x7c`` gives 65536).

So a bf16 step of the Triton plugins selects the wrong blocks and outputs
garbage there, and ``mm3 check cuda`` on a CPU reports FAIL for a kernel that is
right. :func:`install` patches the interpreter's builder so that bf16 operands
are widened to fp32 (exact), the operation runs in fp32 and a bf16 result is
rounded to nearest even; every other dtype still takes the interpreter's own
code. It is what a GPU does for bf16 up to the order of a dot's sum. Left as
they are: reductions, scans, clamps and fma over bf16 blocks (the kernels
reduce and clamp fp32 values only). e4m3 NaNs are kept NaN, and e5m2 is
widened from its bits (an e5m2 byte is the upper half of the fp16 of the same
value: exact, as a GPU widens it).

The kernel modules install it when they are imported under the interpreter
(:mod:`.tl_utils`), so the plugins' hooks, the test suite and a direct call
of the kernels all compute the same. The patch is process-wide: other
interpreted kernels in the process get correct bf16 too. On a GPU nothing is
patched. What it replaces is Triton's private interpreter, reached through
:mod:`.compat` (``compat.INTERNALS[compat.BF16]`` names it, checked per Triton
release by tests/test_triton_compat.py); tests/test_interpreter_bf16.py
compares each patched operation with torch's bf16 on the CPU.

Example:
    >>> import numpy as np
    >>> bits = f32_to_bf16(np.array([1.0, 1.00390625, 1.01171875, -2.5], dtype=np.float32))
    >>> [hex(b) for b in bits]          # 1 + 2^-8 is a tie: to the even 1.0; 1 + 3 * 2^-8 rounds up
    ['0x3f80', '0x3f80', '0x3f82', '0xc020']
    >>> bf16_to_f32(bits).tolist()
    [1.0, 1.0, 1.015625, -2.5]
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from . import compat

__all__ = ["install", "missing", "bf16_to_f32", "f32_to_bf16", "PATCHED"]

#: the interpreter builder's methods :func:`install` replaces
PATCHED = tuple(i.rpartition(".")[2] for i in compat.INTERNALS[compat.BF16] if ":InterpreterBuilder." in i)

_ORIGINALS: dict[str, Callable[..., Any]] = {}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 values from their bits (``uint16``) as fp32: exact, the upper half of the fp32 bits."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as bits (``uint16``); NaN stays NaN."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    # a NaN's low payload bits would round it into an infinity: keep it quiet and NaN
    quiet = (bits >> np.uint32(16)) | np.uint32(0x40)
    return np.where(np.isnan(values), quiet, rounded).astype(np.uint16)


def missing() -> list[str]:
    """What :func:`install` needs and the installed Triton's interpreter lacks ([] when all is there)."""
    return compat.missing(compat.BF16)


def install() -> bool:
    """Patch the interpreter (once; a second call does nothing). False, with a warning that says why,
    when this Triton's interpreter lacks what the patch replaces: its bf16 results are then wrong."""
    if _ORIGINALS:
        return True
    lacking = missing()
    if lacking:
        warnings.warn(f"mm3_backends.triton: Triton's interpreter lacks {'; '.join(lacking)}; bf16 kernels "
                      f"under TRITON_INTERPRET=1 compute wrong results on this Triton (run bf16 on a GPU)",
                      RuntimeWarning, stacklevel=2)
        return False
    interpreter = compat.interpreter_module()
    builder = interpreter.InterpreterBuilder
    for name, new in _replacements(interpreter).items():
        _ORIGINALS[name] = getattr(builder, name)
        setattr(builder, name, new)
    return True


def _replacements(interp: Any) -> dict[str, Callable[..., Any]]:
    import triton.language as tl

    Handle, np_dtype = interp.TensorHandle, interp._get_np_dtype
    bf16 = tl.bfloat16
    # an explicit round-towards-zero cast to bf16 keeps the interpreter's truncation
    rtz = interp._ir.ROUNDING_MODE.RTZ

    def widened(handle: Any) -> np.ndarray:
        return bf16_to_f32(handle.data) if handle.dtype.scalar == bf16 else handle.data

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if d == bf16 and s != bf16:
            return Handle(f32_to_bf16(src.data.astype(np.float32)), d)
        if s == bf16 and d != bf16:
            return Handle(bf16_to_f32(src.data).astype(np_dtype(d)), d)
        return _ORIGINALS["cast_impl"](self, src, dst_type)

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if d == bf16 and s == tl.float32 and rounding_mode != rtz:
            return Handle(f32_to_bf16(src.data), d)
        if s == tl.float8e5 and d in (tl.float16, tl.float32, bf16):
            # e5m2 is fp16 with the low byte dropped: widen through fp16, exactly
            half = (src.data.astype(np.uint16) << np.uint16(8)).view(np.float16)
            if d == tl.float16:
                return Handle(half, d)
            return Handle(f32_to_bf16(half.astype(np.float32)) if d == bf16 else half.astype(np.float32), d)
        out = _ORIGINALS["create_fp_to_fp"](self, src, dst_type, rounding_mode)
        if s == tl.float8e4nv and d in (tl.float16, tl.float32, bf16):
            # e4m3fn has no infinity: S.1111.111 is its NaN
            nan = (src.data & np.uint8(0x7F)) == np.uint8(0x7F)
            if nan.any():
                values = widened(out) if d == bf16 else out.data.astype(np.float32)
                values = np.where(nan, np.float32("nan"), values)
                data = f32_to_bf16(values) if d == bf16 else values.astype(np_dtype(d))
                out = Handle(data, d)
        return out

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Callable[..., np.ndarray]) -> Any:
        if lhs.dtype.scalar != bf16 and rhs.dtype.scalar != bf16:
            return _ORIGINALS["binary_op"](self, lhs, rhs, op)
        out = op(widened(lhs), widened(rhs))
        if np.issubdtype(out.dtype, np.floating):
            return Handle(f32_to_bf16(out), bf16)
        return Handle(out, tl.int1)   # a comparison: booleans (a bf16 label would make a cast read them as bf16)

    def unary_op(self: Any, arg: Any, op: Callable[..., np.ndarray]) -> Any:
        if arg.dtype.scalar != bf16:
            return _ORIGINALS["unary_op"](self, arg, op)
        return Handle(f32_to_bf16(op(bf16_to_f32(arg.data))), bf16)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.scalar != bf16 and b.dtype.scalar != bf16:
            return _ORIGINALS["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        # bf16 x bf16 products are exact in fp32, accumulated in the accumulator's dtype
        return Handle(np.matmul(widened(a), widened(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)

    return {"cast_impl": cast_impl, "create_fp_to_fp": create_fp_to_fp, "binary_op": binary_op,
            "unary_op": unary_op, "create_dot": create_dot}
