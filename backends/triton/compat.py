"""Triton's private internals that the Triton plugins rely on: named, looked up and checked here only.

The kernels use Triton's public language (``triton.jit``, ``triton.language``).
Three features of the launch layer need more, which a Triton release may move:

* **the direct launch** (:mod:`.fast_launch`): a compiled kernel's launcher is
  called as Triton's own JIT calls it, ``run(grid x 3, stream, function,
  packed metadata, launch metadata, enter hook, exit hook, *every parameter)``
  (:data:`LAUNCH_HEAD` leading arguments); it reads a JIT function's
  parameters, the driver's current device and stream, and where a profiler's
  launch hooks are installed;
* **the interpreter patches** (:mod:`.interpreter`, :mod:`.interpreter_speed`):
  the interpreter's builder, grid executor, reductions and sorts they replace,
  reached through :func:`interpreter_module`;
* **PyTorch's raw stream handle** (:data:`current_raw_stream`, for
  :mod:`.arrivals`), and which mode the kernels were decorated in
  (:func:`kernel_mode`).

:data:`INTERNALS` names what each feature reads; :func:`missing` says which of
them the installed Triton lacks, and the feature's user then turns itself off
and says why in a warning (the direct launch falls back to Triton's launch,
the interpreter patches are left out): never an error at import, never a wrong
launch. :data:`RELEASES` pins, per range of Triton releases, the facts that
differ between them; :func:`release_note` says when the installed Triton is
none of them (it is used as it is, checked by :func:`missing` alone).
tests/test_triton_compat.py fails on a Triton that moved any internal named
here or that no row of :data:`RELEASES` describes, and on a module of
``mm3_backends`` other than this one that imports a private module.

Nothing here imports Triton when this module is imported.

Example:
    >>> LAUNCH_HEAD
    9
    >>> release_for((3, 6)).topk_descending, release_for((3, 9)).topk_descending
    (False, True)
    >>> release_for((3, 1)) is None
    True
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

__all__ = ["INTERNALS", "RELEASES", "Release", "LAUNCH_HEAD", "DIRECT_LAUNCH", "BF16", "BOUNDS", "SHORTCUTS",
           "RAW_STREAM",
           "missing", "lookup", "release_for", "installed_version", "release_note", "checked_releases",
           "interpreter_problem",
           "interpreter_module",
           "kernel_mode", "unspecialized_params", "jit_params", "JitParams", "compiled_launch", "launcher_problem",
           "active_driver", "hooks_installed", "hook_holder", "current_raw_stream"]

#: the launcher's leading parameters: grid (3), stream, function, packed metadata, launch metadata
#: and the enter/exit hooks; the kernel's parameters follow as ``*args``
LAUNCH_HEAD = 9

DIRECT_LAUNCH = "direct launch"
BF16 = "bf16 under the interpreter"
BOUNDS = "bounds checked under the interpreter"
RAW_STREAM = "raw stream handle"
#: the interpreter shortcuts of :mod:`.interpreter_speed`, by name
SHORTCUTS = ("unread overflow checks", "helper calls patched once", "column fold", "numpy sorts")

_INTERP = "triton.runtime.interpreter"
#: where a release keeps the launch hooks, newest first (Triton < 3.4: on CompiledKernel)
_HOOK_HOLDERS = ("triton.knobs:runtime", "triton.compiler:CompiledKernel")

#: feature -> the internals it reads, ``module:attribute.path``; ``a | b``: whichever is found first
INTERNALS: dict[str, tuple[str, ...]] = {
    DIRECT_LAUNCH: (
        "triton.runtime.jit:JITFunction.run",          # its call of kernel.run is the convention
        "triton.runtime.driver:driver",
        " | ".join(f"{holder}.launch_enter_hook" for holder in _HOOK_HOLDERS),
        " | ".join(f"{holder}.launch_exit_hook" for holder in _HOOK_HOLDERS),
        "triton.backends.nvidia.driver:CudaLauncher.__call__",
        "triton.backends.amd.driver:HIPLauncher.__call__",
    ),
    BF16: tuple(f"{_INTERP}:{name}" for name in (
        "InterpreterBuilder.cast_impl", "InterpreterBuilder.create_fp_to_fp", "InterpreterBuilder.binary_op",
        "InterpreterBuilder.unary_op", "InterpreterBuilder.create_dot", "TensorHandle", "_get_np_dtype",
        "_ir.ROUNDING_MODE.RTZ")),
    BOUNDS: tuple(f"{_INTERP}:{name}" for name in (
        "GridExecutor._init_args_hst", "GridExecutor.__call__", "InterpreterBuilder.create_masked_load",
        "InterpreterBuilder.create_masked_store", "InterpreterBuilder.create_atomic_rmw",
        "InterpreterBuilder.create_atomic_cas", "TensorHandle", "_get_np_dtype")),
    "unread overflow checks": (f"{_INTERP}:interpreter_semantic.binary_op_sanitize_overflow_impl",
                               f"{_INTERP}:interpreter_builder.options"),
    "helper calls patched once": (f"{_INTERP}:GridExecutor.__call__", f"{_INTERP}:_patch_lang",
                                  f"{_INTERP}:_LangPatchScope"),
    "column fold": (f"{_INTERP}:ReduceOps.generic_reduce", f"{_INTERP}:ReduceOps.unravel",
                    f"{_INTERP}:ReduceOps.to_tensor"),
    "numpy sorts": (f"{_INTERP}:TensorHandle", "triton.language:topk", "triton.language:sort",
                    "triton.language.standard:topk", "triton.language.standard:sort"),
    RAW_STREAM: ("torch._C:_cuda_getCurrentRawStream",),
}


@dataclass(frozen=True)
class Release:
    """What the Triton releases ``first`` to ``last`` (major, minor) keep where, read from the
    source of each release in ``read`` (the ones the suite ran on: CI's and the H200's)."""

    first: tuple[int, int]
    last: tuple[int, int]
    read: tuple[str, ...]
    #: where the launch hooks live (:func:`hook_holder`)
    hooks: str
    #: a hook is a chain of callables (``.calls``), not one callable or None
    hook_chain: bool
    #: ``tl.topk`` takes ``descending`` (the numpy-sort shortcut passes it on only when given)
    topk_descending: bool
    #: the launchers name every leading argument (else grid, stream and function, then ``*args``);
    #: both take :data:`LAUNCH_HEAD` arguments then the kernel's
    launcher_names_head: bool
    #: the CPU interpreter takes a loop bound computed by a reduction (``tl.range(0, tl.max(x, 0))``,
    #: as every kernel here has one); where it does not, no kernel runs under it (:func:`interpreter_problem`)
    interpreter_runs_kernels: bool


RELEASES: tuple[Release, ...] = (
    Release((3, 6), (3, 6), ("3.6.0",), hooks="triton.knobs:runtime", hook_chain=True, topk_descending=False,
            launcher_names_head=False, interpreter_runs_kernels=False),
    Release((3, 9), (3, 9), ("3.9.0",), hooks="triton.knobs:runtime", hook_chain=True, topk_descending=True,
            launcher_names_head=True, interpreter_runs_kernels=True),
)


def release_for(version: tuple[int, int]) -> Optional[Release]:
    """The row of :data:`RELEASES` that holds ``version`` (major, minor), or None."""
    return next((r for r in RELEASES if r.first <= version <= r.last), None)


@functools.lru_cache(maxsize=1)
def installed_version() -> Optional[tuple[int, int]]:
    """(major, minor) of the Triton this process imports, without importing it; None if there is none
    (asked once: the probes ask on every selection)."""
    mod = sys.modules.get("triton")
    text = getattr(mod, "__version__", None)
    if text is None:
        from importlib import metadata

        dists = metadata.packages_distributions().get("triton", [])
        for dist in dists:   # "triton"; ROCm builds of PyTorch ship "pytorch-triton-rocm"
            try:
                text = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    if not text:
        return None
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def checked_releases(sep: str = ", ", interpreting: bool = False) -> str:
    """The Triton releases :data:`RELEASES` describes, joined by ``sep`` (``interpreting``: those whose
    interpreter runs the kernels)."""
    return sep.join(v for r in RELEASES if r.interpreter_runs_kernels or not interpreting for v in r.read)


def release_note() -> str:
    """'' when the installed Triton is a release :data:`RELEASES` describes, else a sentence saying so."""
    version = installed_version()
    if version is None or release_for(version) is not None:
        return ""
    return (f"Triton {version[0]}.{version[1]} is not a release mm3_backends.triton was checked on "
            f"({checked_releases()}): "
            f"its private internals are looked up before use, and a feature that does not find them is "
            f"turned off with a warning")


def interpreter_problem() -> str:
    """Why the installed Triton's CPU interpreter cannot run the kernels ('' where it can, or no row says)."""
    version = installed_version()
    row = release_for(version) if version is not None else None
    if row is None or row.interpreter_runs_kernels:
        return ""
    runs = checked_releases(interpreting=True)
    return (f"Triton {version[0]}.{version[1]}'s interpreter cannot run these kernels (a loop bound computed by a "
            f"reduction is a one-element array there, not a number); run them on a GPU, or under "
            f"TRITON_INTERPRET=1 with Triton {runs}")


_NOT_FOUND = object()


def lookup(internal: str) -> Any:
    """The object ``module:attribute.path`` names (the first found of ``a | b``), or raise LookupError
    saying what is missing."""
    reasons = []
    for option in internal.split("|"):
        module_name, _, path = option.strip().partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as e:   # noqa: BLE001 - a module that fails to import is a missing internal
            reasons.append(f"{module_name} ({type(e).__name__}: {e})")
            continue
        for name in path.split("."):
            obj = getattr(obj, name, _NOT_FOUND)
            if obj is _NOT_FOUND:
                reasons.append(f"{module_name}:{path} (no {name})")
                break
        else:
            return obj
    raise LookupError(" and ".join(reasons))


def missing(feature: str) -> list[str]:
    """What ``feature`` (a key of :data:`INTERNALS`) reads and the installed Triton lacks ([]: all there)."""
    found = []
    for internal in INTERNALS[feature]:
        try:
            lookup(internal)
        except LookupError as e:
            found.append(str(e))
    return found


def interpreter_module() -> Any:
    """Triton's interpreter module (``triton.runtime.interpreter``), or None where it is not there."""
    try:
        return importlib.import_module(_INTERP)
    except Exception:   # noqa: BLE001 - its features then report what they miss
        return None


# -- kernels -------------------------------------------------------------------------------------------------

def kernel_mode(kernel: Any) -> str:
    """'compiled' for a ``triton.jit`` function Triton compiles for a GPU, 'interpreted' for one it
    runs in its CPU interpreter (``TRITON_INTERPRET=1`` when it was decorated)."""
    from triton import JITFunction

    return "compiled" if isinstance(kernel, JITFunction) else "interpreted"


def unspecialized_params(kernel: Any) -> set[str]:
    """The parameters ``kernel`` declares ``do_not_specialize`` (:func:`.tl_utils.step_kernel`), compiled
    or interpreted (the interpreter keeps the declaration, not Triton's parameter objects)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    names = list(getattr(kernel, "arg_names", ()))
    return {n if isinstance(n, str) else names[n] for n in getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()}


class JitParams(NamedTuple):
    """A compiled JIT function's parameters, as the direct launch needs them."""

    names: list[str]
    #: name -> default, of the parameters that have one
    defaults: dict[str, Any]
    #: positions of the runtime parameters Triton does not specialize (``do_not_specialize``)
    free: frozenset[int]


def jit_params(fn: Any) -> Optional[JitParams]:
    """``fn``'s parameters when it is a JIT function with binaries per device; None for anything
    else (an interpreted function, a wrapper, a test's recorder), which is launched as it asks."""
    names = list(getattr(fn, "arg_names", ()))
    if not (hasattr(fn, "device_caches") and names):
        return None
    params = getattr(fn, "params", ())
    empty = inspect.Parameter.empty
    return JitParams(names, {p.name: p.default for p in params if getattr(p, "default", empty) is not empty},
                     frozenset(p.num for p in params if getattr(p, "do_not_specialize", False)
                               and not getattr(p, "is_constexpr", True)))


def compiled_launch(compiled: Any, num_params: int) -> Union[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """``(launcher, leading arguments after the stream)`` of the kernel Triton's launch returned, for
    ``launcher(gx, gy, gz, stream, *leading, *every parameter)``; or why it cannot be launched so."""
    sig = getattr(getattr(compiled, "src", None), "signature", None)
    # Triton >= 3.3 launches with every parameter, constexprs included (its launcher skips them); an
    # older one wants the runtime ones only
    if not hasattr(compiled, "function") or sig is None or len(sig) != num_params:
        return ("the compiled kernel's source signature does not list every parameter, constexprs included "
                "(Triton < 3.3 launches the runtime ones only)")
    run = compiled.run
    problem = launcher_problem(type(run))
    if problem:
        return problem
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


_PROBLEMS: dict[type, str] = {}


def launcher_problem(launcher_type: type) -> str:
    """'' when a compiled kernel's launcher (an instance of ``launcher_type``) can take the call the direct
    launch makes (:data:`LAUNCH_HEAD` positional arguments, then the kernel's), else why it cannot."""
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


# -- the driver and the launch hooks -------------------------------------------------------------------------

_DRIVER: Any = None


def active_driver() -> Any:
    """Triton's active driver (current device and stream); RuntimeError where there is no GPU driver."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = lookup(INTERNALS[DIRECT_LAUNCH][1])
    return _DRIVER.active


_HOOKS: Any = None


def hook_holder() -> Any:
    """The object whose ``launch_enter_hook`` / ``launch_exit_hook`` Triton calls around a launch
    (looked up once: an import per launch costs ~1 us)."""
    global _HOOKS
    if _HOOKS is None:
        for holder in _HOOK_HOLDERS:
            try:
                found = lookup(holder)
            except LookupError:
                continue
            if hasattr(found, "launch_enter_hook") and hasattr(found, "launch_exit_hook"):
                _HOOKS = found
                break
        else:
            raise LookupError(f"no launch hooks on {' or '.join(_HOOK_HOLDERS)}")
    return _HOOKS


def _installed(hook: Any) -> bool:
    # a chain of hooks (empty: nothing installed), or on older releases a callable or None
    return hook is not None and bool(getattr(hook, "calls", True))


def hooks_installed() -> bool:
    """A launch enter/exit hook (a profiler) is installed: it needs Triton's launch metadata."""
    h = _HOOKS if _HOOKS is not None else hook_holder()
    return _installed(h.launch_enter_hook) or _installed(h.launch_exit_hook)


# -- PyTorch ------------------------------------------------------------------------------------------------

def _raw_stream_getter() -> Callable[[int], int]:
    try:   # the raw handle without a Stream object (what Triton's launcher uses; CUDA and ROCm builds)
        return lookup(INTERNALS[RAW_STREAM][0])
    except LookupError:
        return lambda index: torch.cuda.current_stream(index).cuda_stream


#: ``current_raw_stream(device_index)``: the handle of the device's current stream
current_raw_stream: Callable[[int], int] = _raw_stream_getter()
