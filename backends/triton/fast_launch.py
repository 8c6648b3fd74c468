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

The one adapter to Triton's internals: the kept binary's launcher
(``CompiledKernel.run``) is called as Triton's own JIT calls it,
``run(grid_x, grid_y, grid_z, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *every_parameter)`` (Triton 3.3 to
3.9, NVIDIA and AMD launchers alike), with no launch metadata and no hooks.
:func:`launcher_problem` checks a launcher against that call before its first
use. Where the installed Triton's launcher does not take it, or its launcher
passes the runtime parameters only (Triton < 3.3), or the first direct launch
raises, the kernel falls back to ``kernel[grid](...)`` for good and a
:class:`FastLaunchWarning` says so, once per reason: the launches stay
right, only slower. tests/test_fast_launch.py fails on a Triton whose
launchers take another call. Interpreted kernels (``TRITON_INTERPRET=1``)
take Triton's path silently (nothing is compiled), and so does every call
while a launch hook (a profiler) is installed, which needs Triton's launch
metadata.

Example:
    >>> fast = FastLauncher()
    >>> fast.stats()
    {'direct': 0, 'triton': 0, 'disabled': 0}
"""

from __future__ import annotations

import inspect
import threading
import warnings
from operator import itemgetter
from typing import Any, Optional

import torch

__all__ = ["FastLauncher", "FastLaunchWarning", "launch", "launcher_problem", "MAX_CLASSES", "LAUNCH_HEAD"]

#: call classes kept per kernel before the memory starts over
MAX_CLASSES = 1024

_I32_END = 2**31


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
    h = _HOOKS if _HOOKS is not None else _hook_holder()
    try:
        return _installed(h.launch_enter_hook) or _installed(h.launch_exit_hook)
    except AttributeError:
        return False


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
        #: call class -> (the binary's launcher, its leading arguments, the constexprs' values)
        self.binaries: dict[Any, tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = {}
        # an InterpretedFunction has no device caches; anything else that is not a JIT function
        # (a wrapper, a test's recorder) is launched as it asks to be
        self.disabled = not (hasattr(fn, "device_caches") and self.names)
        self.split: Optional[tuple[Any, Any, Any]] = None
        #: positions of the runtime parameters Triton does not specialize (``do_not_specialize``)
        self.free = frozenset(p.num for p in getattr(fn, "params", ())
                              if getattr(p, "do_not_specialize", False) and not getattr(p, "is_constexpr", True))
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


#: the launcher's leading parameters: grid (3), stream, function, packed metadata, launch metadata
#: and the enter/exit hooks; the kernel's parameters follow as ``*args``
LAUNCH_HEAD = 9


class FastLaunchWarning(RuntimeWarning):
    """The direct launch is off for a kernel: it launches through Triton's own binding (slower host)."""


_PROBLEMS: dict[type, str] = {}
_WARNED: set[str] = set()


def launcher_problem(launcher_type: type) -> str:
    """'' when a compiled kernel's launcher (an instance of ``launcher_type``) can take the call this
    module makes (:data:`LAUNCH_HEAD` positional arguments, then the kernel's), else why it cannot."""
    problem = _PROBLEMS.get(launcher_type)
    if problem is None:
        try:
            params = list(inspect.signature(launcher_type.__call__).parameters.values())[1:]   # after self
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            rest = any(p.kind == p.VAR_POSITIONAL for p in params)
            keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
            problem = "" if rest and len(positional) <= LAUNCH_HEAD and not keywords else (
                f"{launcher_type.__qualname__}({', '.join(map(str, params))}) does not take "
                f"{LAUNCH_HEAD} launch arguments then the kernel's, as Triton's JIT passes them")
        except (TypeError, ValueError) as e:
            problem = f"the signature of {launcher_type!r} cannot be read ({e})"
        _PROBLEMS[launcher_type] = problem
    return problem


def _fall_back(kernel: "_Kernel", why: str) -> None:
    """Turn the direct launch off for ``kernel``, and say why (once per reason and process)."""
    kernel.disabled = True
    if why not in _WARNED:
        _WARNED.add(why)
        import triton

        warnings.warn(f"mm3_backends.triton.fast_launch: {why} (Triton {triton.__version__}); kernels such as "
                      f"{getattr(kernel.fn, '__name__', kernel.fn)!s} launch through Triton's own binding, right "
                      f"but with more host time per launch", FastLaunchWarning, stacklevel=3)


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
        Triton's launch options (``num_warps``, ``launch_pdl``...). Both are taken by identity once
        seen (a plan's dicts, kept per shape class): a caller must not change them in place."""
        k = self._kernel(fn)
        if k.disabled or _hooks_installed():
            return self._through_triton(fn, grid, args, kwargs, options)
        try:
            active = _driver().active
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
            src = getattr(compiled, "src", None)
            sig = getattr(src, "signature", None)
            # Triton >= 3.3 launches with every parameter, constexprs included (their launcher skips
            # them); an older one wants the runtime ones only: keep its path
            if tail is None or not hasattr(compiled, "function") or sig is None or len(sig) != len(k.names):
                return _fall_back(k, "the compiled kernel's source signature does not list every parameter, "
                                     "constexprs included (Triton < 3.3 launches the runtime ones only)")
            run = compiled.run
            problem = launcher_problem(type(run))
            if problem:
                return _fall_back(k, problem)
            if len(k.binaries) >= MAX_CLASSES:
                k.binaries.clear()
            k.binaries[key] = (run, (compiled.function, compiled.packed_metadata, None, None, None), tail)
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


def launch(fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any],
           fast: bool) -> None:
    """``fn[grid](*args, **kwargs, **options)``, through the process's :class:`FastLauncher` when ``fast``."""
    if fast:
        _DEFAULT(fn, grid, args, kwargs, options)
    else:
        fn[grid](*args, **kwargs, **options)
