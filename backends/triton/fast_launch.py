"""Launch a kernel's compiled binary directly, without Triton's per-call binding (opt-in).

``kernel[grid](*args, **kwargs)`` binds every argument, computes the
specialization key (each int's value class, each pointer's alignment), looks
the compiled kernel up and only then launches it: 10-30 us of host time per
launch in Triton 3.x, for a decode step of four or five launches whose GPU work
is ~10 us. With ``Algorithms.fast_launch`` the first launch of a call class
goes through Triton as usual and keeps the compiled kernel it returns; later
launches of that class call its launcher with the runtime arguments only.

A *call class* is everything Triton specializes on, so the kept binary is the
one Triton would pick: each runtime int's value (exactly; strides and counts
of one shape class repeat), each tensor's dtype and 16-byte alignment, the
constexprs, the launch options and the device. A parameter the kernel declares
``do_not_specialize`` (a count or offset that changes every step, such as a
prefill's first token or block count) is compiled the same for every value of
one integer width, so only its width (32 or 64 bits) is in the class: a step
with new such values still launches directly. The current stream is read on
every launch, so launches inside CUDA-graph capture are captured as usual.

What this needs of Triton's internals is :mod:`.compat`'s (the launcher's
calling convention, the JIT function's parameters, the driver, the launch
hooks), checked there per release. Where the installed Triton lacks one of
them, its launcher does not take the call (or passes the runtime parameters
only, Triton < 3.3), or the first direct launch raises, the kernel falls
back to ``kernel[grid](...)`` for good and a :class:`FastLaunchWarning` says
so, once per reason: the launches stay right, only slower. Interpreted
kernels (``TRITON_INTERPRET=1``) take Triton's path silently (nothing is
compiled), and so does every call while a launch hook (a profiler) is
installed, which needs Triton's launch metadata.

Every launch of the Triton plugins goes through :func:`launch`, so
:func:`recording` sees all of them: it records each launch instead of making
it (tests/test_launch_invariants.py checks what must hold of them,
tools/aot_check.py compiles them for each GPU target).

Example:
    >>> fast = FastLauncher()
    >>> fast.stats()
    {'direct': 0, 'triton': 0, 'disabled': 0}
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from operator import itemgetter
from typing import Any, Iterator, NamedTuple, Optional

import torch

from . import compat

__all__ = ["FastLauncher", "FastLaunchWarning", "launch", "recording", "Launch", "MAX_CLASSES"]

#: call classes kept per kernel before the memory starts over
MAX_CLASSES = 1024

_I32_END = 2**31


class _Kernel:
    """One JIT function's kept binaries, by call class."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = compat.jit_params(fn)
        # an interpreted function, a wrapper or a test's recorder is launched as it asks to be
        self.disabled = params is None
        self.names: list[str] = params.names if params else []
        self.defaults: dict[str, Any] = params.defaults if params else {}
        #: positions of the runtime parameters Triton does not specialize (``do_not_specialize``)
        self.free: frozenset[int] = params.free if params else frozenset()
        #: call class -> (the binary's launcher, its leading arguments, the constexprs' values)
        self.binaries: dict[Any, tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = {}
        self.split: Optional[tuple[Any, Any, Any]] = None
        #: (id(constexprs), id(options)) -> (the two dicts, their token); equal items -> one token
        self.static: dict[tuple[int, int], tuple[Any, Any, int]] = {}
        self.tokens: dict[tuple[Any, ...], int] = {}

    def arg_class(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """What Triton specializes the runtime arguments on (a superset): every non-tensor
        argument's value but the ``do_not_specialize`` ones' (of those, whether all fit 32 bits),
        each tensor's dtype and 16-byte alignment. Tensors sit at the same positions in every
        call of a kernel (found on the first); else AttributeError."""
        if self.split is None:
            at_t = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            at_f = [i for i in range(len(args)) if i not in at_t and i in self.free]
            at_o = [i for i in range(len(args)) if i not in at_t and i not in self.free]
            # itemgetter of one index returns the item, not a 1-tuple: pad with a constant position
            self.split = (itemgetter(*at_t, *at_t[:1]), itemgetter(*at_o, *at_t[:1]) if at_o else None,
                          itemgetter(*at_f, at_f[0]) if at_f else None)
        get_t, get_o, get_f = self.split
        ts = get_t(args)
        if get_f is not None:   # Triton types an unspecialized int i32 or i64 by its value
            f = get_f(args)
            width = max(f) < _I32_END and min(f) >= -_I32_END
        else:
            width = True
        return (get_o(args)[:-1] if get_o is not None else (), tuple([t.dtype for t in ts]),
                tuple([t.data_ptr() & 15 for t in ts]), len(args), width)

    def static_token(self, kwargs: dict[str, Any], options: dict[str, Any]) -> int:
        """A small int standing for the call's constexprs and options (the same for equal ones),
        found by the two dicts' identity: hashing their items on every launch costs host time."""
        ids = (id(kwargs), id(options))
        seen = self.static.get(ids)
        if seen is not None and seen[0] is kwargs and seen[1] is options:
            return seen[2]
        items = (tuple(kwargs.items()), tuple(options.items()))
        token = self.tokens.setdefault(items, len(self.tokens))
        if len(self.static) >= MAX_CLASSES:   # dicts made per call (not a plan's): start over
            self.static.clear()
        self.static[ids] = (kwargs, options, token)
        return token

    def tail(self, n_args: int, kwargs: dict[str, Any]) -> Optional[tuple[Any, ...]]:
        """The values of parameters ``n_args..`` (constexprs) in order, or None if one is not known."""
        out = []
        for name in self.names[n_args:]:
            if name in kwargs:
                out.append(kwargs[name])
            elif name in self.defaults:
                out.append(self.defaults[name])
            else:
                return None
        return tuple(out)


#: a launch hook (a profiler) is installed: it needs Triton's launch metadata, so take Triton's path
_hooks_installed = compat.hooks_installed


_UNUSABLE: Optional[str] = None


def _direct_launch_problem() -> str:
    """'' when the installed Triton has every internal the direct launch reads, else what it lacks
    (asked once per process)."""
    global _UNUSABLE
    if _UNUSABLE is None:
        lacking = compat.missing(compat.DIRECT_LAUNCH)
        _UNUSABLE = f"this Triton lacks {'; '.join(lacking)}" if lacking else ""
    return _UNUSABLE


class FastLaunchWarning(RuntimeWarning):
    """The direct launch is off for a kernel: it launches through Triton's own binding (slower host)."""


_WARNED: set[str] = set()


def _fall_back(kernel: "_Kernel", why: str) -> None:
    """Turn the direct launch off for ``kernel``, and say why (once per reason and process)."""
    kernel.disabled = True
    if why not in _WARNED:
        _WARNED.add(why)
        import triton

        warnings.warn(f"mm3_backends.triton.fast_launch: {why} (Triton {triton.__version__}); kernels such as "
                      f"{getattr(kernel.fn, '__name__', kernel.fn)!s} launch through Triton's own binding, right "
                      f"but with more host time per launch", FastLaunchWarning, stacklevel=3)


class FastLauncher:
    """Keeps the compiled kernels of the call classes it launched; thread-safe.

    One per plugin config is enough (the kernels are module-level); a class's
    binary depends on nothing else than what its key holds.
    """

    def __init__(self) -> None:
        self._kernels: dict[int, _Kernel] = {}
        self._lock = threading.Lock()
        self._counts = {"direct": 0, "triton": 0, "disabled": 0}

    def stats(self) -> dict[str, int]:
        """Launches taken directly, through Triton, and through Triton because the kernel fell back."""
        return dict(self._counts)

    def _kernel(self, fn: Any) -> _Kernel:
        k = self._kernels.get(id(fn))
        if k is None or k.fn is not fn:
            with self._lock:
                k = self._kernels[id(fn)] = _Kernel(fn)
            if not k.disabled and _direct_launch_problem():
                _fall_back(k, _direct_launch_problem())
        return k

    def __call__(self, fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: dict[str, Any]) -> None:
        """``fn[grid](*args, **kwargs, **options)``; ``kwargs`` are the constexprs, ``options``
        Triton's launch options (``num_warps``, ``launch_pdl``...). Both are taken by identity once
        seen (a plan's dicts, kept per shape class): a caller must not change them in place."""
        k = self._kernel(fn)
        if k.disabled or _hooks_installed():
            return self._through_triton(fn, grid, args, kwargs, options)
        try:
            active = compat.active_driver()
            dev = active.get_current_device()
            key = (dev, k.arg_class(args), k.static_token(kwargs, options))
        except RuntimeError:   # no GPU driver (CPU tensors without the interpreter): Triton says why
            k.disabled = True
            return self._through_triton(fn, grid, args, kwargs, options)
        except (AttributeError, TypeError, IndexError):   # not the argument layout of its first call
            return self._through_triton(fn, grid, args, kwargs, options)
        kept = k.binaries.get(key)
        if kept is None:
            compiled = fn[grid](*args, **kwargs, **options)
            self._counts["triton"] += 1
            tail = k.tail(len(args), kwargs)
            direct = compat.compiled_launch(compiled, len(k.names)) if tail is not None else \
                "a constexpr of the call has no value"
            if isinstance(direct, str):
                return _fall_back(k, direct)
            if len(k.binaries) >= MAX_CLASSES:
                k.binaries.clear()
            k.binaries[key] = (*direct, tail)
            return
        run, head, tail = kept
        g = (*grid, 1, 1)
        try:
            run(g[0], g[1], g[2], active.get_current_stream(dev), *head, *args, *tail)
        except Exception as e:   # the launcher's calling convention is not the one this Triton has
            _fall_back(k, f"a direct launch raised {type(e).__name__}: {e}")
            return self._through_triton(fn, grid, args, kwargs, options)
        self._counts["direct"] += 1

    def _through_triton(self, fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                        options: dict[str, Any]) -> None:
        """Triton's own launch, for a kernel (or a call) the direct launch does not take."""
        self._counts["disabled"] += 1
        fn[grid](*args, **kwargs, **options)


_DEFAULT = FastLauncher()


class Launch(NamedTuple):
    """One launch, as :func:`recording` keeps it: ``kernel[grid](*args, **constexprs, **options)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    options: dict[str, Any]

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", repr(self.kernel))


_RECORDS: Optional[list[Launch]] = None


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Every :func:`launch` made in the block, recorded and not made (nothing runs, nothing is compiled);
    for tests and tools, one block at a time per process.

    Example:
        >>> with recording() as launches:
        ...     launch(print, (2, 1), ("x",), {"BLOCK": 16}, {"num_warps": 4}, fast=True)
        >>> [(r.grid, r.constexprs) for r in launches]
        [((2, 1), {'BLOCK': 16})]
    """
    global _RECORDS
    if _RECORDS is not None:
        raise RuntimeError("launches are already being recorded")
    _RECORDS = []
    try:
        yield _RECORDS
    finally:
        _RECORDS = None


def launch(fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any],
           fast: bool) -> None:
    """``fn[grid](*args, **kwargs, **options)``, through the process's :class:`FastLauncher` when ``fast``."""
    if _RECORDS is not None:
        _RECORDS.append(Launch(fn, tuple(grid), tuple(args), kwargs, options))
    elif fast:
        _DEFAULT(fn, grid, args, kwargs, options)
    else:
        fn[grid](*args, **kwargs, **options)
