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
constexprs, the launch options and the device. The current stream is read on
every launch, so launches inside CUDA-graph capture are captured as usual.

Falls back to ``kernel[grid](...)`` for good (per kernel) when the kernel is
interpreted (``TRITON_INTERPRET=1``), when the installed Triton lacks what
this needs (a compiled kernel returned by the launch, ``CompiledKernel.run``
taking every parameter, constexprs included: Triton >= 3.3), or when the
first direct launch raises; and per call while a launch hook (a profiler) is
installed.

Example:
    >>> fast = FastLauncher()
    >>> fast.stats()
    {'direct': 0, 'triton': 0, 'disabled': 0}
"""

from __future__ import annotations

import inspect
import threading
from operator import itemgetter
from typing import Any, Optional

import torch

__all__ = ["FastLauncher", "launch", "MAX_CLASSES"]

#: call classes kept per kernel before the memory starts over
MAX_CLASSES = 1024


def _installed(hook: Any) -> bool:
    # Triton >= 3.8 holds a chain of hooks (empty: nothing installed), older ones a callable or None
    return hook is not None and bool(getattr(hook, "calls", True))


def _hook_holder() -> Any:
    """Where this Triton keeps its launch hooks (looked up once: an import per launch costs ~1 us)."""
    global _HOOKS
    if _HOOKS is None:
        try:
            from triton import knobs

            holder: Any = knobs.runtime
            if not hasattr(holder, "launch_enter_hook"):
                raise AttributeError("launch_enter_hook")
        except (ImportError, AttributeError):  # Triton < 3.4 keeps them on CompiledKernel
            from triton.compiler import CompiledKernel

            holder = CompiledKernel
        _HOOKS = holder
    return _HOOKS


_HOOKS: Any = None


def _hooks_installed() -> bool:
    """A launch enter/exit hook (a profiler) needs Triton's launch metadata: take its path then."""
    h = _hook_holder()
    return _installed(getattr(h, "launch_enter_hook", None)) or _installed(getattr(h, "launch_exit_hook", None))


def _driver() -> Any:
    """Triton's driver proxy (imported once)."""
    global _DRIVER
    if _DRIVER is None:
        from triton.runtime.driver import driver

        _DRIVER = driver
    return _DRIVER


_DRIVER: Any = None


class _Kernel:
    """One JIT function's kept binaries, by call class."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.names: list[str] = list(getattr(fn, "arg_names", ()))
        self.defaults = {p.name: p.default for p in getattr(fn, "params", ()) if _has_default(p)}
        self.binaries: dict[Any, tuple[Any, tuple[Any, ...]]] = {}
        # an InterpretedFunction has no device caches; anything else that is not a JIT function
        # (a wrapper, a test's recorder) is launched as it asks to be
        self.disabled = not (hasattr(fn, "device_caches") and self.names)
        self.split: Optional[tuple[Any, Any]] = None

    def arg_class(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """What Triton specializes the runtime arguments on (a superset): every non-tensor
        argument's value, each tensor's dtype and 16-byte alignment. Tensors sit at the same
        positions in every call of a kernel (found on the first); else AttributeError."""
        if self.split is None:
            at_t = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            at_o = [i for i in range(len(args)) if i not in at_t]
            # itemgetter of one index returns the item, not a 1-tuple: pad with a constant position
            self.split = (itemgetter(*at_t, *at_t[:1]), itemgetter(*at_o, *at_t[:1]) if at_o else None)
        get_t, get_o = self.split
        ts = get_t(args)
        return (get_o(args)[:-1] if get_o is not None else (), tuple([t.dtype for t in ts]),
                tuple([t.data_ptr() & 15 for t in ts]), len(args))

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


def _has_default(p: Any) -> bool:
    return getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty


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
        return k

    def __call__(self, fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: dict[str, Any]) -> None:
        """``fn[grid](*args, **kwargs, **options)``; ``kwargs`` are the constexprs, ``options``
        Triton's launch options (``num_warps``, ``launch_pdl``...)."""
        k = self._kernel(fn)
        if k.disabled or _hooks_installed():
            return self._through_triton(fn, grid, args, kwargs, options)
        try:
            active = _driver().active
            dev = active.get_current_device()
            key = (dev, k.arg_class(args), tuple(kwargs.items()), tuple(options.items()))
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
            src = getattr(compiled, "src", None)
            sig = getattr(src, "signature", None)
            # Triton >= 3.3 launches with every parameter, constexprs included (their launcher skips
            # them); an older one wants the runtime ones only: keep its path
            if tail is None or not hasattr(compiled, "function") or sig is None or len(sig) != len(k.names):
                k.disabled = True
                return
            if len(k.binaries) >= MAX_CLASSES:
                k.binaries.clear()
            k.binaries[key] = (compiled, tail)
            return
        compiled, tail = kept
        g = (*grid, 1, 1)
        stream = active.get_current_stream(dev)
        try:
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *tail)
        except Exception:   # the launcher's calling convention is not the one this Triton has
            k.disabled = True
            return self._through_triton(fn, grid, args, kwargs, options)
        self._counts["direct"] += 1

    def _through_triton(self, fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
                        options: dict[str, Any]) -> None:
        """Triton's own launch, for a kernel (or a call) the direct launch does not take."""
        self._counts["disabled"] += 1
        fn[grid](*args, **kwargs, **options)


_DEFAULT = FastLauncher()


def launch(fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any],
           fast: bool) -> None:
    """``fn[grid](*args, **kwargs, **options)``, through the process's :class:`FastLauncher` when ``fast``."""
    if fast:
        _DEFAULT(fn, grid, args, kwargs, options)
    else:
        fn[grid](*args, **kwargs, **options)
