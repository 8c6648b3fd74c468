"""Four shortcuts through Triton's interpreter, each computing exactly what it computes.

Under ``TRITON_INTERPRET=1`` every kernel runs in Python, one program of the
grid at a time; profiled on the slowest interpreter runs, four pieces of the
interpreter's own machinery were most of their time while adding nothing to
what the kernels compute. Each shortcut below is taken only where the result
is the interpreter's, bit for bit (tests/test_interpreter_shortcuts.py runs
both paths side by side); the kernels' own operations all still run through
the interpreter. The kernel modules install them when they are imported under
the interpreter (:mod:`.tl_utils`, beside :mod:`.interpreter`'s bf16 fix), so
``mm3 check`` and the test suite run the same code at the same speed (a
conformance run of the cuda plugin about five times faster). On a GPU
nothing is patched.

1. **Overflow checks nobody reads.** On every int32 ``+ - *`` the interpreter
   widens both operands to int64, redoes the operation and compares it with
   the int32 range, only to hand the result to ``device_assert``, which drops
   it without a look unless Triton's ``debug`` option is on (it is off). Here
   the check is skipped when ``debug`` is off, and runs as before when on.

2. **Re-patching ``tl`` on every helper call.** The interpreter runs a kernel
   with ``triton.language`` patched (each builtin rerouted to numpy), and
   patches again on *every* call of a ``@triton.jit`` helper from inside it:
   an ``inspect.getmembers`` walk that re-wraps nothing (the builtins are
   already wrappers, and a wrapper is no builtin) and re-sets a few
   attributes to equivalent closures, 1.6 ms a call. Here the patch is
   skipped when the kernel run in progress (a call of the interpreter's
   ``GridExecutor``) has already patched every ``triton.language`` module
   the helper can see (its globals): by the kernel's own patch, or by an
   earlier helper's in the same run (the interpreter never restores a
   helper's patch, so it stays in force; Triton's ``tl.max``, ``tl.zeros``...
   see ``tl.core`` where the kernels see ``tl``). The first helper of a run
   that sees another module is patched as before, and so is anything called
   outside a kernel run; the kernel's own patch and its restore are untouched.

3. **A custom reduction one element at a time.** For ``tl.reduce`` with a
   combine function of its own (the indexer's NaN-carrying max,
   ``_max_keep_nan``), the interpreter calls the combine function once per
   *element* (2048 calls, 65 ms, for a ``[32, 64]`` score tile). Here the
   same left fold runs over the reduced axis only, each step combining whole
   slices: ``acc = x[0]; acc = f(acc, x[1]); ...``. Every output element sees
   the same calls in the same order, and the accumulator is stored in the
   input's dtype after each step as there. That holds only for a combine
   function that is elementwise: on a block, a Python ``if`` or ``and``
   would test one truth value for all elements (the interpreter calls any
   block true), so the fold is taken only when the function's body is
   straight-line code calling nothing but ``tl.*``; any other combine
   function keeps the interpreter's loop.

4. **A sorting network one numpy operation at a time.** ``tl.topk`` and
   ``tl.sort`` run a bitonic network as element-wise numpy operations (three
   quarters of an indexer step's time). Both return *values* (sorted, the
   largest ``k`` for top-k), never positions, so no tie can come out in
   another order: a numpy sort of the same values is the same tensor. The
   indexer sorts int64 keys that pack (score, block id) exactly for this. Only
   integer values take the shortcut: a float sort keeps the interpreter's
   network (NaN ordering is where a numpy sort and the network could differ).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import triton.language as tl

from . import compat

__all__ = ["install", "bypassed", "is_elementwise", "missing"]

_originals: dict[tuple[Any, str], Any] = {}   # (object, attribute) -> the interpreter's own
#: Triton's interpreter (what the shortcuts replace is named in ``compat.INTERNALS``, checked per release)
interpreter: Any = compat.interpreter_module()


def _replace(obj: Any, name: str, new: Any) -> None:
    if (obj, name) not in _originals:
        _originals[obj, name] = getattr(obj, name)
        setattr(obj, name, new)


@contextmanager
def bypassed() -> Iterator[None]:
    """The interpreter's own code paths while the block runs (to compare with the shortcuts)."""
    ours = {key: getattr(*key) for key in _originals}
    for (obj, name), theirs in _originals.items():
        setattr(obj, name, theirs)
    try:
        yield
    finally:
        for (obj, name), new in ours.items():
            setattr(obj, name, new)


# -- 1. overflow checks ---------------------------------------------------------------------------

def _install_unread_checks_skipped() -> None:
    sem = interpreter.interpreter_semantic
    check = sem.binary_op_sanitize_overflow_impl

    def binary_op_sanitize_overflow_impl(self: Any, lhs: Any, rhs: Any, binary_op: Callable) -> None:
        if not self.builder.options.debug:
            return          # device_assert would return before reading the check (Triton's own rule)
        check(lhs, rhs, binary_op)

    _replace(sem, "binary_op_sanitize_overflow_impl", types.MethodType(binary_op_sanitize_overflow_impl, sem))


# -- 2. helper calls ------------------------------------------------------------------------------

_open: list[set[int]] = []   # per kernel run in progress: the language modules patched so far in it
_langs: dict[Any, frozenset[int]] = {}


def _visible_langs(fn: Any) -> frozenset[int]:
    # the modules the interpreter's own _patch_lang patches for fn
    if fn not in _langs:
        _langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                               if inspect.ismodule(v) and v in (tl, tl.core))
    return _langs[fn]


def _install_patch_once() -> None:
    run = interpreter.GridExecutor.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        _open.append(set())                            # a kernel run: its own patch comes first, then helpers
        try:
            return run(self, *args, **kwargs)
        finally:
            _open.pop()

    def _patch_lang(fn: Any) -> Any:
        langs = _visible_langs(fn)
        if _open and langs and langs <= _open[-1]:
            return interpreter._LangPatchScope()       # already patched: nothing to do, nothing to restore
        scope = _originals[interpreter, "_patch_lang"](fn)
        if _open:
            _open[-1] |= langs   # the kernel's patch (restored at its end) or a helper's (never restored)
        return scope

    _replace(interpreter.GridExecutor, "__call__", __call__)
    _replace(interpreter, "_patch_lang", _patch_lang)


# -- 3. custom reductions ------------------------------------------------------------------------

# nodes that would make a combine function act differently on a block than on scalars
_CONTROL_FLOW = (ast.If, ast.IfExp, ast.While, ast.For, ast.BoolOp, ast.Assert, ast.Try, ast.With,
                 ast.comprehension, ast.Subscript)
_verdicts: dict[Any, bool] = {}


def is_elementwise(fn: Any) -> bool:
    """Whether ``fn`` (a ``@triton.jit`` combine function) is straight-line code over ``tl.*`` calls."""
    if fn not in _verdicts:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            _verdicts[fn] = False
            return False
        body = tree.body[0]
        ok = isinstance(body, ast.FunctionDef)
        for node in (n for stmt in (body.body if ok else ()) for n in ast.walk(stmt)):   # not the decorator
            if isinstance(node, (*_CONTROL_FLOW, ast.FunctionDef, ast.Lambda)):
                ok = False
            elif isinstance(node, ast.Call):
                f = node.func
                ok &= isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl"
        _verdicts[fn] = ok
    return _verdicts[fn]


def _column_fold(self: Any, input: tuple) -> list:
    """``ReduceOps.generic_reduce``'s left fold, over whole slices of the reduced axis."""
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    data = [arg.handle.data for arg in input]
    dtypes = [arg.dtype for arg in input]
    out_shape = data[0].shape[:axis] + data[0].shape[axis + 1:]

    def wrap(values: list) -> tuple:
        return tuple(self.to_tensor(v, dt) for v, dt in zip(values, dtypes))

    def stored(value: Any, like: np.ndarray) -> np.ndarray:
        # what the interpreter's loop keeps: the combined value written into an array of the input's dtype
        raw = np.asarray(value.handle.data if isinstance(value, tl.core.tensor) else value).astype(like.dtype)
        return np.broadcast_to(raw.reshape(()) if raw.size == 1 else raw, out_shape).copy()

    acc = [np.take(d, 0, axis=axis) for d in data]
    for i in range(1, data[0].shape[axis]):
        ret = self.combine_fn.fn(*wrap(acc), *wrap([np.take(d, i, axis=axis) for d in data]))
        ret = ret if isinstance(ret, tuple) else (ret,)
        acc = [stored(r, d) for r, d in zip(ret, data)]
    out = []
    for values, dt in zip(acc, dtypes):
        values = np.asarray(values)
        if self.keep_dims:
            values = np.expand_dims(values, axis) if original_axis is not None else \
                values.reshape((1,) * data[0].ndim)
        elif original_axis is None:
            values = values.item()
        out.append(self.to_tensor(values, dt))
    return out


def _install_column_fold() -> None:
    slow = interpreter.ReduceOps.generic_reduce

    def generic_reduce(self: Any, input: tuple) -> list:
        if is_elementwise(self.combine_fn.fn) and input[0].handle.data.size:
            return _column_fold(self, input)
        return slow(self, input)

    _replace(interpreter.ReduceOps, "generic_reduce", generic_reduce)


# -- 4. sorts -----------------------------------------------------------------------------------------

def _value(c: Any) -> Any:
    return getattr(c, "value", c)


def _install_numpy_sorts() -> None:
    network_topk, network_sort = tl.topk, tl.sort

    def sorted_values(x: Any, k: Any, dim: Any, descending: bool) -> Any:
        data = x.handle.data
        out = np.sort(data, axis=-1)
        if descending:
            out = out[..., ::-1]
        if k is not None:
            out = out[..., :k]
        out = np.ascontiguousarray(out)
        return tl.tensor(interpreter.TensorHandle(out, x.handle.dtype), tl.block_type(x.dtype, list(out.shape)))

    def exact(x: Any, dim: Any) -> bool:
        dim = _value(dim)
        data = getattr(getattr(x, "handle", None), "data", None)
        return isinstance(data, np.ndarray) and np.issubdtype(data.dtype, np.integer) and \
            dim in (None, -1, data.ndim - 1)

    # the caller's arguments are passed on as given: not every release's tl.topk takes ``descending``
    # (compat.RELEASES)
    def topk(x: Any, k: Any, dim: Any = None, **kwargs: Any) -> Any:
        if set(kwargs) - {"descending"} or not exact(x, dim):
            return network_topk(x, k, dim=dim, **kwargs)
        return sorted_values(x, _value(k), dim, bool(_value(kwargs.get("descending", True))))

    def sort(x: Any, dim: Any = None, **kwargs: Any) -> Any:
        if set(kwargs) - {"descending"} or not exact(x, dim):
            return network_sort(x, dim=dim, **kwargs)
        return sorted_values(x, None, dim, bool(_value(kwargs.get("descending", False))))

    for module in (tl, tl.standard):
        _replace(module, "topk", topk)
        _replace(module, "sort", sort)


#: each shortcut's installer, by its name in ``compat.SHORTCUTS``
_SHORTCUTS = dict(zip(compat.SHORTCUTS, (_install_unread_checks_skipped, _install_patch_once, _install_column_fold,
                                         _install_numpy_sorts)))
_taken: list[str] = []


def missing() -> list[str]:
    """The shortcuts :func:`install` left out, because this Triton's interpreter lacks what they replace."""
    return [shortcut for shortcut in _SHORTCUTS if shortcut not in _taken]


def install() -> None:
    """Install the shortcuts (call only when the interpreter is on; a second call does nothing).

    A shortcut whose interpreter internals this Triton lacks (:func:`.compat.missing`) is left out,
    and a warning says so: the interpreter is then slower, not wrong."""
    if _taken:
        return
    for shortcut, setup in _SHORTCUTS.items():
        lacking = compat.missing(shortcut)
        if lacking:
            warnings.warn(f"mm3_backends.triton: the interpreter shortcut {shortcut!r} is left out, Triton's "
                          f"interpreter lacks {'; '.join(lacking)} (kernels run slower under TRITON_INTERPRET=1, "
                          f"not wrong)", RuntimeWarning, stacklevel=2)
            continue
        setup()
        _taken.append(shortcut)
