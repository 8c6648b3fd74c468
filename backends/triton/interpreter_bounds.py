"""Every memory access of an interpreted kernel held to the tensors it was handed (a test tool).

A GPU kernel that loads or stores outside its tensors reads garbage or
corrupts memory, and at worst raises an illegal-address error that poisons the
whole CUDA context. mm3 judges a device batch's contents *while* the step's
kernels run (docs/errors.md §2.6), so in a faulty step every kernel still runs
on the faulty query starts, positions, token requests and block table: each
must stay inside its tensors whatever int32 values they hold.

Under ``TRITON_INTERPRET=1`` (elsewhere it raises), :func:`checking` makes that
observable on a CPU:
while it is active, every load, store and atomic of an interpreted kernel is
compared, lane by lane, with the byte extents of the kernel's tensor arguments
(each view's own extent, from its sizes and strides, not its storage's). A lane
outside the access's own tensor (the argument holding most of its lanes) is
recorded as a :class:`Violation` and masked off, so the run goes on instead of
corrupting the process or aborting it. What it cannot see: an access whose
every lane lands inside another argument, or one in another row of the same
tensor (wrong, but no crash on a GPU either).

What it patches is Triton's private interpreter, reached through :mod:`.compat`
(``compat.INTERNALS[compat.BOUNDS]`` names it, checked per Triton release by
tests/test_triton_compat.py). tests/test_kernel_bounds.py runs the plugins'
kernels under it on batches corrupted in place.

Example:
    >>> import torch, triton, triton.language as tl
    >>> @triton.jit
    ... def shift(x_ptr, n, BLOCK: tl.constexpr):
    ...     offs = tl.arange(0, BLOCK)
    ...     tl.store(x_ptr + offs + n, 1.0, mask=offs < 4)
    >>> x = torch.zeros(8)
    >>> with checking() as found:                  # doctest: +SKIP
    ...     shift[(1,)](x, 6, BLOCK=4)
    >>> [(v.kernel, v.op, v.lanes) for v in found]  # doctest: +SKIP
    [('shift', 'store', 2)]
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import numpy as np

from . import compat, tl_utils

__all__ = ["Violation", "checking"]


class Violation(NamedTuple):
    """Lanes of one access outside every tensor argument of its kernel."""

    kernel: str
    op: str            # "load", "store", "atomic"
    nearest: str       # the argument holding most of the access's lanes (its own tensor), or where no lane is
                       # inside any argument, the one the first bad address is nearest to
    lanes: int         # how many lanes of the access were outside
    offset: int        # the first bad address, in elements from the start of ``nearest``'s extent
    elements: int      # the elements of ``nearest``'s extent


_state = threading.local()   # .found: the active list of violations, .frames: per launch, the extents
_LOCK = threading.Lock()
_installed: list[bool] = []


def _extent(t: Any) -> tuple[int, int, int]:
    """``(lo, hi, element size)``: the bytes a view reaches, from its sizes and strides."""
    t = getattr(t, "base", t)   # the tensor under the interpreter's wrapper of a reinterpreted one
    size = t.element_size()
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start, size
    lo = hi = 0
    for n, stride in zip(t.shape, t.stride()):
        span = (n - 1) * stride
        if span < 0:
            lo += span
        else:
            hi += span
    return start + lo * size, start + (hi + 1) * size, size


def _extents(fn: Any, args: Any, kwargs: Any) -> list[tuple[int, int, str, int]]:
    names = inspect.getfullargspec(fn).args
    found = []
    for name, arg in [*zip(names, args), *kwargs.items()]:
        if hasattr(arg, "data_ptr") and hasattr(arg, "stride"):
            lo, hi, size = _extent(arg)
            found.append((lo, hi, name, size))
    return found


def _inside(op: str, ptrs: Any, mask: Any, nbytes: int) -> Any:
    """``mask`` with each lane outside the access's tensor cleared (and recorded); ``mask`` itself when every
    lane is inside, or when no check is active. An access's tensor is the argument whose extent holds most
    of its lanes (a pointer block derives from one argument), so a lane that overruns into a neighbouring
    argument is caught too; an access with no lane inside any argument is all outside."""
    frames = getattr(_state, "frames", None)
    found = getattr(_state, "found", None)
    if not frames or found is None:
        return mask
    kernel, extents = frames[-1]
    addr = np.asarray(ptrs).astype(np.uint64, copy=False).astype(np.int64)
    lanes = np.broadcast_to(np.asarray(mask, dtype=bool), addr.shape)
    if not lanes.any():
        return mask
    within = [lanes & (addr >= lo) & (addr + nbytes <= hi) for lo, hi, _, _ in extents]
    counts = [int(w.sum()) for w in within]
    best = max(range(len(extents)), key=counts.__getitem__) if extents else -1
    ok = within[best] if best >= 0 and counts[best] else np.zeros(addr.shape, dtype=bool)
    bad = lanes & ~ok
    if not bad.any():
        return mask
    first = int(addr[bad].flat[0])
    if not extents:
        found.append(Violation(kernel, op, "", int(bad.sum()), first, 0))
        return ok
    if counts[best]:
        lo, hi, name, size = extents[best]
    else:   # nothing inside: name the argument the first bad address is nearest to
        lo, hi, name, size = min(extents, key=lambda e: 0 if e[0] <= first < e[1] else min(abs(e[0] - first),
                                                                                         abs(first - e[1])))
    found.append(Violation(kernel, op, name, int(bad.sum()), (first - lo) // size, (hi - lo) // size))
    return ok


def _install() -> None:
    """Patch the interpreter once per process (inactive outside :func:`checking`)."""
    with _LOCK:
        if _installed:
            return
        lacking = compat.missing(compat.BOUNDS)
        if lacking:
            checked = compat.checked_releases(" or ")
            version = compat.installed_version()
            which = f"Triton {version[0]}.{version[1]}" if version else "the installed Triton"
            raise RuntimeError(f"the interpreter's bounds check needs Triton internals {which} lacks: "
                               f"{'; '.join(lacking)}. Install a Triton release mm3_backends.triton was checked "
                               f"on (Triton {checked}), which has them")
        interp = compat.interpreter_module()
        executor, builder = interp.GridExecutor, interp.InterpreterBuilder
        handle, np_dtype = interp.TensorHandle, interp._get_np_dtype
        init_args, call = executor._init_args_hst, executor.__call__

        def _init_args_hst(self: Any, args_dev: Any, kwargs: Any) -> Any:
            args, kw = init_args(self, args_dev, kwargs)
            if getattr(_state, "found", None) is not None:
                _state.frames.append((self.fn.__name__, _extents(self.fn, args, kw)))
            return args, kw

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            frames = getattr(_state, "frames", None)
            depth = len(frames) if frames is not None else 0
            try:
                return call(self, *args, **kwargs)
            finally:
                if frames is not None:
                    del frames[depth:]

        def _nbytes(ptrs: Any) -> int:
            return int(np.dtype(np_dtype(ptrs.get_element_ty())).itemsize)

        def _masked(op: str, ptrs: Any, mask: Any) -> Any:
            kept = _inside(op, ptrs.data, mask.data, _nbytes(ptrs))
            return mask if kept is mask.data else handle(np.ascontiguousarray(kept), mask.dtype)

        load, store, rmw, cas = (builder.create_masked_load, builder.create_masked_store,
                                 builder.create_atomic_rmw, builder.create_atomic_cas)

        def create_masked_load(self: Any, ptrs: Any, mask: Any, *rest: Any) -> Any:
            return load(self, ptrs, _masked("load", ptrs, mask), *rest)

        def create_masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
            return store(self, ptrs, value, _masked("store", ptrs, mask), *rest)

        def create_atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *rest: Any) -> Any:
            return rmw(self, op, ptr, val, _masked("atomic", ptr, mask), *rest)

        def create_atomic_cas(self: Any, ptr: Any, cmp: Any, val: Any, *rest: Any) -> Any:
            # no mask to clear: recorded only (a compare-and-swap outside is a test failure all the same)
            _inside("atomic", ptr.data, np.ones(np.shape(ptr.data), dtype=bool), _nbytes(ptr))
            return cas(self, ptr, cmp, val, *rest)

        executor._init_args_hst, executor.__call__ = _init_args_hst, __call__
        builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
        builder.create_atomic_rmw, builder.create_atomic_cas = create_atomic_rmw, create_atomic_cas
        _installed.append(True)


@contextmanager
def checking() -> Iterator[list[Violation]]:
    """Check every access of the kernels interpreted in this thread while active; yields the list the
    :class:`Violation` s are appended to (empty: every access was inside its kernel's tensors).

    Raises ``RuntimeError`` where Triton compiles kernels instead of interpreting them (it would check
    nothing: ``TRITON_INTERPRET=1`` must be set before Triton is imported) and where the installed Triton
    lacks an internal it patches."""
    if not tl_utils.interpreting():
        raise RuntimeError("the interpreter's bounds check sees only kernels Triton interprets, and this process's "
                           "Triton compiles them: set TRITON_INTERPRET=1 before Triton is imported (it decides "
                           "when it decorates a kernel)")
    _install()
    found: list[Violation] = []
    outer = getattr(_state, "found", None), getattr(_state, "frames", None)
    _state.found, _state.frames = found, []
    try:
        yield found
    finally:
        _state.found, _state.frames = outer
